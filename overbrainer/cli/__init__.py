"""The command line: parses, calls down, prints. No logic of its own.

Exit codes: 0 done (or stopped on request), 1 the run failed, 2 overbrainer could not run
it (bad plan, bad data, missing base, a run folder in the wrong state: the one line says
what, where and the fix), 130 interrupted.

A RUN argument is a run folder (``runs/demo``), a run's name (``demo``, under the runs
folder) or the plan file that names it (``plans/demo.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import OverbrainerError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overbrainer", description="Fine-tuning a language model, declared as a build.")
    parser.add_argument("--runs", help="where run folders live (default: $OVERBRAINER_RUNS or ./runs)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("bake", help="bake a plan: run every step that is not up to date")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--dry-run", action="store_true", help="list the steps that would run, and why")
    p.add_argument("--check", action="store_true",
                   help="run nothing: exit 0 when everything is up to date, 1 when a step would run (listed, with why)")
    p.add_argument("--json", action="store_true", help="end with one JSON object (folder, steps run and skipped, state)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="start the run in its own process and return at once")
    mode.add_argument("--foreground", action="store_true", help="run in this process (what CI and doit want)")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runs", dest="runs_here", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bake)

    p = sub.add_parser("graph", help="the plan's graph: steps and the files they write, coloured by status")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--format", choices=["text", "mermaid", "dot"], default="text")
    p.add_argument("--outs", action="store_true", help="the files alone, with an edge between files (like dvc dag --outs)")
    p.add_argument("--no-status", action="store_true", help="the graph alone, the same on every machine (no stamps read)")
    p.add_argument("--json", action="store_true", help="nodes, statuses and edges as one JSON object")
    p.add_argument("--runs", dest="runs_here", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("why", help="why each step would run: what changed, and what it makes rerun")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("step", nargs="?", help="one step (with the steps before it that make it run)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--runs", dest="runs_here", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_why)

    p = sub.add_parser("import", help="bring the result of an exported job back into its run, verified")
    p.add_argument("run", help="the run folder (runs/NAME), its name, or its plan file")
    p.add_argument("result", help="the result.tar.gz the job wrote")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("status", help="a run's state and progress (all runs without RUN)")
    p.add_argument("run", nargs="?")
    p.add_argument("--json", action="store_true")
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

    p = sub.add_parser("chat", help="talk to a run's baked model, or to one of its checkpoints")
    p.add_argument("run")
    p.add_argument("prompt", nargs="?", help="one message; without it, a conversation on the terminal")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="a checkpoint's step instead of the baked model")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.set_defaults(func=cmd_chat)

    args = parser.parse_args(argv)
    if getattr(args, "runs_here", None):
        args.runs = args.runs_here
    try:
        return args.func(args)
    except OverbrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# -- bake --------------------------------------------------------------------------------


def cmd_bake(args) -> int:
    from ..bake.driver import compile_bake, dry_run

    out = sys.stderr if args.json else sys.stdout
    bake = compile_bake(args.plan, runs=args.runs, out=out, quiet=args.quiet)
    report = {"folder": str(bake.folder.root), "plan": bake.plan.name}
    if args.check:
        return _bake_check(bake, report, args.json, out)
    if args.dry_run:
        from ..bake.driver import memory_estimate

        rows = dry_run(bake)
        for row in rows:
            mark = "run " if row["run"] else "ok  "
            print(f"{mark} {row['step']:<8} {row['why']}", file=out)
        memory = memory_estimate(bake)
        if memory is not None:
            print(memory if isinstance(memory, str) else memory.describe(), file=out)
        if args.json:
            extra = {"memory": memory.as_dict() if hasattr(memory, "as_dict") else memory}
            print(json.dumps({**report, "steps": rows, "would_run": [r["step"] for r in rows if r["run"]], **extra}))
        return 0
    if args.foreground:
        return _bake_here(bake, report, args.json, out)
    return _bake_detached(bake, report, args, out)


def _bake_check(bake, report: dict, as_json: bool, out) -> int:
    """``bake --check``: like ``make -q``, the exit code says whether anything would run."""
    from ..bake.driver import would_run

    rows = would_run(bake)
    for row in rows:
        print(f"would run {row['step']:<8} {row['why']}", file=out)
    if not rows:
        print(f"everything is up to date: {bake.shown(bake.folder.baked)}", file=out)
    if as_json:
        print(json.dumps({**report, "up_to_date": not rows, "would_run": [r["step"] for r in rows], "steps": rows}))
    return 1 if rows else 0


def _bake_here(bake, report: dict, as_json: bool, out) -> int:
    """The bake in this process. Ctrl-C (or SIGTERM) asks the trainer to save and stop;
    a second Ctrl-C abandons at once."""
    import signal

    from ..bake.driver import run_bake

    asked = []

    def ask_stop(signum, frame):
        if asked and signum == signal.SIGINT:
            raise KeyboardInterrupt
        asked.append(signum)
        bake.folder.stop_request.write_text("signal\n")
        bake.say("stopping at the next step, with a checkpoint (Ctrl-C again to abandon)")

    signal.signal(signal.SIGINT, ask_stop)
    signal.signal(signal.SIGTERM, ask_stop)
    try:
        run_bake(bake)
    except OverbrainerError:
        raise  # AlreadyRunning: nothing of this folder was touched
    report.update(ran=bake.ran, skipped=bake.skipped)
    return _finish(bake.folder.root, report, as_json, out, bake.quiet)


def _bake_detached(bake, report: dict, args, out) -> int:
    from ..bake.driver import dry_run
    from ..runs.follow import follow
    from ..runs.record import ACTIVE, Run, launch

    run = Run(bake.folder.root)
    if run.state in ACTIVE:
        pid = run.status.get("process", {}).get("pid")
        print(f"{bake.shown(bake.folder.root)} is already running (process {pid}); following it", file=out)
        if args.detach:
            return 0
    else:
        rows = dry_run(bake)
        if not any(r["run"] for r in rows):
            report.update(ran=[], skipped=[r["step"] for r in rows], state="done", baked=str(bake.folder.baked))
            print(f"everything is up to date: {bake.shown(bake.folder.baked)}", file=out)
            return _done(report, args.json, out, bake.folder.root)
        before = run.attempts()
        child = launch(bake.plan_path, bake.folder)
        run.wait_started(before, child)
        if args.detach:
            where = bake.shown(bake.folder.root)
            print(f"started {where} (process {child.pid}); `overbrainer status {where}` shows it", file=out)
            if args.json:
                print(json.dumps({**report, "state": run.state, "pid": child.pid}))
            return 0
    try:
        follow(run, poll=0.5, out=out)
    except KeyboardInterrupt:
        where = bake.shown(bake.folder.root)
        print(f"\nstopped following; the run goes on. `overbrainer stop {where}` stops it", file=sys.stderr)
        return 130
    return _finish(bake.folder.root, report, args.json, out, False)


def _finish(folder: Path, report: dict, as_json: bool, out, quiet: bool) -> int:
    """Tell how the last bake of `folder` ended, from its run.json; the exit code."""
    from ..runs.record import Run

    status = Run(folder).status
    result = status.get("result") or {}
    report.update(ran=result.get("ran", report.get("ran", [])), skipped=result.get("skipped", report.get("skipped", [])))
    state = status["state"]
    report["state"] = state
    if state == "done":
        report["baked"] = str(Path(folder) / "baked")
        if not quiet:
            where = _shown(Path(folder) / "baked")
            print(f"baked: {where}" if report["ran"] else f"everything is up to date: {where}", file=out)
        return _done(report, as_json, out, folder, quiet)
    reason = status.get("reason") or state
    report["error" if state == "failed" else "message"] = reason
    if as_json:
        print(json.dumps(report))
    if state == "stopped":
        if not quiet:
            print(reason, file=out)
        return 0
    if not quiet:
        print(f"error: {reason}", file=sys.stderr)
        if result.get("log_tail"):
            print(result["log_tail"], file=sys.stderr)
    return 2 if result.get("kind") == "input" else 1


def _done(report: dict, as_json: bool, out, folder: Path, quiet: bool = False) -> int:
    if not quiet:
        print(f'talk to it: overbrainer chat {_shown(folder)} "Hello!"', file=out)
    if as_json:
        print(json.dumps(report))
    return 0


def _shown(path: Path) -> str:
    import os

    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("../..") else str(path)
    except ValueError:
        return str(path)


# -- the graph ---------------------------------------------------------------------------


def cmd_graph(args) -> int:
    from ..bake import explain
    from ..bake.driver import compile_bake

    bake = compile_bake(args.plan, runs=args.runs, quiet=True)
    states = explain.steps() if args.no_status else explain.survey(bake)
    if args.json:
        print(json.dumps(explain.as_json(bake, states, outs=args.outs), indent=1))
        return 0
    color = args.format == "text" and sys.stdout.isatty()
    sys.stdout.write(explain.render(states, args.format, outs=args.outs, plan=bake.plan_path.name, color=color))
    return 0


def cmd_why(args) -> int:
    from dataclasses import asdict

    from ..bake import explain
    from ..bake.driver import compile_bake

    bake = compile_bake(args.plan, runs=args.runs, quiet=True)
    states = explain.why(bake, args.step)
    if args.json:
        report = {"plan": bake.plan.name, "folder": str(bake.folder.root), "steps": [asdict(s) for s in states]}
        print(json.dumps(report, indent=1))
        return 0
    sys.stdout.write(explain.why_text(states))
    return 0


# -- runs --------------------------------------------------------------------------------


def _run(value: str, runs: str | None):
    """A run from a folder, a run name, or the plan that names it."""
    from ..folder import runs_root
    from ..runs.record import Run

    path = Path(value)
    if path.is_file() and path.suffix == ".json":
        from ..remembered import load

        root = Path(runs).absolute() if runs else runs_root()
        return Run(root / load(path.absolute(), root)[0].name)
    if path.is_dir():
        return Run(path)
    root = Path(runs).absolute() if runs else runs_root()
    if "/" not in value and (root / value).is_dir():
        return Run(root / value)
    raise OverbrainerError(f"{value}: no such run; give a run folder (runs/NAME), a run name or its plan file")


def cmd_status(args) -> int:
    from ..runs.follow import describe
    from ..runs.record import runs

    targets = [_run(args.run, args.runs)] if args.run else runs(args.runs)
    rows = []
    for run in targets:
        status, progress = run.status, run.progress()
        rows.append({**status, "folder": str(run.folder.root), "progress": progress})
    if args.json:
        print(json.dumps(rows[0] if args.run else rows, indent=1))
        return 0
    if not rows:
        print("no runs yet; `overbrainer bake plans/demo.json` makes one")
    for row in rows:
        line = f"{_shown(Path(row['folder']))}: {describe(row['progress'])}"
        if row.get("reason"):
            line += f"  ({row['reason']})"
        print(line)
    return 0


def cmd_runs(args) -> int:
    args.run = None
    return cmd_status(args)


def cmd_import(args) -> int:
    from ..where.bundle import import_result

    run = _run(args.run, args.runs)
    done = import_result(run.folder.root, Path(args.result), shown=_shown)
    got = done.received
    plan = _shown(Path(done.plan_file)) if done.plan_file else "PLAN"
    print(f"imported {got.files} files ({got.bytes / 1e6:.1f} MB) into {_shown(run.folder.root)}, "
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
    run = _run(args.run, args.runs)
    before = run.state
    if before not in ("starting", "running", "stopping"):
        print(f"{_shown(run.folder.root)} is not running ({before})")
        return 0
    state = run.stop(wait=not args.no_wait, timeout=args.timeout)
    steps = run.checkpoints()
    last = f"; last checkpoint: step {steps[-1]}" if steps else ""
    print(f"{_shown(run.folder.root)}: {state}{last}")
    return 0 if state in ("stopped", "stopping", "done") else 1


def cmd_resume(args) -> int:
    from ..runs.follow import follow

    run = _run(args.run, args.runs)
    if run.state == "done":
        print(f"{_shown(run.folder.root)} is done; nothing to resume")
        return 0
    run.resume()
    if args.detach:
        print(f"resumed {_shown(run.folder.root)}")
        return 0
    follow(run)
    return _finish(run.folder.root, {"folder": str(run.folder.root)}, False, sys.stdout, False)


def cmd_wait(args) -> int:
    from ..runs.follow import follow

    run = _run(args.run, args.runs)
    follow(run)
    return _finish(run.folder.root, {"folder": str(run.folder.root)}, False, sys.stdout, False)


def cmd_metrics(args) -> int:
    run = _run(args.run, args.runs)
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


def cmd_log(args) -> int:
    import time

    from ..runs.record import ACTIVE

    run = _run(args.run, args.runs)
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

    run = _run(args.run, args.runs)
    rows = []
    for step, folder in ckpt.complete(run.folder.checkpoints):
        meta = ckpt.read_meta(folder)
        rows.append({"step": step, "path": str(folder), "phase": meta.get("phase"), "decayed": meta.get("decayed"),
                     "loss": meta.get("loss"), "eval_loss": meta.get("eval_loss")})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{_shown(run.folder.root)}: no checkpoint yet")
    for r in rows:
        note = "" if r["decayed"] else "  (not decayed)"
        ev = f"  eval {r['eval_loss']:.4f}" if r["eval_loss"] is not None else ""
        loss = f"  loss {r['loss']:.4f}" if r["loss"] is not None else ""
        print(f"step {r['step']:>6}  {r['phase']:<7}{loss}{ev}  {_shown(Path(r['path']))}{note}")
    return 0


def cmd_chat(args) -> int:
    from ..chat import Model

    run = _run(args.run, args.runs)
    folder = run.folder.root
    model = Model.checkpoint(folder, args.checkpoint) if args.checkpoint is not None else Model.baked(folder)
    if not model.decayed:
        print(f"(step {model.step} is from before the decay: not annealed, not the final model)", file=sys.stderr)
    options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.prompt:
        print(model.chat(args.prompt, **options))
        return 0
    messages: list[dict] = []
    print("type a message; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            return 0
        if not text:
            return 0
        messages.append({"role": "user", "content": text})
        answer = model.chat(messages, **options)
        messages.append({"role": "assistant", "content": answer})
        print(answer)


if __name__ == "__main__":
    sys.exit(main())
