"""Where a job runs: ``Here`` (a local process), ``Export`` (a bundle to run anywhere, its
result brought back with ``overbrainer import``) and ``SSH`` (another machine, over the
real OpenSSH client).

A target runs a trainer's commands one after the other in the run folder, writing a stage
event into the metrics file before each; it skips the commands after the first once the
trainer's stop marker exists (a stopped job is not merged), and fails a job that exits 0
without a single metric line when the trainer requires one (its plugin did not load).
All of them run the commands through ``portable.common.run_commands``: ``Here`` in this
process, elsewhere the job folder's ``run.py`` (``portable/runner.py``); ``bundle.py``
moves the job there and ``receive.py`` its artifacts back, verified.

``here.py``     `Here`
``export.py``   `Export`, `Exported`
``ssh.py``      `SSH`
``slurm.py``    `Slurm`: a batch job on a cluster that shares the run folder
``bundle.py``   a job folder, staged from the run folder; a bundle
``receive.py``  a result brought back into the run folder, verified

Every target has ``run(trainer, run_dir, env, log, poll) -> exit code`` and ``where``
(what run.json records). ``Export.run`` ends the bake with `Exported` (exit code 0, train
not stamped) until a result is imported; then the next bake takes it up.

Over ssh (`SSH`)::

    <workdir>/runs/<name>-<fp8>/        the job folder (runner.py's layout), one per fingerprint
    <workdir>/bases/<pin16>/            base models, sent once, verified by each job
    <workdir>/tools/<trainer>-<12 hex>/ a venv with the trainer's packages, made once

The job runs detached there (it outlives the connection and this process: a bake killed
here finds it running and follows it again). Every second this side fetches the new part
of its metrics file and log (run.json's step and `overbrainer status` move); the run's
``stop`` file becomes the job's; at the end the artifacts come back as a tar over ssh,
only the files this side lacks, checked against the manifest run.py computes there.
Settings from the environment (none goes into the job):

    OVERBRAINER_SSH_COMMAND      the ssh client and extra options (default ``ssh``), e.g.
                                 ``ssh -F /dev/null -o UserKnownHostsFile=/tmp/kh``
    OVERBRAINER_REMOTE_PYTHON    a Python there that already has the trainer's packages:
                                 no venv is made (what the tests use: the same machine)
    OVERBRAINER_REMOTE_INSTALL   what pip installs into the venv (default: the trainer's
                                 requirements, ``overbrainer==<version>`` for the built-in)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..trainers.protocol import Trainer

if TYPE_CHECKING:
    from ..hashing import HashCache
    from .bundle import Base

__all__ = ["Target", "target_for"]


class Target(Protocol):
    """Where a job runs."""

    where: str  # what run.json records: "here", "export", "ssh://user@host/path"

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        """Run the trainer's job for the run folder `run_dir`, with `env` added to its
        environment and its output appended to `log`, calling `poll` about five times a
        second; the job's exit code (0: look at the run folder for what it made)."""


def target_for(where, base: Base, hashes: HashCache, plan_dir: Path,
               say: Callable[[str], None] = print, shown: Callable[[Path], str] = str,
               tell: Callable[..., None] = lambda **fields: None, processes: int = 1) -> Target:
    """The target a plan's ``where`` names: "here", "export", an SSHTarget or a
    SlurmTarget (`tell` records its job in run.json; `processes` per node)."""
    if where == "here":
        from .here import Here

        return Here()
    if where == "export":
        from .export import Export

        return Export(base, hashes, shown)
    from ..plan import SlurmTarget

    if isinstance(where, SlurmTarget):
        from .slurm import Slurm

        return Slurm(where.slurm, processes, say, tell, base=base, hashes=hashes, plan_dir=plan_dir)
    from .ssh import SSH

    return SSH(where, base, hashes, plan_dir, say)
