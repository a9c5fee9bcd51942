"""`overbrainer serve`: the runs as a local web page (``overbrainer/serve/``)."""

from __future__ import annotations

from pathlib import Path

from ..folder import runs_root


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="a local web page: the runs, their live curves, stop and resume")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..serve import serve  # Starlette and uvicorn: only for this command

    serve(Path(args.runs).absolute() if getattr(args, "runs", None) else runs_root(), host=args.host, port=args.port)
    return 0
