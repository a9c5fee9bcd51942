"""The command line: parses, calls down, prints. No logic of its own.

Exit codes: 0 done (or stopped on request), 1 the run failed, 2 overbrainer could not run
it (bad plan, bad data, missing base, a run folder in the wrong state, a bad command line:
the one line says what, where and the fix), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM), 141 the reader of its output went away (``overbrainer graph PLAN | head``).

A RUN argument is a run folder (``runs/demo``), a run's name (``demo``, under the runs
folder) or the plan file that names it (``plans/demo.json``). Options and arguments go in
any order, and the options every command shares (``--runs``, ``--no-color``) go before
or after the command's name.

With ``--json`` a command prints one JSON object on stdout, errors included::

    {"error": {"kind": "plan", "message": "plans/x.json:4: ...", "where": "plans/x.json"}}

with the same exit code as without ``--json`` (the kinds: ``errors.py``).
"""


from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import FileProblem, OverbrainerError, RunFailed, UsageError
from . import bake, chat, graph, push, runs, serve

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, with options and positionals in any order (``chat RUN --checkpoint 18
    "Hello"``), and its errors raised as `UsageError` so that ``--json`` can report them."""

    _mixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._mixing or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}; see `{self.prog} --help`")


def _shared(suppress: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. After it, an option
    not given leaves the value given before it (or the default) alone."""
    default = {"default": argparse.SUPPRESS} if suppress else {}
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--runs", metavar="FOLDER",
                        help="where run folders live (default: $OVERBRAINER_RUNS or ./runs)", **default)
    shared.add_argument("--no-color", action="store_true",
                        help="no colour, even on a terminal (also: NO_COLOR=1; FORCE_COLOR=1 forces it)", **default)
    return shared


def parser() -> argparse.ArgumentParser:
    from .. import __version__

    top = _Parser(prog="overbrainer", description="Fine-tuning a language model, declared as a build.",
                  parents=[_shared(False)])
    top.add_argument("--version", action="version", version=f"overbrainer {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    after = _shared(True)
    real = sub.add_parser

    def add_parser(name, **kwargs):
        return real(name, parents=[after], **kwargs)

    sub.add_parser = add_parser
    for group in (bake, graph, runs, chat, serve, push):
        group.add_parsers(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    try:
        args = parser().parse_args(argv)
        as_json = getattr(args, "json", False)
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe is found here, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (OverbrainerError, RunFailed) as e:
        return _error(e, as_json)
    except OSError as e:
        return _error(FileProblem.from_os_error(e), as_json)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _error(e: OverbrainerError | RunFailed, as_json: bool) -> int:
    """The one line of an error, and its exit code; with --json, the JSON object too."""
    try:
        if as_json:
            print(json.dumps({"error": {"kind": e.kind, "message": str(e), "where": e.where}}))
            sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
    except BrokenPipeError:
        _reader_gone()
    return e.exit_code


def _reader_gone() -> int:
    """What was left to print goes nowhere, quietly (as ``git log | head``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141
