"""The ``here`` target: the job on this machine, a child that dies with the bake."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..portable.common import run_commands
from ..trainers.protocol import Trainer

__all__ = ["Here"]


class Here:
    """Run the job on this machine, as a child that dies with the process baking it."""

    name = "here"
    where = "here"

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        """Run every command of the job; the first non-zero exit code, or 0."""
        root = str(run_dir)
        trainer.prepare(run_dir, root)
        return run_commands(
            trainer.commands(), run_dir, {**os.environ, **trainer.env(root), **env}, log,
            metrics_file=trainer.metrics_file(), stages=trainer.stages(), stop_marker=trainer.stop_marker(),
            metrics_required=trainer.metrics_required(), poll=poll,
        )
