"""CLI start time on a finished run: wall time over 10 runs, and what the imports cost.

    bench/.venv/bin/python bench/cli_start.py [--runs 10]

The finished run: the tiny Llama of tests/tiny.py, 40 demo conversations, 8 steps, baked
once for real (and reused). Each command is the ``overbrainer`` console script in a fresh
process, as a user types it; commands the CLI does not have (yet) are skipped, and said
so. ``python -c pass`` is the floor no Python CLI goes under. Then, for each command,
``python -X importtime``: the slowest imports, and a check that no heavy package
(torch, transformers, peft, datasets, pyarrow) is imported on a path that only reads
state.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, measure, print_machine, save_json, table, venv_bin, work_dir  # noqa: E402

HEAVY = ("torch", "transformers", "peft", "datasets", "pyarrow", "numpy", "matplotlib")


def finished_run(root: Path) -> tuple[Path, Path, dict]:
    plan = root / "project" / "plan.json"
    runs = root / "runs"
    env = dict(os.environ, OVERBRAINER_CACHE=str(root / "cache"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if not (runs / "tiny" / ".stamps" / "bake.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        (root / "project").mkdir(parents=True)
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import make_tiny_llama

        make_tiny_llama(root / "project" / "tiny")
        lines = (REPO / "plans" / "data" / "pirate.jsonl").read_text().splitlines()[:40]
        (root / "project" / "chats.jsonl").write_text("\n".join(lines) + "\n")
        plan.write_text(json.dumps({
            "name": "tiny", "base": "./tiny", "data": "chats.jsonl", "split": {"validation": 0.2},
            "train": {"steps": 8, "micro_batch_size": 2, "sequence_len": 96, "lora_r": 4, "lora_alpha": 8},
        }, indent=1))
        print("baking the tiny plan once ...", flush=True)
        measure([venv_bin("overbrainer"), "bake", str(plan), "--runs", str(runs)], cwd=root, env=env).check()
    return plan, runs, env


def commands_available() -> tuple[set[str], str]:
    out = subprocess.run([venv_bin("overbrainer"), "--help"], capture_output=True, text=True).stdout
    m = re.search(r"\{([a-z,_-]+)\}", out)
    names = set(m.group(1).split(",")) if m else set(re.findall(r"^\s{4}([a-z][a-z-]+)\s", out, re.M))
    bake_help = subprocess.run([venv_bin("overbrainer"), "bake", "--help"], capture_output=True, text=True).stdout
    return names, bake_help


def importtime(argv: list[str], cwd, env) -> tuple[list[tuple[int, int, str]], int]:
    """(self µs, cumulative µs, module) of every import, and the command's exit code."""
    proc = subprocess.run([PY, "-X", "importtime", "-m", "overbrainer.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(4), len(m.group(3)) // 2))
    return rows, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()

    machine = print_machine()
    root = work_dir("cli")
    plan, runs, env = finished_run(root)
    run_dir = runs / "tiny"
    names, bake_help = commands_available()
    wanted = [
        ("bake --dry-run", "bake", ["bake", str(plan), "--dry-run"]),
        ("bake (no-op)", "bake", ["bake", str(plan)]),
        ("bake --foreground (no-op, through doit)", "bake", ["bake", str(plan), "--foreground"] if "--foreground" in bake_help else None),
        ("bake --check", "bake", ["bake", str(plan), "--check"] if "--check" in bake_help else None),
        ("status RUN", "status", ["status", str(run_dir)]),
        ("graph", "graph", ["graph", str(plan)]),
    ]
    skipped = []
    cmds = []
    for label, command, argv in wanted:
        if command not in names or argv is None:
            skipped.append(label)
            continue
        cmds.append((label, [*argv[:1], "--runs", str(runs), *argv[1:]] if command != "bake" else [*argv, "--runs", str(runs)]))
    if "status" in names:  # status takes --runs before the command
        cmds = [(lab, ["--runs", str(runs), "status", str(run_dir)] if lab == "status RUN" else a) for lab, a in cmds]

    floor_runs = [measure([PY, "-c", "pass"]) for _ in range(args.runs)]
    floor = sorted(m.wall for m in floor_runs)
    rows = [{"command": "python -c pass (the floor)", "median ms": 1000 * statistics.median(floor),
             "min ms": 1000 * floor[0], "max ms": 1000 * floor[-1],
             "CPU ms (median)": 1000 * statistics.median(m.user + m.system for m in floor_runs)}]
    results = {"machine": machine, "skipped": skipped, "commands": {}}
    heavy_found = {}
    for label, argv in cmds:
        ms, cpu = [], []
        for _ in range(args.runs + 1):
            m = measure([venv_bin("overbrainer"), *argv], cwd=root, env=env)
            if m.code != 0:
                raise SystemExit(f"{label}: exit {m.code}\n{m.stdout}\n{m.stderr}")
            ms.append(m.wall)
            cpu.append(m.user + m.system)
        ms, cpu = sorted(ms[1:]), sorted(cpu[1:])  # the first warms the page cache
        imports, _ = importtime(argv, root, env)
        heavy = sorted({name.split(".")[0] for _, _, name, _ in imports if name.split(".")[0] in HEAVY})
        heavy_found[label] = heavy
        total = sum(s for s, _, _, _ in imports)
        top = sorted((r for r in imports if r[3] == 0), key=lambda r: -r[1])[:8]
        by_self = sorted(imports, key=lambda r: -r[0])[:8]
        results["commands"][label] = {"argv": argv, "times": ms, "cpu": cpu, "imports_us": total, "heavy": heavy,
                                      "top": [(name, cum) for _, cum, name, _ in top],
                                      "top_self": [(name, own) for own, _, name, _ in by_self]}
        rows.append({"command": f"overbrainer {label}", "median ms": 1000 * statistics.median(ms), "min ms": 1000 * ms[0],
                     "CPU ms (median)": 1000 * statistics.median(cpu),
                     "max ms": 1000 * ms[-1], "imports ms": total / 1000, "heavy imports": ", ".join(heavy) or "none"})
        print(f"{label:40} median {1000 * statistics.median(ms):6.0f} ms; imports {total / 1000:.0f} ms; top: "
              + ", ".join(f"{name} {cum / 1000:.0f}" for _, cum, name, _ in top[:6]), flush=True)
    print()
    print(table(rows, ["command", "median ms", "min ms", "max ms", "CPU ms (median)", "imports ms", "heavy imports"]))
    if skipped:
        print(f"\nskipped (not in this CLI): {', '.join(skipped)}")
    print("\ntop-level imports by cumulative time (ms), per command:")
    for label, r in results["commands"].items():
        print(f"  {label}: " + ", ".join(f"{n} {c / 1000:.0f}" for n, c in r["top"]))
        print(f"  {'':{len(label)}}  by self time: " + ", ".join(f"{n} {c / 1000:.0f}" for n, c in r["top_self"]))
    goal = all(statistics.median(r["times"]) <= 0.150 for r in results["commands"].values())
    print(f"\ngoal <= 150 ms for every command: {'met' if goal else 'MISSED'}")
    bad = {k: v for k, v in heavy_found.items() if v}
    print(f"no heavy import on these paths: {'met' if not bad else 'MISSED: ' + json.dumps(bad)}")
    print(f"# results: {save_json('cli_start', results)}")


if __name__ == "__main__":
    main()
