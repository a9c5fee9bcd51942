"""Conversations JSONL → examples.parquet: overbrainer's split vs the Hugging Face datasets path.

    bench/.venv/bin/python bench/split.py [--rows 500000] [--reps 1]

Synthetic data (made once, cached in the work folder): OpenAI-style ``messages`` rows, a
system prompt in 30% of them, 1 to 4 user/assistant exchanges (65/22/9/4%), word counts
drawn from log-normal distributions (user median 12 words, assistant median 30, capped at
1,500), about 0.7 kB a row; 1% of the rows are exact duplicates of earlier ones.

Two files: ``valid.jsonl`` (every row valid) and ``invalid.jsonl`` (the same rows with
0.5% invalid ones spread through it: a conversation that ends with the user, an empty
assistant answer, an unknown role). The two sides treat invalid rows differently, by design:

- overbrainer validates every row and refuses a file with a bad row (one error, with its
  ``file:line`` and how many more there are; nothing written). So it is timed on
  ``valid.jsonl``, and separately on how fast it rejects ``invalid.jsonl``.
- The ``datasets`` path (what a user writes: ``load_dataset("json")``, ``filter`` with a
  validity check, ``train_test_split``, a ``split`` column, ``to_parquet``) drops invalid
  rows silently; it is timed on both files. It keeps the duplicates (datasets has no
  dedupe), normalizes nothing, and its split is a random permutation, not a content hash.

Two more cases, on the same rows:

- *mixed*: three sources with weights 2:1:1, an OpenAI ``messages`` JSONL (half the rows),
  an Alpaca JSONL and a prompt/completion CSV (a quarter each, single exchanges): overbrainer's
  ``split_sources`` against what a ``datasets`` user writes (``load_dataset`` json/csv, ``map``
  to messages, ``filter``, ``interleave_datasets`` with probabilities 0.5/0.25/0.25 and
  ``all_exhausted``, ``train_test_split``, ``to_parquet``);
- *save_to_disk*: ``valid.jsonl`` saved once with ``datasets.save_to_disk`` (not timed), then
  read by overbrainer's split against ``load_from_disk``, ``filter``, split, ``to_parquet``.

Each run is its own process (``ru_maxrss`` from ``wait4`` is its peak RSS), with a fresh
``HF_DATASETS_CACHE`` so that the datasets path pays its JSON → Arrow conversion as a first
run does. rows/s counts the input file's rows over the whole process's wall time (imports
included) and over the work alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, human_bytes, measure, print_machine, save_json, table, work_dir  # noqa: E402

ROLES = ("system", "user", "assistant", "tool")


# --- the data ----------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ta", "ren", "sa", "vo", "ix", "un", "pe", "dra", "ol", "es", "qu", "ny", "th"]
    return ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(n)]


def _text(rng: random.Random, words: list[str], median: float, cap: int) -> str:
    n = max(1, min(cap, int(rng.lognormvariate(math.log(median), 0.9))))
    out = rng.choices(words, k=n)
    out[0] = out[0].capitalize()
    return " ".join(out) + rng.choice([".", "?", "!", "."])


def make_data(folder: Path, rows: int, seed: int = 0) -> tuple[Path, Path, dict]:
    valid, invalid, meta = folder / "valid.jsonl", folder / "invalid.jsonl", folder / "data.json"
    want = {"rows": rows, "seed": seed, "version": 1}
    if meta.exists() and json.loads(meta.read_text()).get("want") == want and valid.exists() and invalid.exists():
        return valid, invalid, json.loads(meta.read_text())
    print(f"making {rows:,} synthetic conversations ...", flush=True)
    rng = random.Random(seed)
    words = _words(rng, 20_000)
    lines: list[str] = []
    for _ in range(rows):
        if lines and rng.random() < 0.01:
            lines.append(lines[rng.randrange(len(lines))])  # an exact duplicate
            continue
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": _text(rng, words, 20, 200)})
        pairs = rng.choices([1, 2, 3, 4], weights=[65, 22, 9, 4])[0]
        for _ in range(pairs):
            messages.append({"role": "user", "content": _text(rng, words, 12, 1500)})
            messages.append({"role": "assistant", "content": _text(rng, words, 30, 1500)})
        lines.append(json.dumps({"messages": messages}, ensure_ascii=False))
    valid.write_text("\n".join(lines) + "\n")
    bad = 0
    with open(invalid, "w") as f:
        for line in lines:
            f.write(line + "\n")
            if rng.random() < 0.005:
                row = json.loads(line)
                kind = rng.randrange(3)
                if kind == 0:
                    row["messages"] = row["messages"][:-1]  # ends with the user
                elif kind == 1:
                    row["messages"][-1]["content"] = "   "  # an empty answer
                else:
                    row["messages"][-2]["role"] = "bot"  # an unknown role
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                bad += 1
    info = {"want": want, "valid_rows": rows, "invalid_rows": rows + bad, "bad_rows": bad,
            "valid_bytes": valid.stat().st_size, "invalid_bytes": invalid.stat().st_size}
    meta.write_text(json.dumps(info))
    return valid, invalid, info


def make_mixed(folder: Path, valid: Path) -> tuple[dict, int]:
    """The mixed case's three files, from valid.jsonl's rows; and their total rows."""
    import csv

    meta = folder / "mixed.json"
    paths = {"openai": folder / "mixed-openai.jsonl", "alpaca": folder / "mixed-alpaca.jsonl",
             "csv": folder / "mixed-pc.csv"}
    if meta.exists() and all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}, json.loads(meta.read_text())["rows"]
    lines = valid.read_text().splitlines()
    half = len(lines) // 2
    singles = [json.loads(line)["messages"] for line in lines[half:]]
    singles = [m for m in singles if len(m) == 2 or (len(m) == 3 and m[0]["role"] == "system")]
    quarter = len(singles) // 2
    paths["openai"].write_text("\n".join(lines[:half]) + "\n")
    with open(paths["alpaca"], "w") as f:
        for m in singles[:quarter]:
            row = {"instruction": m[-2]["content"], "input": "", "output": m[-1]["content"]}
            if len(m) == 3:
                row["system"] = m[0]["content"]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for m in singles[quarter:]:
            w.writerow([m[-2]["content"], m[-1]["content"]])
    rows = half + len(singles)
    meta.write_text(json.dumps({"rows": rows}))
    return {k: str(v) for k, v in paths.items()}, rows


def make_disk(folder: Path, valid: Path) -> Path:
    disk = folder / "saved"
    if not (disk / "state.json").exists():
        from datasets import load_dataset

        load_dataset("json", data_files=str(valid), split="train").save_to_disk(str(disk))
    return disk


# --- the workers (each in its own process) -----------------------------------------------


def is_valid(row: dict) -> bool:
    """The check a datasets user writes for what overbrainer validates."""
    messages = row.get("messages")
    if not messages:
        return False
    for m in messages:
        if m is None or m.get("role") not in ROLES:
            return False
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            return False
    return messages[-1]["role"] == "assistant"


def worker_overbrainer(src: Path, out: Path) -> dict:
    from overbrainer.errors import DataError
    from overbrainer.inputs.conversations import split_conversations

    t = time.perf_counter()
    try:
        summary = split_conversations([src], out, validation=0.1, seed=0)
    except DataError as e:
        return {"work_s": time.perf_counter() - t, "rejected": str(e).splitlines()[0][:200]}
    return {"work_s": time.perf_counter() - t, "rows_out": summary.rows, "train": summary.train,
            "validation": summary.validation, "duplicates": summary.duplicates}


def _overbrainer_sources(entries: list[dict], out: Path) -> dict:
    from overbrainer.inputs.conversations import split_sources
    from overbrainer.inputs.sources import resolve_sources

    t = time.perf_counter()
    summary = split_sources(resolve_sources(entries, Path("/"), "bench"), out, validation=0.1, seed=0)
    return {"work_s": time.perf_counter() - t, "rows_out": summary.rows, "train": summary.train,
            "validation": summary.validation, "duplicates": summary.duplicates}


def worker_overbrainer_mixed(src: Path, out: Path) -> dict:
    paths = json.loads(src.read_text())
    weights = {"openai": 2, "alpaca": 1, "csv": 1}
    return _overbrainer_sources([{"path": paths[k], "weight": w} for k, w in weights.items()], out)


def worker_overbrainer_disk(src: Path, out: Path) -> dict:
    return _overbrainer_sources([{"path": str(src)}], out)


def _alpaca_messages(row: dict) -> dict:
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]}


def _pc_messages(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]}


def _finish(ds, out: Path, t: float) -> dict:
    from datasets import concatenate_datasets

    parts = ds.train_test_split(test_size=0.1, seed=0)
    train = parts["train"].add_column("split", ["train"] * len(parts["train"]))
    test = parts["test"].add_column("split", ["validation"] * len(parts["test"]))
    concatenate_datasets([train, test]).to_parquet(str(out))
    return {"work_s": time.perf_counter() - t, "rows_out": len(train) + len(test), "train": len(train),
            "validation": len(test)}


def worker_datasets_mixed(src: Path, out: Path) -> dict:
    from datasets import interleave_datasets, load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    paths = json.loads(src.read_text())
    t = time.perf_counter()
    a = load_dataset("json", data_files=paths["openai"], split="train").filter(is_valid)
    b = load_dataset("json", data_files=paths["alpaca"], split="train")
    b = b.map(_alpaca_messages, remove_columns=b.column_names).filter(is_valid)
    c = load_dataset("csv", data_files=paths["csv"], split="train")
    c = c.map(_pc_messages, remove_columns=c.column_names).filter(is_valid)
    mixed = interleave_datasets([a, b, c], probabilities=[0.5, 0.25, 0.25], seed=0,
                                stopping_strategy="all_exhausted")
    return _finish(mixed, out, t)


def worker_datasets_disk(src: Path, out: Path) -> dict:
    from datasets import load_from_disk
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    t = time.perf_counter()
    # no cache-*.arrow of an earlier run's filter: this run pays for its own
    return _finish(load_from_disk(str(src)).filter(is_valid, load_from_cache_file=False), out, t)


def worker_datasets(src: Path, out: Path) -> dict:
    from datasets import concatenate_datasets, load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    t = time.perf_counter()
    ds = load_dataset("json", data_files=str(src), split="train")
    loaded = time.perf_counter() - t
    ds = ds.filter(is_valid)
    parts = ds.train_test_split(test_size=0.1, seed=0)
    train = parts["train"].add_column("split", ["train"] * len(parts["train"]))
    test = parts["test"].add_column("split", ["validation"] * len(parts["test"]))
    concatenate_datasets([train, test]).to_parquet(str(out))
    return {"work_s": time.perf_counter() - t, "load_s": loaded, "rows_out": len(train) + len(test),
            "train": len(train), "validation": len(test)}


WORKERS = {
    "overbrainer": worker_overbrainer, "datasets": worker_datasets,
    "overbrainer_mixed": worker_overbrainer_mixed, "datasets_mixed": worker_datasets_mixed,
    "overbrainer_disk": worker_overbrainer_disk, "datasets_disk": worker_datasets_disk,
}


def run_worker(kind: str, src: Path, out: Path, scratch: Path) -> dict:
    cache = scratch / "hf-datasets-cache"
    shutil.rmtree(cache, ignore_errors=True)
    out.unlink(missing_ok=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HOME=str(scratch / "hf"), HF_HUB_OFFLINE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")
    m = measure([PY, __file__, "--worker", kind, "--input", str(src), "--out", str(out)], env=env).check()
    result = json.loads(m.stdout.strip().splitlines()[-1])
    result.update(wall_s=m.wall, cpu_s=m.user + m.system, maxrss_mb=m.maxrss_kb / 1024,
                  out_bytes=out.stat().st_size if out.exists() else 0)
    shutil.rmtree(cache, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=1, help="runs of each (the best is reported)")
    ap.add_argument("--only", help="run only the cases whose label holds this text (e.g. mixed)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.input, args.out)))
        return

    machine = print_machine()
    folder = work_dir(f"split-{args.rows}")
    valid, invalid, info = make_data(folder, args.rows)
    print(f"# valid.jsonl: {info['valid_rows']:,} rows, {human_bytes(info['valid_bytes'])}; invalid.jsonl: "
          f"{info['invalid_rows']:,} rows ({info['bad_rows']:,} bad), {human_bytes(info['invalid_bytes'])}", flush=True)
    for f in (valid, invalid):  # page-cached for every contender alike
        f.read_bytes()

    mixed, mixed_rows = make_mixed(folder, valid)
    (folder / "mixed-paths.json").write_text(json.dumps(mixed))
    disk = make_disk(folder, valid)
    cases = [
        ("overbrainer split_conversations", "overbrainer", valid, info["valid_rows"]),
        ("datasets load/filter/split/to_parquet", "datasets", valid, info["valid_rows"]),
        ("overbrainer rejects invalid file", "overbrainer", invalid, info["invalid_rows"]),
        ("datasets on invalid file (filters)", "datasets", invalid, info["invalid_rows"]),
        ("overbrainer mixed: 3 sources, weights", "overbrainer_mixed", folder / "mixed-paths.json", mixed_rows),
        ("datasets mixed: interleave_datasets", "datasets_mixed", folder / "mixed-paths.json", mixed_rows),
        ("overbrainer save_to_disk folder", "overbrainer_disk", disk, info["valid_rows"]),
        ("datasets load_from_disk", "datasets_disk", disk, info["valid_rows"]),
    ]
    rows, results = [], {"machine": machine, "data": info, "runs": {}}
    for label, kind, src, n in cases:
        if args.only and args.only not in label and label not in {c[0] for c in cases[:2]}:
            continue
        best = None
        for _ in range(args.reps):
            r = run_worker(kind, src, folder / f"out-{kind}.parquet", folder)
            if best is None or r["wall_s"] < best["wall_s"]:
                best = r
        results["runs"][label] = best
        print(f"{label:40} {best['wall_s']:7.2f} s wall, {best['work_s']:7.2f} s work, "
              f"{best['maxrss_mb']:7.0f} MB peak RSS  {best.get('rejected', '')}", flush=True)
        rows.append({
            "case": label, "input rows": n, "wall s": best["wall_s"], "CPU s": best["cpu_s"], "work s": best["work_s"],
            "rows/s (wall)": round(n / best["wall_s"]), "rows/s (work)": round(n / best["work_s"]),
            "peak RSS MB": best["maxrss_mb"], "rows out": best.get("rows_out", "rejected"),
        })
    ob, hf = results["runs"][cases[0][0]], results["runs"][cases[1][0]]
    rej = results["runs"].get(cases[2][0], {"wall_s": float("nan")})
    print()
    print(table(rows, ["case", "input rows", "wall s", "CPU s", "work s", "rows/s (wall)", "rows/s (work)", "peak RSS MB",
                       "rows out"]))
    speed = hf["wall_s"] / ob["wall_s"]
    print(f"\nvalid file: overbrainer {speed:.1f}x faster than datasets (wall; {hf['work_s'] / ob['work_s']:.1f}x on the "
          f"work alone), peak RSS {ob['maxrss_mb']:.0f} MB vs {hf['maxrss_mb']:.0f} MB "
          f"(input {human_bytes(info['valid_bytes'])})")
    print(f"goal >= 5x faster: {'met' if speed >= 5 else 'MISSED'} ({hf['cpu_s'] / ob['cpu_s']:.1f}x in CPU time); "
          f"memory: compare peak RSS across --rows")
    for a, b, what in ((cases[4][0], cases[5][0], "mixed (3 sources, weights)"),
                       (cases[6][0], cases[7][0], "save_to_disk folder")):
        if a not in results["runs"]:
            continue
        o, h = results["runs"][a], results["runs"][b]
        print(f"{what}: overbrainer {h['wall_s'] / o['wall_s']:.1f}x faster than datasets (wall; "
              f"{h['work_s'] / o['work_s']:.1f}x on the work, {h['cpu_s'] / o['cpu_s']:.1f}x in CPU time), peak RSS {o['maxrss_mb']:.0f} MB vs {h['maxrss_mb']:.0f} MB")
    print(f"invalid file: overbrainer rejected it in {rej['wall_s']:.2f} s ({rej.get('rejected', 'NOT rejected')})")
    print(f"# results: {save_json(f'split-{args.rows}', results)}")


if __name__ == "__main__":
    main()
