"""What every step is given: `Bake`, a plan compiled for its run folder.

A step reads the plan's settings, where things are, and the hash cache, and speaks through
two callbacks the bake driver hands it: `say` (a line for the user) and `tell` (progress for
run.json: state, step, steps, task). It never reaches for the driver, and the driver's
results (what ran, what failed) are not kept here.

A compiled bake can be handed to another process (`handoff`, `from_handoff`): the run's own
process takes what the process that started it resolved, instead of compiling the plan file
again as it may be by then.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..folder import RunFolder
from ..hashing import HashCache
from ..inputs.base_model import BaseSpec
from ..inputs.sources import Source
from ..remembered import Remembered, validated

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["Bake"]


def _silent(message: str) -> None:
    pass


def _untold(**fields) -> None:
    pass


@dataclass
class Bake:
    """A plan compiled for its run folder: everything the steps read."""

    plan: Plan | Remembered  # Remembered on paths that only check; `validate` makes it the models
    plan_path: Path
    folder: RunFolder
    base: BaseSpec
    sources: list[Source]  # the plan's data, resolved (inputs/sources.py)
    hashes: HashCache
    plan_bytes: bytes | None = None  # what the plan file held when it was read
    take_over: bool = False  # ``--force``: bake into a run folder another plan file owns
    say: Callable[[str], None] = field(default=_silent, repr=False)
    tell: Callable[..., None] = field(default=_untold, repr=False)
    # each step's `steps.check` status, computed once per bake: doit's up-to-date check
    # stores it, the step's execution takes it
    checked: dict = field(default_factory=dict, repr=False)

    @property
    def data_paths(self) -> list[Path]:
        """Every file of every source."""
        return [f.path for s in self.sources for f in s.files]

    @property
    def plan_dir(self) -> Path:
        return self.plan_path.parent

    def shown(self, path: Path) -> str:
        """A path as the user wrote it: relative to where the command runs, when inside it."""
        try:
            return os.path.relpath(path)
        except ValueError:
            return str(path)

    def validate(self) -> None:
        """The plan as its models, for a step about to run work (see ``remembered``)."""
        if isinstance(self.plan, Remembered):
            # from the bytes the checks were made on, not the file as it may be now
            self.plan = validated(self.plan_path, self.plan_bytes)

    def handoff(self) -> dict:
        """This compiled bake as JSON, for the process that will run it."""
        import base64

        return {
            "plan_path": str(self.plan_path),
            "plan": self.plan.model_dump(mode="json"),
            "plan_bytes": base64.b64encode(self.plan_bytes).decode() if self.plan_bytes is not None else None,
            "folder": str(self.folder.root),
            "base": self.base.as_dict(),
            "sources": [s.as_json() for s in self.sources],
            "take_over": self.take_over,
        }

    @classmethod
    def from_handoff(cls, data: dict, **callbacks) -> Bake:
        """The bake another process compiled (`handoff`), as it resolved it."""
        import base64

        folder = RunFolder(Path(data["folder"]))
        raw = data.get("plan_bytes")
        return cls(
            plan=Remembered(data["plan"]),
            plan_path=Path(data["plan_path"]),
            folder=folder,
            base=BaseSpec(**data["base"]),
            sources=[Source.from_json(s) for s in data["sources"]],
            hashes=HashCache(folder.hash_cache),
            plan_bytes=base64.b64decode(raw) if raw is not None else None,
            take_over=bool(data.get("take_over")),
            **callbacks,
        )
