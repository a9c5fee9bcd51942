"""The run folder, ``runs/<name>/``: every file a run has, named in one place.

=====================  ==============================================================
``plan.json``          every resolved setting, inputs pinned by content hash
``examples.parquet``   the conversations, with their split (``id, split, messages, source``)
``config.yaml``        the trainer's configuration, in Axolotl's format
``run.json``           the run's state and its process
``metrics.jsonl``      one line per logged step
``log.txt``            the trainer's own output
``checkpoints/``       ``step-NNNNNN/`` folders (see ``trainers/checkpoint.py``)
``merged/``            the adapter merged into the base model (HF safetensors)
``baked/``             the model people use, with its model card
``attic/``             outputs of an older fingerprint, moved aside instead of deleted
``.stamps/``           one stamp per finished step (``stamps.py``)
``.doit.db``           doit's own state (sqlite3); losing it costs a few stats
``.hashes.json``       the content-hash cache
``.plan.json``         the plan as last validated, for checks without pydantic (``remembered.py``)
``.lock``              held by the process that bakes this folder
=====================  ==============================================================
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunFolder", "runs_root", "cache_root", "default_name", "RUNS_ENV"]

RUNS_ENV = "OVERBRAINER_RUNS"


def runs_root(given: str | os.PathLike | None = None) -> Path:
    """Where run folders live: `given` (``--runs``), else ``$OVERBRAINER_RUNS``, else
    ``runs/`` where the command runs. A file there is refused in one line."""
    root = Path(given or os.environ.get(RUNS_ENV) or "runs").absolute()
    if root.exists() and not root.is_dir():
        from .errors import FileProblem

        said = "--runs" if given else (f"${RUNS_ENV}" if os.environ.get(RUNS_ENV) else "the runs folder")
        raise FileProblem(root, f"is a file, not a folder ({said}: where run folders go)",
                          "give a folder's path (it is made if missing)")
    return root


def cache_root() -> Path:
    """The shared cache: ``$OVERBRAINER_CACHE``, else ``~/.cache/overbrainer``."""
    env = os.environ.get("OVERBRAINER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "overbrainer"


def default_name(path: Path) -> str:
    """A plan without a name is named after its file."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).strip("-._") or "plan"
    return name[:100]


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    plan_json = property(lambda self: self.root / "plan.json")
    examples = property(lambda self: self.root / "examples.parquet")
    config = property(lambda self: self.root / "config.yaml")
    run_json = property(lambda self: self.root / "run.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    log = property(lambda self: self.root / "log.txt")
    checkpoints = property(lambda self: self.root / "checkpoints")
    merged = property(lambda self: self.root / "merged")
    baked = property(lambda self: self.root / "baked")
    attic = property(lambda self: self.root / "attic")
    stamps = property(lambda self: self.root / ".stamps")
    doit_db = property(lambda self: self.root / ".doit.db")
    hash_cache = property(lambda self: self.root / ".hashes.json")
    lock = property(lambda self: self.root / ".lock")
    stop_request = property(lambda self: self.root / "stop")
    stopped_marker = property(lambda self: self.root / "stopped.json")

    def stamp(self, step: str) -> Path:
        return self.stamps / f"{step}.json"
