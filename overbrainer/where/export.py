"""The ``export`` target: the job as a bundle to run anywhere; ``overbrainer import`` brings
its result back, and the next bake takes it up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunStopped
from ..trainers.protocol import Trainer
from . import bundle, receive

if TYPE_CHECKING:
    from ..hashing import HashCache
    from .bundle import Base

__all__ = ["Export", "Exported"]


class Exported(RunStopped):
    """The bake exported its job and ends here, on purpose: exit code 0, train not stamped.
    Its message says where the bundle is, how to run it, and how to bring the result back.
    (run.json records it as ``stopped``, its reason saying ``exported: ...``.)"""


class Export:
    """Write the job as a bundle that runs anywhere; once its result is imported
    (``overbrainer import``), the next bake takes it up instead of exporting again."""

    name = "export"
    where = "export"

    def __init__(self, base: Base, hashes: HashCache, shown: Callable[[Path], str] = str):
        self.base, self.hashes, self.shown = base, hashes, shown

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        fp = env[bundle.FINGERPRINT_ENV]
        record = receive.take_import(run_dir, fp)
        note = ""
        if record is not None:
            if record["state"] != "stopped":
                return receive.taken_up(record, log, f"imported from {record['result']}")
            # stopped there on request: the next bundle goes on from its checkpoint
            note = f"the job stopped at step {record['step']}; "
        made = bundle.export_bundle(trainer, Path(run_dir), fp, self.base, self.hashes)
        job = made.name[: -len(".tar.gz")]
        raise Exported(
            f"{note}exported: {self.shown(made)}; run it anywhere (`tar -xzf {made.name} && python3 {job}/run.py`, "
            f"see {job}/README.txt), then `overbrainer import {self.shown(Path(run_dir))} {job}/result.tar.gz` "
            "and bake again"
        )
