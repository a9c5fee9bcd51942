"""Moving a job away from the run folder: a job folder, and a bundle of it.

A job folder is what a trainer needs to run anywhere (its layout is specified in
``portable/runner.py``, which its ``run.py`` runs). `stage_job` makes one from the run folder; an
export packs it into a bundle, ``runs/<name>/export/``::

    <name>-<fp8>.tar.gz     the bundle: one folder, <name>-<fp8>/ (the job folder)
    job.json                a copy of the bundle's job.json: what `overbrainer import`
                            checks a result against (its fingerprint, its artifacts)
    imported.json           a result imported and not yet taken up by a bake
    imported.used.json      the last one a bake took up

``<fp8>`` is the start of the train step's fingerprint: a bundle of other settings is
another folder, so that unpacking it never mixes its checkpoints with another run's.

What travels: config.yaml (its ``base_model`` is ``../base``), the split files it names
(train.parquet, validation.parquet), what the
trainer's prepare() writes, metrics.jsonl and the newest checkpoint so far (to resume
from), and the base model when it cannot be fetched by the job itself: a local folder or
GGUF base is carried in ``base/``; a hub base is downloaded by the job at its pinned commit
(or given with ``--base PATH``); either way the job checks it against the pinned hashes.
The environment is the trainer's `env()`, which has no secrets: nothing of this process's
environment (HF_TOKEN, keys) is written into a job.

How a result comes back: ``receive.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import OverbrainerError
from ..folder import CONFIG, EXPORT, TRAIN_SPLIT, VALIDATION_SPLIT, RunFolder
from ..fsio import write_atomic
from ..hashing import HashCache, hash_file
from ..inputs.base_cache import SOURCE_FILE
from ..portable import launcher, ship
from ..portable import runner as jobfile
from ..version import __version__

__all__ = ["Base", "Staged", "stage_job", "export_bundle", "write_job_tar", "requirements", "FINGERPRINT_ENV"]

FINGERPRINT_ENV = "OVERBRAINER_FINGERPRINT"
# what a job folder needs to run a trainer, by trainer: pip requirements
# what a job elsewhere installs: pinned as the tools environment here is (Axolotl takes
# torch 2.11–2.13; on a GPU machine pip picks its CUDA build)
REQUIREMENTS = {
    "builtin": [f"overbrainer=={__version__}"],
    "axolotl": ["torch==2.13.0", "axolotl==0.19.0", "blake3"],
}


@dataclass(frozen=True)
class Base:
    """The base model as a job needs it: where it is here, and its pinned files."""

    folder: Path
    pin: str
    files: list[dict]  # path, size, hash: what the job checks its base against
    hub: dict | None = None  # {"repo", "commit"} when the job can download it itself

    @classmethod
    def from_stamp(cls, stamp) -> Base:
        """From the base step's stamp (its outputs are the model's files)."""
        from ..stamps import outputs_digest

        folder = Path(stamp.summary["folder"])
        files = [{k: e[k] for k in ("path", "size", "hash")} for e in stamp.outputs if e["path"] != SOURCE_FILE]
        source = {}
        try:
            source = json.loads((folder / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            pass
        hub = None
        if source.get("kind") == "hub" and source.get("commit"):
            hub = {"repo": source.get("location") or source["source"].split("@")[0], "commit": source["commit"]}
        return cls(folder=folder, pin=outputs_digest(stamp), files=files, hub=hub)


@dataclass
class Staged:
    """A job folder in the making: small files written under `home`, big ones (the base,
    the checkpoint) named where they already are."""

    home: Path
    job: dict
    members: list[tuple[str, Path]]  # (path in the job folder, the file to send)
    manifest: list[dict]


def requirements(trainer) -> list[str]:
    return REQUIREMENTS.get(trainer.name, [trainer.name, "blake3"])


def _newest_checkpoint(folder: Path) -> Path | None:
    """The newest whole checkpoint (what the trainer resumes from), by the trainers' own
    layout (``step-N``/``checkpoint-N`` with its meta.json); a damaged one is not sent."""
    from ..trainers import checkpoint as ckpt

    for _, path in reversed(ckpt.complete(folder)):
        if ckpt.intact(path):
            return path
    return None


def stage_job(trainer, run_dir: Path, fingerprint: str, base: Base, root: str, home: Path,
              hashes: HashCache, carry_base: bool, env: dict | None = None) -> Staged:
    """Write a job folder's small files into `home` (emptied first) and list what it sends.
    `root` is the run folder's path as the job will see it (what prepare() and env() may
    name); `carry_base` puts the base model in the job's base/."""
    from ..trainers import NoTrainingData

    run_dir = Path(run_dir)
    shutil.rmtree(home, ignore_errors=True)
    (home / jobfile.RUN).mkdir(parents=True)
    stage = home / jobfile.RUN
    config = run_dir / CONFIG
    cfg = yaml.safe_load(config.read_text())
    cfg["base_model"] = "../base"  # the job folder's base/, whatever it is there
    header = "# overbrainer's config.yaml for a job folder: base_model is the job's base/\n"
    (stage / CONFIG).write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    for name in (TRAIN_SPLIT, VALIDATION_SPLIT, trainer.metrics_file()):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, stage / name)
    try:
        trainer.prepare(stage, root)
    except NoTrainingData as e:
        raise OverbrainerError(str(e).replace(str(stage), str(run_dir))) from None

    art = trainer.artifacts()
    job = {
        "format": jobfile.FORMAT,
        "name": run_dir.name,
        "fingerprint": fingerprint,
        "trainer": trainer.name,
        "overbrainer": __version__,
        "install": requirements(trainer),
        "commands": trainer.commands(),
        "env": {**trainer.env(root), **(env or {}), FINGERPRINT_ENV: fingerprint},
        "metrics_file": trainer.metrics_file(),
        "stages": trainer.stages(),
        "stop_marker": trainer.stop_marker(),
        "metrics_required": trainer.metrics_required(),
        "artifacts": {"entries": list(art.entries), "exclude": list(art.exclude), "required": art.required},
        "base": {"pin": base.pin, "files": base.files, "hub": base.hub, "carried": carry_base},
    }
    (home / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    ship(home)  # the runner and its helpers: overbrainer_portable/
    (home / "run.py").write_text(launcher("runner", "Run this overbrainer job: python3 run.py [--base PATH] (see README.txt)."))
    (home / "run.sh").write_text('#!/bin/sh\n# run the job with $PYTHON (default python3): sh run.sh [--base PATH]\n'
                                 'exec "${PYTHON:-python3}" "$(dirname "$0")/run.py" "$@"\n')
    (home / "README.txt").write_text(_readme(job, carry_base))

    members = [(p.relative_to(home).as_posix(), p) for p in sorted(home.rglob("*")) if p.is_file()]
    if art.required:
        newest = _newest_checkpoint(run_dir / art.required)
        if newest is not None:
            for rel in jobfile.artifact_files(run_dir, [newest.relative_to(run_dir).as_posix()], list(art.exclude)):
                members.append((f"{jobfile.RUN}/{rel}", run_dir / rel))
    known = {}
    if carry_base:
        for f in base.files:
            members.append((f"base/{f['path']}", base.folder / f["path"]))
            known[f"base/{f['path']}"] = f
    manifest = []
    for arc, path in members:
        st = path.stat()
        f = known.get(arc)
        if f and f["size"] == st.st_size:
            digest = f["hash"]  # the base step hashed it
        elif path.is_relative_to(home):
            digest = hash_file(path)  # staged here, gone after: not for the run's hash cache
        else:
            digest = hashes.hash(path, st)  # a checkpoint: hashed once, then known by its stat
        manifest.append({"path": arc, "size": st.st_size, "hash": digest})
    hashes.save()
    (home / "MANIFEST.json").write_text(json.dumps({"format": jobfile.FORMAT, "files": manifest}, indent=1) + "\n")
    members.insert(0, ("MANIFEST.json", home / "MANIFEST.json"))
    return Staged(home=home, job=job, members=members, manifest=manifest)


def _readme(job: dict, carry_base: bool) -> str:
    base = ("The base model is in base/." if carry_base else
            "The base model is not in the bundle: the job downloads it from the hub at its pinned commit, "
            "or give it with `python3 run.py --base PATH`." if job["base"]["hub"] else
            "Give the base model with `python3 run.py --base PATH`.")
    return f"""An overbrainer job: {job['name']}, trainer {job['trainer']} (fingerprint {job['fingerprint'][:12]}).

On a machine with Python and the trainer's packages ({' '.join(job['install'])}, e.g.
`pip install {' '.join(job['install'])}`):

    python3 run.py            # or: sh run.sh
    python3 run.py stop       # from another shell: save a checkpoint and stop (Ctrl-C does too)
    python3 run.py            # again: go on from the newest checkpoint

{base} It is checked against the pinned hashes before training.
The job checks its own files against MANIFEST.json first.

At the end it writes result.tar.gz here. Bring it back to the run folder, then bake again:

    overbrainer import {job['name']} result.tar.gz
    overbrainer bake PLAN
"""


def write_job_tar(staged: Staged, out, prefix: str = "", gz: bool = False) -> None:
    """The job folder as a tar, to the binary stream `out` (each path under `prefix`)."""
    mode = "w|gz" if gz else "w|"
    with tarfile.open(fileobj=out, mode=mode, format=tarfile.PAX_FORMAT) as tar:
        for arc, path in staged.members:
            executable = arc in ("run.py", "run.sh")
            jobfile.add_file(tar, f"{prefix}{arc}", path, mode=0o755 if executable else 0o644)


def export_bundle(trainer, run_dir: Path, fingerprint: str, base: Base, hashes: HashCache) -> Path:
    """Write ``export/<name>-<fp8>.tar.gz`` (and export/job.json); return the bundle's path.
    Bundles of other fingerprints are removed: they are made again from the run folder."""
    folder = RunFolder(Path(run_dir))
    export = folder.root / EXPORT
    export.mkdir(exist_ok=True)
    stem = f"{folder.name}-{fingerprint[:8]}"
    staged = stage_job(trainer, folder.root, fingerprint, base, ".", export / f".staging-{os.getpid()}", hashes,
                       carry_base=base.hub is None)
    try:
        bundle = export / f"{stem}.tar.gz"
        tmp = export / f".{stem}.tar.gz.{os.getpid()}.tmp"
        with open(tmp, "wb") as raw:
            write_job_tar(staged, raw, prefix=f"{stem}/", gz=True)
        os.replace(tmp, bundle)
        write_atomic(export / "job.json", (json.dumps(staged.job, indent=1) + "\n").encode())
    finally:
        shutil.rmtree(staged.home, ignore_errors=True)
    for old in export.glob(f"{folder.name}-*.tar.gz"):
        if old != bundle:
            old.unlink()
    return bundle


# -- bringing results back -----------------------------------------------------------------
