"""The commands that bake a plan: ``bake`` (with --dry-run, --check, --detach, --foreground),
``split`` (the split step alone) and ``decay`` (a finished model branched off a stable
checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import OverbrainerError
from ..folder import RunFolder
from .common import find_run, shown


def add_parsers(sub) -> None:
    p = sub.add_parser("bake", help="bake a plan: run every step that is not up to date")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--dry-run", action="store_true", help="list the steps that would run, and why")
    p.add_argument("--check", action="store_true",
                   help="run nothing: exit 0 when everything is up to date, 1 when a step would run (listed, with why)")
    p.add_argument("--json", action="store_true", help="end with one JSON object (folder, steps run and skipped, state)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="start the run in its own process and return at once")
    mode.add_argument("--foreground", action="store_true", help="run in this process (what CI and doit want)")
    p.add_argument("--force", action="store_true",
                   help="bake into a run folder that another plan file with the same name owns, and own it from now on")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    # the bake as the process that launched this one compiled it (JSON on stdin)
    p.add_argument("--compiled", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bake)

    p = sub.add_parser("split", help="the split step alone: examples.parquet, to look at before training")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--json", action="store_true", help="one JSON object: folder, rows, train, validation")
    p.add_argument("--force", action="store_true", help="split into a run folder another plan file owns")
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("decay", help="a finished model from a stable-phase checkpoint: a decay of its own, "
                                     "merged and baked under branches/at-STEP/")
    p.add_argument("run", help="the run (its folder, its name, or its plan)")
    p.add_argument("--at", type=int, required=True, help="the stable checkpoint's step (`overbrainer checkpoints RUN`)")
    p.add_argument("--steps", type=int, help="decay steps (default: the run's own decay)")
    p.add_argument("--json", action="store_true", help="one JSON object: branch, folder, steps run and skipped")
    p.set_defaults(func=cmd_decay)


def cmd_bake(args) -> int:
    from ..graph.driver import compile_bake, dry_run

    out = sys.stderr if args.json else sys.stdout
    say = None if args.quiet else (lambda message: print(message, file=out, flush=True))
    if args.compiled == "-" and args.foreground:
        from ..steps.context import Bake

        bake = Bake.from_handoff(json.load(sys.stdin), **({"say": say} if say else {}))
    else:
        bake = compile_bake(args.plan, runs=args.runs, say=say)
        bake.take_over = args.force
    report = {"folder": str(bake.folder.root), "plan": bake.plan.name}
    if args.check:
        return _bake_check(bake, report, args.json, out)
    if args.dry_run:
        from ..graph.driver import memory_estimate

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
        return _bake_here(bake, report, args.json, out, args.quiet)
    return _bake_detached(bake, report, args, out)


def cmd_split(args) -> int:
    """Validate and split the plan's conversations into examples.parquet (up to date: nothing
    to do), in this process; run.json is left to the whole bake."""
    from ..graph.driver import compile_bake, run_bake
    from ..stamps import read_stamp

    out = sys.stderr if args.json else sys.stdout
    bake = compile_bake(args.plan, runs=args.runs, say=lambda message: print(message, file=out, flush=True))
    bake.take_over = args.force
    done = run_bake(bake, task=["train:resolve", "train:split"])  # plan.json too: `status` shows it planned
    if done.error is not None:
        raise done.error
    summary = read_stamp(bake.folder.stamp("split")).summary
    if "split" in done.skipped:
        print("split: up to date", file=out)
    where = shown(bake.folder.root)
    print(f"examples: {shown(bake.folder.examples)} ({summary['train']} train, {summary['validation']} validation); "
          f"`overbrainer examples {where}` shows a few", file=out)
    if args.json:
        print(json.dumps({"folder": str(bake.folder.root), "examples": str(bake.folder.examples),
                          "ran": done.ran, **{k: summary[k] for k in ("rows", "train", "validation", "duplicates")}}))
    return 0


def cmd_decay(args) -> int:
    """Branch a decay off the run's checkpoint at ``--at``, merge and bake it, in this
    process: ``branches/at-STEP/``. Done already: nothing to do; interrupted: it goes on."""
    from ..errors import RunStateError
    from ..graph.driver import compile_bake, run_bake
    from ..graph.tasks import GROUP
    from ..steps.branch import make_at_branch

    out = sys.stderr if args.json else sys.stdout
    run = find_run(args.run, args.runs)
    plan = run.status.get("plan_file")
    if not plan or not Path(plan).is_file():
        raise RunStateError(f"{shown(run.folder.root)}: its plan file {plan or '(none recorded)'} is not there; "
                            "bake the plan again first, or give its plan (`overbrainer decay PLAN --at STEP`)")
    bake = compile_bake(plan, runs=run.folder.root.parent, say=lambda message: print(message, file=out, flush=True))
    label = make_at_branch(bake, args.at, args.steps)
    done = run_bake(bake, task=[f"{GROUP}:bake@{label}"])  # doit runs what it reads first
    if done.error is not None:
        raise done.error
    folder = bake.folder.branch(label)
    print(f"baked: {shown(folder.baked)}" if done.ran else f"everything is up to date: {shown(folder.baked)}", file=out)
    if args.json:
        print(json.dumps({"branch": label, "folder": str(folder.root), "baked": str(folder.baked),
                          "ran": done.ran, "skipped": done.skipped}))
    return 0


def _bake_check(bake, report: dict, as_json: bool, out) -> int:
    """``bake --check``: like ``make -q``, the exit code says whether anything would run."""
    from ..graph.driver import would_run

    rows = would_run(bake)
    for row in rows:
        print(f"would run {row['step']:<8} {row['why']}", file=out)
    if not rows:
        print(f"everything is up to date: {', '.join(bake.shown(b) for b in _baked_of(bake.folder.root))}", file=out)
    if as_json:
        print(json.dumps({**report, "up_to_date": not rows, "would_run": [r["step"] for r in rows], "steps": rows}))
    return 1 if rows else 0


def _bake_here(bake, report: dict, as_json: bool, out, quiet: bool) -> int:
    """The bake in this process. Ctrl-C (or SIGTERM) asks the trainer to save and stop;
    a second Ctrl-C abandons at once."""
    import signal

    from ..graph.driver import Outcome, run_bake

    asked = []
    done = Outcome()

    def ask_stop(signum, frame):
        if asked and signum == signal.SIGINT:
            raise KeyboardInterrupt
        asked.append(signum)
        done.signalled = done.signalled or signum  # the exit code says so: 130 or 143
        bake.folder.stop_request.write_text("signal\n")
        bake.say("stopping at the next step, with a checkpoint (Ctrl-C again to abandon)")

    signal.signal(signal.SIGINT, ask_stop)
    signal.signal(signal.SIGTERM, ask_stop)
    try:
        run_bake(bake, done=done)
    except OverbrainerError:
        raise  # AlreadyRunning: nothing of this folder was touched
    report.update(ran=done.ran, skipped=done.skipped)
    wanted = bake.plan.bake.push
    if wanted and done.error is None and not done.signalled and bake.folder.baked.is_dir() and "bake" in done.ran:
        # bake.push: what `overbrainer push` does, once baked/ is new
        from ..formats.push import push

        push(bake.folder.baked, wanted.repo, private=wanted.private, revision=wanted.revision, say=bake.say)
    return finish(bake.folder.root, report, as_json, out, quiet)


def _bake_detached(bake, report: dict, args, out) -> int:
    from ..runtime.follow import follow
    from ..runtime.run import start_unless_done

    started = start_unless_done(bake)
    run = started.run
    if started.how == "running":
        pid = run.status.get("process", {}).get("pid")
        print(f"{shown(bake.folder.root)} is already running (process {pid}); following it", file=out)
        if args.detach:
            return 0
    elif started.how == "done":
        report.update(ran=[], skipped=[r["step"] for r in started.rows], state="done", baked=str(bake.folder.baked))
        print(f"everything is up to date: {', '.join(shown(b) for b in _baked_of(bake.folder.root))}", file=out)
        return _done(report, args.json, out, bake.folder.root)
    elif args.detach:
        where = shown(bake.folder.root)
        print(f"started {where} (process {started.pid}); `overbrainer status {where}` shows it", file=out)
        if args.json:
            print(json.dumps({**report, "state": run.state, "pid": started.pid}))
        return 0
    try:
        follow(run, poll=0.5, out=out)
    except KeyboardInterrupt:
        where = shown(bake.folder.root)
        print(f"\nstopped following; the run goes on. `overbrainer stop {where}` stops it", file=sys.stderr)
        return 130
    return finish(bake.folder.root, report, args.json, out, False)


def _baked_of(folder: Path) -> list[Path]:
    """Where a finished bake's models are: baked/, or each budget's branch (train.budgets)."""
    from ..folder import BRANCHES

    trunk = RunFolder(folder).baked
    if trunk.is_dir() or not (folder / BRANCHES).is_dir():
        return [trunk]
    budgets = sorted((p for p in (folder / BRANCHES).iterdir() if p.name.isdecimal()), key=lambda p: int(p.name))
    return [p / "baked" for p in budgets] or [trunk]


def finish(folder: Path, report: dict, as_json: bool, out, quiet: bool) -> int:
    """Tell how the last bake of `folder` ended, from its run.json; the exit code."""
    from ..runtime.run import Run

    status = Run(folder).status
    result = status.get("result") or {}
    report.update(ran=result.get("ran", report.get("ran", [])), skipped=result.get("skipped", report.get("skipped", [])))
    state = status["state"]
    report["state"] = state
    if state == "done":
        baked = _baked_of(Path(folder))
        report["baked"] = str(baked[-1])  # the largest budget's, with train.budgets: all of them in "branches"
        if len(baked) > 1 or baked[0].parent != Path(folder):
            report["branches"] = [str(b) for b in baked]
        if not quiet:
            where = ", ".join(shown(b) for b in baked)
            print(f"baked: {where}" if report["ran"] else f"everything is up to date: {where}", file=out)
        return _done(report, as_json, out, folder, quiet)
    reason = status.get("reason") or state
    if state == "failed":
        kind = result.get("kind") or "run"
        where = None if kind == "input" else str(RunFolder(Path(folder)).log)
        report["error"] = {"kind": kind, "message": reason, "where": where}
    else:
        report["message"] = reason
    if as_json:
        print(json.dumps(report))
    if state == "stopped":
        if not quiet:
            print(reason, file=out)
    elif not quiet:
        print(f"error: {reason}", file=sys.stderr)
        if result.get("log_tail"):
            print(result["log_tail"], file=sys.stderr)
    return _exit_code(status)


def _exit_code(status: dict) -> int:
    """The exit code the run's last attempt recorded (130/143 when a signal stopped it),
    else what its state means."""
    from ..graph.driver import exit_code

    attempts = status.get("attempts") or []
    if attempts and isinstance(attempts[-1].get("exit"), int) and attempts[-1].get("end"):
        return attempts[-1]["exit"]
    result = status.get("result") or {}
    return exit_code(status["state"], result.get("kind"), None, None)


def _done(report: dict, as_json: bool, out, folder: Path, quiet: bool = False) -> int:
    if not quiet:
        print(f'talk to it: overbrainer chat {shown(folder)} "Hello!"', file=out)
    if as_json:
        print(json.dumps(report))
    return 0
