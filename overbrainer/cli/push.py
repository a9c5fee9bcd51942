"""``push``: upload a run's baked/ to the Hugging Face Hub."""

from __future__ import annotations

import sys

from .common import find_run


def add_parsers(sub) -> None:
    p = sub.add_parser("push", help="upload a run's baked/ (GGUFs, Modelfile, card) to the Hugging Face Hub")
    p.add_argument("run")
    p.add_argument("repo", metavar="org/name", help="the Hub model repository (created when it does not exist)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="a branch to push to (created when it does not exist); default main")
    p.set_defaults(func=cmd_push)


def cmd_push(args) -> int:
    from ..formats.push import push

    run = find_run(args.run, args.runs)
    push(run.folder.baked, args.repo, private=args.private, revision=args.revision,
         say=lambda line: print(line, file=sys.stderr))
    return 0
