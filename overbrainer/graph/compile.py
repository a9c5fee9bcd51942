"""A plan compiled for its run folder: what `steps.context.Bake` holds.

`compile_bake` checks everything that can be checked without work (the plan, that its data
files and base exist) so that a bad input fails before a run folder is even made. It reads
the plan through ``remembered`` (no pydantic while the plan file is unchanged).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..folder import RunFolder, runs_root
from ..hashing import HashCache
from ..inputs.base_model import parse_base
from ..inputs.sources import resolve_sources
from ..remembered import load as load_plan
from ..steps.context import Bake

__all__ = ["compile_bake"]


def compile_bake(plan_path: str | os.PathLike, runs: str | os.PathLike | None = None,
                 say: Callable[[str], None] | None = None) -> Bake:
    """The plan at `plan_path`, compiled for its folder under `runs` (default: the runs
    folder); `say` gets the bake's lines for the user (default: none)."""
    plan_path = Path(plan_path).absolute()
    root = runs_root(runs)
    plan, raw = load_plan(plan_path, root)
    shown_plan = os.path.relpath(plan_path) if not str(plan_path).startswith("..") else str(plan_path)
    # files, folders and globs must exist, a hub dataset be in the cache (or reachable)
    sources = resolve_sources(plan.model_dump(mode="json")["data"], plan_path.parent, shown_plan)
    base = parse_base(plan.base, plan_path.parent)
    folder = RunFolder(root / plan.name)
    options = {"say": say} if say is not None else {}
    return Bake(plan=plan, plan_path=plan_path, folder=folder, base=base, sources=sources,
                hashes=HashCache(folder.hash_cache), plan_bytes=raw, **options)
