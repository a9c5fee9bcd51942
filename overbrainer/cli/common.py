"""What every command shares: finding a run from what the user typed, and showing a path."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OverbrainerError

__all__ = ["find_run", "shown"]


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

        root = Path(runs).absolute() if runs else runs_root()
        return Run(root / load(path.absolute(), root)[0].name)
    if path.is_dir():
        return Run(path)
    root = Path(runs).absolute() if runs else runs_root()
    if "/" not in value and (root / value).is_dir():
        return Run(root / value)
    raise OverbrainerError(f"{value}: no such run; give a run folder (runs/NAME), a run name or its plan file")


