"""What every command shares: finding a run from what the user typed, and showing a path."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OverbrainerError

__all__ = ["find_run", "shown", "use_color"]


def use_color(stream, no_color: bool = False) -> bool:
    """Whether to colour what goes to `stream`: never with ``--no-color`` or ``NO_COLOR``
    (https://no-color.org: set and not empty), always with ``FORCE_COLOR`` (set and not
    empty, nor ``0``), else on a terminal only."""
    if no_color or os.environ.get("NO_COLOR"):
        return False
    force = os.environ.get("FORCE_COLOR")
    if force and force != "0":
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def shown(path: Path) -> str:
    """A path as the user would type it: relative to here, unless that climbs far."""
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("../..") else str(path)
    except ValueError:
        return str(path)


def find_run(value: str, runs: str | None):
    """A run from a folder, a run name, or the plan that names it."""
    from ..folder import runs_root
    from ..runtime.run import Run

    path = Path(value)
    if path.is_file() and path.suffix == ".json":
        from ..remembered import load

        root = runs_root(runs)
        return Run(root / load(path.absolute(), root)[0].name)
    if path.is_dir():
        from ..journal import no_run

        run = Run(path)
        error = no_run(run.folder)
        if error is not None:
            raise error
        return run
    root = runs_root(runs)
    if "/" not in value and (root / value).is_dir():
        return Run(root / value)
    raise OverbrainerError(f"{value}: no such run; give a run folder (runs/NAME), a run name or its plan file")


