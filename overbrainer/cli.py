"""The command line: parses, calls down, prints. No logic of its own.

Exit codes: 0 done (or stopped on request), 1 the run failed, 2 overbrainer could not run
it (bad plan, bad data, missing base: the one line says what, where and the fix).
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import OverbrainerError, RunFailed, RunStopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overbrainer", description="Fine-tuning as a build.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bake", help="bake a plan: run every step that is not up to date")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--dry-run", action="store_true", help="list the steps that would run, and why")
    p.add_argument("--json", action="store_true", help="end with one JSON object (folder, steps run and skipped)")
    p.add_argument("--runs", help="where run folders live (default: $OVERBRAINER_RUNS or ./runs)")
    p.set_defaults(func=cmd_bake)

    p = sub.add_parser("chat", help="talk to a run's baked model, or to one of its checkpoints")
    p.add_argument("run", help="the run folder (runs/NAME) or a plan file")
    p.add_argument("prompt", nargs="?", help="one message; without it, a conversation on the terminal")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="a checkpoint's step instead of the baked model")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.set_defaults(func=cmd_chat)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except OverbrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_bake(args) -> int:
    from .build import compile_bake, dry_run, run_bake

    out = sys.stderr if args.json else sys.stdout
    bake = compile_bake(args.plan, runs=args.runs, out=out)
    report = {"folder": str(bake.folder.root), "plan": bake.plan.name}
    if args.dry_run:
        rows = dry_run(bake)
        for row in rows:
            mark = "run " if row["run"] else "ok  "
            print(f"{mark} {row['step']:<8} {row['why']}", file=out)
        if args.json:
            print(json.dumps({**report, "steps": rows, "would_run": [r["step"] for r in rows if r["run"]]}))
        return 0

    run_bake(bake)
    report.update(ran=bake.ran, skipped=bake.skipped)
    code = _outcome(bake, report, out)
    if args.json:
        print(json.dumps(report))
    return code


def _run_folder(value: str):
    """A run folder given as a folder, or as the plan that names it."""
    from pathlib import Path

    path = Path(value)
    if path.is_file() and path.suffix == ".json":
        from .build import compile_bake

        return compile_bake(path).folder.root
    if not path.is_dir():
        raise OverbrainerError(f"{value}: no such run folder; give runs/NAME or the plan file")
    return path


def cmd_chat(args) -> int:
    from .models import Model

    folder = _run_folder(args.run)
    model = Model.checkpoint(folder, args.checkpoint) if args.checkpoint is not None else Model.baked(folder)
    if not model.decayed:
        print(f"(step {model.step} is from before the decay: not the final model)", file=sys.stderr)
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


def _outcome(bake, report: dict, out) -> int:
    error = bake.error
    if error is None:
        baked = bake.shown(bake.folder.baked)
        report.update(state="done", baked=str(bake.folder.baked))
        if not bake.ran:
            print(f"everything is up to date: {baked}", file=out)
        else:
            print(f"baked: {baked}", file=out)
        print(f'talk to it: overbrainer chat {bake.shown(bake.folder.root)} "Hello!"', file=out)
        return 0
    if isinstance(error, RunStopped):
        report.update(state="stopped", message=str(error))
        print(str(error), file=out)
        return 0
    if isinstance(error, RunFailed):
        report.update(state="failed", error=str(error))
        print(f"error: {error}", file=sys.stderr)
        if error.log_tail:
            print(error.log_tail, file=sys.stderr)
        return 1
    if isinstance(error, OverbrainerError):
        report.update(state="failed", error=str(error))
        print(f"error: {error}", file=sys.stderr)
        return 2
    raise error  # a bug of overbrainer's: the traceback is for us


if __name__ == "__main__":
    sys.exit(main())
