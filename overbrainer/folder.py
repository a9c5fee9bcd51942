"""The run folder, ``runs/<name>/``: every file a run has, named in one place.

=====================  ==============================================================
``plan.json``          every resolved setting, inputs pinned by content hash
``examples.parquet``   the conversations, with their split (``id, split, messages, source``)
``config.yaml``        the trainer's configuration, in Axolotl's format
``run.json``           the run's state and its process
``metrics.jsonl``      one line per logged step
``samples.jsonl``      greedy answers to the sample prompts, one line per sampled step
                       (``{"step", "samples": [{"prompt", "answer"}]}``; ``train.samples``)
``profile/``           where a few steps spent their time (``train.profile``): ``ops.txt``,
                       ``trace.json.gz`` (``-rank<r>`` under several processes), ``memory.pickle``
``log.txt``            the trainer's own output
``checkpoints/``       ``step-NNNNNN/`` folders (see ``trainers/checkpoint.py``)
``merged/``            the adapter merged into the base model (HF safetensors)
``baked/``             the model people use, with its model card
``attic/``             outputs of an older fingerprint, moved aside instead of deleted
``branches/``          decay branches: ``<budget>/`` per train.budgets, ``at-<step>/`` per
                       ``overbrainer decay --at``; each a run folder of its own (config.yaml,
                       examples.parquet hard-linked, checkpoints/, metrics.jsonl, log.txt,
                       merged/, baked/, and ``branch.json``: what it decays from), whose
                       stamps are the trunk's ``.stamps/decay@<label>.json`` and so on
``.stamps/``           one stamp per finished step (``stamps.py``)
``.doit.db``           doit's own state (sqlite3); losing it costs a few stats
``.hashes.json``       the content-hash cache
``.plan.json``         the plan as last validated, for checks without pydantic (``remembered.py``)
``.lock``              held by the process that bakes this folder
``.run.lock``          held while run.json is read, changed and written
``stop``               a stop request: the trainer saves a checkpoint and ends
``stopped.json``       the trainer stopped early, on request (``{"step", "steps"}``)
``trainer-error.txt``  one line: why the trainer gave up
``export/``            bundles of an exported job, and ``imported.json``: a result imported
``axolotl-job/``       the Axolotl trainer's job files (``trainers/axolotl.py``)
``job.sh``             a Slurm run's batch script (``where/slurm.py``)
``slurm/``             a Slurm run's jobs: what job.sh runs, the jobs submitted, how each ended
``loss.png``           the loss curve so far, drawn again at each checkpoint
``tensorboard/``       TensorBoard's event files, when the plan reports to it (``trackers/``)
``mlruns/``            MLflow's SQLite store, when it reports to MLflow without a server
``wandb/``             W&B's run files, when it reports to W&B
=====================  ==============================================================

The names are the constants below (``RunFolder``'s properties give the paths); the few that
processes without overbrainer need (the trainer's, the Axolotl plugin's, a job runner's)
are ``portable/common.py``'s and taken from there. Nothing else spells them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .portable.common import LOG, META, METRICS, STOP, STOPPED, TRAINER_ERROR

__all__ = [
    "RunFolder", "runs_root", "cache_root", "default_name", "RUNS_ENV",
    "BranchFolder", "BRANCHES", "BRANCH_JSON", "PLAN_JSON", "EXAMPLES", "CONFIG", "RUN_JSON", "METRICS", "LOG", "CHECKPOINTS", "MERGED", "BAKED", "ATTIC",
    "STAMPS", "DOIT_DB", "HASH_CACHE", "PLAN_MEMO", "LOCK", "RUN_LOCK", "STOP", "STOPPED", "TRAINER_ERROR",
    "EXPORT", "IMPORTED", "IMPORTED_USED", "AXOLOTL_JOB", "META", "JOB_SH", "SLURM", "LOSS_PLOT", "TENSORBOARD",
    "MLRUNS", "WANDB", "SAMPLES", "PROFILE",
]

RUNS_ENV = "OVERBRAINER_RUNS"

PLAN_JSON = "plan.json"
EXAMPLES = "examples.parquet"
CONFIG = "config.yaml"
TRAIN_SPLIT = "train.parquet"  # examples.parquet's train rows, which config.yaml trains on
VALIDATION_SPLIT = "validation.parquet"  # its validation rows (config.yaml's test_datasets)
RUN_JSON = "run.json"
CHECKPOINTS = "checkpoints"
MERGED = "merged"
BAKED = "baked"
ATTIC = "attic"
BRANCHES = "branches"
BRANCH_JSON = "branch.json"
STAMPS = ".stamps"
DOIT_DB = ".doit.db"
HASH_CACHE = ".hashes.json"
PLAN_MEMO = ".plan.json"
LOCK = ".lock"
RUN_LOCK = ".run.lock"
EXPORT = "export"
IMPORTED = "imported.json"  # in export/: a result imported, not yet taken up by a bake
IMPORTED_USED = "imported.used.json"  # in export/: the last one a bake took up
AXOLOTL_JOB = "axolotl-job"
JOB_SH = "job.sh"
SLURM = "slurm"
LOSS_PLOT = "loss.png"
TENSORBOARD = "tensorboard"
MLRUNS = "mlruns"
WANDB = "wandb"
SAMPLES = "samples.jsonl"
PROFILE = "profile"


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
    """A plan without a name is named after its file. A file name that is not a run name
    as it stands (spaces, non-ASCII letters) gets a short hash of itself after the letters
    kept, so that ``a b.json`` and ``a-b.json``, or ``ü.json`` and ``é.json``, never share
    a run folder."""
    import hashlib

    stem = path.stem
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-._") or "plan"
    if name != stem:
        name = f"{name[:92]}-{hashlib.blake2s(stem.encode(), digest_size=3).hexdigest()}"
    return name[:100]


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    plan_json = property(lambda self: self.root / PLAN_JSON)
    examples = property(lambda self: self.root / EXAMPLES)
    config = property(lambda self: self.root / CONFIG)
    run_json = property(lambda self: self.root / RUN_JSON)
    metrics = property(lambda self: self.root / METRICS)
    log = property(lambda self: self.root / LOG)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    merged = property(lambda self: self.root / MERGED)
    baked = property(lambda self: self.root / BAKED)
    attic = property(lambda self: self.root / ATTIC)
    stamps = property(lambda self: self.root / STAMPS)
    doit_db = property(lambda self: self.root / DOIT_DB)
    hash_cache = property(lambda self: self.root / HASH_CACHE)
    plan_memo = property(lambda self: self.root / PLAN_MEMO)
    lock = property(lambda self: self.root / LOCK)
    run_lock = property(lambda self: self.root / RUN_LOCK)
    stop_request = property(lambda self: self.root / STOP)
    stopped_marker = property(lambda self: self.root / STOPPED)
    trainer_error = property(lambda self: self.root / TRAINER_ERROR)
    export = property(lambda self: self.root / EXPORT)
    axolotl_job = property(lambda self: self.root / AXOLOTL_JOB)
    job_sh = property(lambda self: self.root / JOB_SH)
    slurm = property(lambda self: self.root / SLURM)
    loss_plot = property(lambda self: self.root / LOSS_PLOT)
    tensorboard = property(lambda self: self.root / TENSORBOARD)
    mlruns = property(lambda self: self.root / MLRUNS)
    wandb = property(lambda self: self.root / WANDB)
    samples = property(lambda self: self.root / SAMPLES)
    profile = property(lambda self: self.root / PROFILE)

    branches = property(lambda self: self.root / BRANCHES)

    def stamp(self, step: str) -> Path:
        return self.stamps / f"{step}.json"

    def branch(self, label: str) -> BranchFolder:
        return BranchFolder(self.branches / label, self.root, label)


# a branch's own steps, by the name the step modules read their upstream stamps by
_BRANCH_OWN = {"train": "decay", "merge": "merge", "bake": "bake"}


@dataclass(frozen=True)
class BranchFolder(RunFolder):
    """A decay branch, ``branches/<label>/`` of the run folder `trunk`: a run folder of its
    own for what it makes, whose stamps are kept in the trunk's ``.stamps/``: its decay as
    ``decay@<label>`` (what the steps read as "train"), ``merge@<label>``, ``bake@<label>``,
    and every other step's stamp the trunk's own. A stop asked of the run is the trunk's."""

    trunk: Path
    label: str

    def stamp(self, step: str) -> Path:
        own = _BRANCH_OWN.get(step)
        return RunFolder(self.trunk).stamp(f"{own}@{self.label}" if own else step)

    branch_json = property(lambda self: self.root / BRANCH_JSON)
    trunk_stop = property(lambda self: self.trunk / STOP)
