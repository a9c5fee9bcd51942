"""The Trainer interface: what a training framework tells overbrainer about a run.

A small protocol, not a base class (torchtune's ``recipe_interfaces.py``: an interface is
not a vehicle for code reuse). The built-in trainer and Axolotl implement it and share no
code. Where a job runs (``targets.py``) only ever talks to a trainer through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["Artifacts", "Trainer", "NoTrainingData", "STAGE_TRAIN", "STAGE_MERGE"]

STAGE_TRAIN = "train"
STAGE_MERGE = "merge"


class NoTrainingData(Exception):
    """The training file is missing or has no example."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(f"{path} has no example: run `overbrainer split PLAN` first (or `overbrainer bake PLAN`)")


@dataclass(frozen=True)
class Artifacts:
    """What to bring back from where the job ran, relative to the run folder."""

    entries: list[str]  # files and folders to copy; missing ones are skipped
    exclude: list[str] = field(default_factory=list)  # name patterns left out, at any depth
    # the entry that must hold at least one file once the job succeeded (the trained
    # model): a successful job with nothing there is recorded failed, yet what it had is
    # still brought back and verified
    required: str | None = None


@runtime_checkable
class Trainer(Protocol):
    name: str

    def prepare(self, run_dir: Path, root: str) -> None:
        """Write the job's files into the local run folder `run_dir`; `root` is the run
        folder's path as the job will see it, which the files may name. Raises
        NoTrainingData when there is nothing to train on."""

    def commands(self) -> list[list[str]]:
        """Commands run one after the other in the run folder, each a program and its
        arguments; the program ("python", "axolotl") is resolved by the job's environment."""

    def env(self, root: str) -> dict[str, str]:
        """The job's environment, without secrets, for a run folder seen at `root`."""

    def metrics_file(self) -> str:
        """The file the job appends metric lines to, relative to the run folder."""

    def artifacts(self) -> Artifacts:
        """What to bring back after the job."""

    def stop_marker(self) -> str | None:
        """The file the job writes when it stopped early with a snapshot: the commands after
        the first are then skipped (no merge of an unfinished model). None: never."""

    def stages(self) -> list[str]:
        """The stage of each command, in order: a stage event goes into the metrics file
        before each command starts. Empty: no stage events."""

    def metrics_required(self) -> bool:
        """Whether a job that exits 0 must also have written a metric line to have
        succeeded: proof that a training job loaded its metrics plugin."""

    def caches_tools(self) -> bool:
        """Whether the job downloads tools it caches on the target."""
