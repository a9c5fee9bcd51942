"""The command line: parses, calls down, prints. No logic of its own.

Exit codes: 0 done (or stopped on request), 1 the run failed, 2 overbrainer could not run
it (bad plan, bad data, missing base, a run folder in the wrong state: the one line says
what, where and the fix), 130 interrupted.

A RUN argument is a run folder (``runs/demo``), a run's name (``demo``, under the runs
folder) or the plan file that names it (``plans/demo.json``).
"""


from __future__ import annotations

import argparse
import sys

from ..errors import OverbrainerError
from . import bake, chat, graph, runs

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overbrainer", description="Fine-tuning a language model, declared as a build.")
    parser.add_argument("--runs", help="where run folders live (default: $OVERBRAINER_RUNS or ./runs)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (bake, graph, runs, chat):
        group.add_parsers(sub)
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
