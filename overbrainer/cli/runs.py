"""The commands on runs: ``status``, ``runs``, ``stop``, ``resume``, ``wait``, ``metrics``, ``log``,
``checkpoints``, ``samples``, ``examples``, ``import``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .bake import finish
from .common import find_run, shown


def add_parsers(sub) -> None:
    p = sub.add_parser("status", help="a run's state and progress (all runs without RUN)")
    p.add_argument("run", nargs="?")
    p.add_argument("--json", action="store_true")
    p.add_argument("--repair", action="store_true",
                   help="rebuild a damaged run.json from the run folder's stamps and checkpoints")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("runs", help="every run, a line each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("stop", help="ask a run to save a checkpoint and stop at its next step")
    p.add_argument("run")
    p.add_argument("--no-wait", action="store_true", help="ask, and return at once")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for it (default 600)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("resume", help="continue a stopped or failed run from its last checkpoint")
    p.add_argument("run")
    p.add_argument("--detach", action="store_true", help="return at once")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("wait", help="follow a run until it ends")
    p.add_argument("run")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("metrics", help="a run's logged steps, as a table")
    p.add_argument("run")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object per line")
    fmt.add_argument("--csv", action="store_true")
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("log", help="the trainer's own output (log.txt)")
    p.add_argument("run")
    p.add_argument("-n", "--lines", type=int, default=40)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended, until the run ends")
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("checkpoints", help="a run's checkpoints")
    p.add_argument("run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("samples", help="a run's sample answers (train.samples), each prompt's side by side across steps")
    p.add_argument("run")
    p.add_argument("--full", action="store_true", help="whole answers, not one line each")
    p.add_argument("--json", action="store_true", help='[{"prompt", "answers": [{"step", "answer"}]}]')
    p.set_defaults(func=cmd_samples)

    p = sub.add_parser("examples", help="a few rows of a run's examples.parquet (after `overbrainer split PLAN`)")
    p.add_argument("run")
    p.add_argument("-n", "--rows", type=int, default=5, help="how many (default 5)")
    p.add_argument("--split", choices=["train", "validation"], help="only this split")
    p.add_argument("--json", action="store_true", help="the rows as one JSON object")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("import", help="bring the result of an exported job back into its run, verified")
    p.add_argument("run", help="the run folder (runs/NAME), its name, or its plan file")
    p.add_argument("result", help="the result.tar.gz the job wrote")
    p.set_defaults(func=cmd_import)


def cmd_status(args) -> int:
    from ..journal import Damaged
    from ..runtime.follow import describe
    from ..runtime.run import runs

    targets = [find_run(args.run, args.runs)] if args.run else runs(args.runs)
    if getattr(args, "repair", False):
        for run in targets:
            repaired = run.repair()
            said = "run.json is whole; nothing to repair" if repaired is None else f"run.json rebuilt: {repaired['state']}"
            print(f"{shown(run.folder.root)}: {said}")
    rows = []
    for run in targets:
        try:
            status, progress = run.status, run.progress()
        except Damaged as e:
            if args.run:
                raise
            status, progress = {"state": "damaged", "reason": str(e)}, {"state": "damaged"}
        rows.append({**status, "folder": str(run.folder.root), "progress": progress, "branches": run.branches()})
    if args.json:
        print(json.dumps(rows[0] if args.run else rows, indent=1))
        return 0
    if not rows:
        print("no runs yet; `overbrainer bake plans/demo.json` makes one")
    for row in rows:
        line = f"{shown(Path(row['folder']))}: {describe(row['progress'])}"
        if row.get("reason"):
            line += f"  ({row['reason']})"
        print(line)
        if row.get("slurm_jobs"):  # where.slurm: the last batch job of each step sent there
            print("  Slurm jobs: " + ", ".join(f"{step} {job}" for step, job in row["slurm_jobs"].items()))
        for label, b in row["branches"].items():
            state = "baked" if b["baked"] else f"step {b['step']}" if b["step"] is not None else "not started"
            print(f"  branch {label}: {state}, decayed from the trunk's {b['from'] or '(not yet)'}  "
                  f"{shown(Path(b['folder']))}")
    return 0


def cmd_runs(args) -> int:
    args.run = None
    return cmd_status(args)


def cmd_import(args) -> int:
    from ..where.receive import import_result

    run = find_run(args.run, args.runs)
    done = import_result(run.folder.root, Path(args.result), shown=shown)
    got = done.received
    plan = shown(Path(done.plan_file)) if done.plan_file else "PLAN"
    print(f"imported {got.files} files ({got.bytes / 1e6:.1f} MB) into {shown(run.folder.root)}, "
          f"each checked against the job's manifest ({len(got.listed)} files listed)")
    if got.state == "failed":
        print(f"error: {got.reason}; `overbrainer bake {plan}` exports the job again", file=sys.stderr)
        return 1
    if got.state == "stopped":
        print(f"the job stopped at step {got.step}; `overbrainer bake {plan}` exports a bundle that goes on from there")
    else:
        print(f"the job is done (step {got.step}); `overbrainer bake {plan}` goes on from here")
    return 0


def cmd_stop(args) -> int:
    from ..journal import ACTIVE

    run = find_run(args.run, args.runs)
    before = run.state
    if before not in ACTIVE:
        print(f"{shown(run.folder.root)} is not running ({before})")
        return 0
    state = run.stop(wait=not args.no_wait, timeout=args.timeout)
    steps = run.checkpoints()
    last = f"; last checkpoint: step {steps[-1]}" if steps else ""
    print(f"{shown(run.folder.root)}: {state}{last}")
    return 0 if state in ("stopped", "stopping", "done") else 1


def cmd_resume(args) -> int:
    from ..runtime.follow import follow

    run = find_run(args.run, args.runs)
    if run.state == "done":
        print(f"{shown(run.folder.root)} is done; nothing to resume")
        return 0
    run.resume()
    if args.detach:
        print(f"resumed {shown(run.folder.root)}")
        return 0
    follow(run)
    return finish(run.folder.root, {"folder": str(run.folder.root)}, False, sys.stdout, False)


def cmd_wait(args) -> int:
    from ..runtime.follow import follow

    run = find_run(args.run, args.runs)
    follow(run)
    return finish(run.folder.root, {"folder": str(run.folder.root)}, False, sys.stdout, False)


def cmd_metrics(args) -> int:
    run = find_run(args.run, args.runs)
    if args.json:
        for record in run.records():
            print(json.dumps(record))
        return 0
    if args.csv:
        sys.stdout.write(run.metrics_csv())
        return 0
    table = run.metrics()
    columns = [c for c in ("step", "tokens", "loss", "eval_loss", "lr", "seconds", "phase") if c in table.column_names]
    rows = [[_cell(v) for v in row] for row in zip(*(table.column(c).to_pylist() for c in columns))]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    return 0


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-2 and value else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def cmd_samples(args) -> int:
    import shutil
    import textwrap

    from ..trainers.samples import by_prompt, read_samples

    run = find_run(args.run, args.runs)
    prompts = by_prompt(read_samples(run.folder.samples))
    if args.json:
        print(json.dumps(prompts, indent=1))
        return 0
    if not prompts:
        print(f"{shown(run.folder.root)}: no samples yet (train.samples in the plan takes them while it trains)",
              file=sys.stderr)
        return 0
    width = shutil.get_terminal_size((100, 24)).columns
    for i, p in enumerate(prompts):
        print(("\n" if i else "") + "prompt: " + p["prompt"].replace("\n", " ⏎ "))
        w = max(len(str(a["step"])) for a in p["answers"])
        head = 2 + len("step ") + w + 2
        for a in p["answers"]:
            label = f"  step {a['step']:>{w}}  "
            if args.full:
                text = textwrap.fill(a["answer"], max(width - head, 20), subsequent_indent=" " * head) or "(nothing)"
            else:
                text = a["answer"].replace("\n", " ⏎ ") or "(nothing)"
                if len(text) > max(width - head, 20):
                    text = text[:max(width - head, 20) - 1] + "…"
            print(label + text)
    return 0


def cmd_log(args) -> int:
    import time

    from ..journal import ACTIVE

    run = find_run(args.run, args.runs)
    text = run.log(args.lines)
    if text:
        print(text)
    if not args.follow:
        return 0
    size = run.folder.log.stat().st_size if run.folder.log.exists() else 0
    try:
        while True:
            if run.folder.log.exists() and run.folder.log.stat().st_size > size:
                with open(run.folder.log, "rb") as f:
                    f.seek(size)
                    chunk = f.read()
                size += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            elif run.state not in ACTIVE:
                return 0
            time.sleep(0.3)
    except KeyboardInterrupt:
        return 0


def cmd_checkpoints(args) -> int:
    from ..trainers import checkpoint as ckpt

    run = find_run(args.run, args.runs)
    rows = []
    folders = [(None, run.folder.checkpoints)]
    folders += [(label, Path(b["folder"]) / "checkpoints") for label, b in run.branches().items()]
    for branch, checkpoints in folders:
        for step, folder in ckpt.complete(checkpoints):
            try:
                meta = ckpt.read_meta(folder)
            except ckpt.DamagedMeta as e:
                print(f"warning: {shown(e.path)} is damaged ({e.why}): not listed; the next bake "
                      "sets it aside and trains it again", file=sys.stderr)
                continue
            stable = bool(meta.get("trajectory")) and step <= meta.get("decay_start", -1)
            rows.append({"step": step, "path": str(folder), "phase": meta.get("phase"), "decayed": meta.get("decayed"),
                         "loss": meta.get("loss"), "eval_loss": meta.get("eval_loss"), "branch": branch,
                         "stable": branch is None and stable, "best": False})
    # the stable checkpoint with the best validation loss: where `overbrainer decay --at` may branch off
    scored = [r for r in rows if r["stable"] and r["eval_loss"] is not None]
    if scored:
        min(scored, key=lambda r: r["eval_loss"])["best"] = True
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{shown(run.folder.root)}: no checkpoint yet")
    for r in rows:
        note = "" if r["decayed"] else "  (not decayed)"
        if r["best"]:
            note += f"  best stable eval: overbrainer decay {shown(run.folder.root)} --at {r['step']}"
        ev = f"  eval {r['eval_loss']:.4f}" if r["eval_loss"] is not None else ""
        loss = f"  loss {r['loss']:.4f}" if r["loss"] is not None else ""
        where = f"branch {r['branch']}" if r["branch"] else "trunk"
        print(f"{where:<13} step {r['step']:>6}  {r['phase']:<7}{loss}{ev}  {shown(Path(r['path']))}{note}")
    return 0


def cmd_examples(args) -> int:
    from ..errors import RunStateError

    run = find_run(args.run, args.runs)
    path = run.folder.examples
    if not path.is_file():
        raise RunStateError(f"{shown(path)}: no examples yet; `overbrainer split PLAN` makes them")
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["id", "split", "messages", "source"])
    rows = [r for r in table.to_pylist() if args.split in (None, r["split"])]
    counts = {name: sum(1 for r in table.column("split").to_pylist() if r == name) for name in ("train", "validation")}
    if args.json:
        print(json.dumps({"examples": str(path), **counts, "rows": rows[: args.rows]}))
        return 0
    print(f"{shown(path)}: {counts['train']} train, {counts['validation']} validation; "
          f"{min(args.rows, len(rows))} of {len(rows)}{' ' + args.split if args.split else ''} shown")
    for r in rows[: args.rows]:
        print(f"\n{r['split']}  {r['id'][:12]}  {r['source']}")
        for m in r["messages"]:
            text = " ".join(m["content"].split())
            print(f"  {m['role']:>9}: {text if len(text) <= 100 else text[:99] + '…'}")
    return 0
