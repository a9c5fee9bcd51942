"""Decay branches: a finished model branched off the trunk's stable phase.

Up to the start of its decay a warmup-stable-decay run is the same run whatever its length
(the train step's *trajectory*). So a finished model of b steps is the trunk up to its decay
start plus a decay of its own. A branch is the run folder ``branches/<label>/``
(`folder.BranchFolder`), made by three steps, each an ordinary step run on that folder:

    decay@<label>   the trunk's checkpoint at the decay start, hard-linked into the
                    branch's checkpoints/ (with the trunk's metrics up to it), then the train
                    step on the branch's config.yaml: the trainer resumes from that
                    checkpoint and trains the decay
    merge@<label>   the merge step, on the branch
    bake@<label>    the bake step, on the branch; its card names the trunk checkpoint

Two kinds of label:

- ``<b>``, one per ``train.budgets``: the schedule of a single run of b steps (the config
  step's ``budgets``), decaying from b − decay(b), where the trunk saves a checkpoint;
- ``at-<s>``, made by ``overbrainer decay RUN --at s [--steps N]`` (its ``branch.json``:
  ``{"at": s, "steps": N}``): the schedule of a run of s + N steps whose decay begins at s.

Each ends with the weights of a fresh run of that schedule from step 0, bit for bit on CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import OverbrainerError
from ..folder import (
    BRANCHES,
    CHECKPOINTS,
    EXAMPLES,
    META,
    TRAIN_SPLIT,
    VALIDATION_SPLIT,
    BranchFolder,
)
from ..hashing import hash_bytes
from ..stamps import Stamp, fingerprint
from ..trainers import checkpoint as ckpt
from . import NotReady, Outputs, merge, train, upstream
from . import bake as bake_step

if TYPE_CHECKING:
    from .context import Bake

__all__ = ["Step", "steps_of", "labels", "AT", "at_label", "Spec", "make_at_branch", "stable_checkpoints"]

AT = re.compile(r"^at-([0-9]+)$")


def at_label(step: int) -> str:
    return f"at-{step}"


@dataclass
class Spec:
    """A branch's schedule: its steps in all, its warmup, and its decay; it decays from the
    trunk's checkpoint at `start`."""

    steps: int
    warmup: int
    decay: int

    @property
    def start(self) -> int:
        return self.steps - self.decay


def spec(bake: Bake, label: str) -> Spec:
    """The schedule of branch `label`: from the config step's stamp (a budget) or the
    branch's branch.json (``at-<s>``)."""
    config = upstream(bake, "config")
    m = AT.match(label)
    if m is None:
        phases = config.summary.get("budgets", {}).get(label)
        if phases is None:
            raise NotReady("config")
        return Spec(phases["max_steps"], phases["warmup"], phases["decay"])
    asked = json.loads(bake.folder.branch(label).branch_json.read_text())
    warmup = config.summary["config"]["warmup_steps"]
    return Spec(asked["at"] + asked["steps"], warmup, asked["steps"])


def branch_config(cfg: dict, s: Spec) -> dict:
    """The trunk's config.yaml as a run of the branch's schedule: where it ends and where its
    decay begins, nothing else (the checkpoints where budgets branch off are the trunk's)."""
    out = {k: v for k, v in cfg.items() if k != "save_at"}
    out["max_steps"] = s.steps
    out["warmup_steps"] = s.warmup
    out["lr_scheduler_kwargs"] = {**cfg["lr_scheduler_kwargs"], "num_stable_steps": s.steps - s.decay - s.warmup,
                                  "num_decay_steps": s.decay}
    return out


def weights_digest(stamp: Stamp, checkpoint: str) -> str | None:
    """One hash of a checkpoint's files but its sidecar (whose times and fingerprint another
    rerun of the trunk would write anew): None when the trunk's stamp has no such checkpoint."""
    under = f"{CHECKPOINTS}/{checkpoint}/"
    items = [f"{e['path']}:{e['hash']}" for e in stamp.outputs
             if e["path"].startswith(under) and not e["path"].endswith("/" + META)]
    return hash_bytes("\n".join(items).encode()) if items else None


class Step:
    """One step of a branch (decay, merge or bake): the step module `module` run on the
    branch's folder, named ``<kind>@<label>`` in the graph and its stamps."""

    def __init__(self, module: ModuleType, label: str):
        self.module, self.label = module, label
        self.kind = "decay" if module is train else module.NAME
        self.NAME = f"{self.kind}@{label}"
        self.VERSION = module.VERSION
        self.TARGETS = [f"{BRANCHES}/{label}/{t}" for t in module.TARGETS]
        what = {"decay": "the decay of branch", "merge": "merge of branch", "bake": "bake of branch"}[self.kind]
        self.__doc__ = f"{what} {label} (branches/{label}/)"

    def __repr__(self) -> str:
        return f"<branch step {self.NAME}>"

    def on(self, bake: Bake) -> Bake:
        """The bake as seen from the branch: its folder is the branch's."""
        return replace(bake, folder=bake.folder.branch(self.label), checked={})

    def inputs(self, bake: Bake) -> dict:
        sub = self.on(bake)
        if self.kind == "merge":
            return merge.inputs(sub)
        if self.kind == "bake":
            out = bake_step.inputs(sub)
            out["card"]["branch"] = upstream(sub, "train").summary.get("branch")
            return out
        s = spec(bake, self.label)
        out = train.inputs(sub)
        out["config"] = branch_config(out["config"], s)
        name = ckpt.step_dir(bake.folder.checkpoints, s.start).name
        digest = weights_digest(upstream(bake, "train"), name)
        if digest is None:
            raise NotReady("train")  # the trunk has not reached it (yet)
        out["branch"] = {"from": name, "weights": digest}
        return out

    def run(self, bake: Bake, inputs: dict) -> Outputs:
        sub = self.on(bake)
        folder: BranchFolder = sub.folder  # type: ignore[assignment]
        if self.kind == "decay":
            prepare(bake, folder, inputs)
            out = train.run(sub, inputs)
            out.summary["branch"] = {"label": self.label, "from": inputs["branch"]["from"],
                                     "trunk": f"{CHECKPOINTS}/{inputs['branch']['from']}"}
        else:
            out = self.module.run(sub, inputs)
        out.root = f"{BRANCHES}/{self.label}"
        return out


def prepare(bake: Bake, folder: BranchFolder, inputs: dict) -> None:
    """The branch's folder, ready for the trainer: examples.parquet and its split files (hard-linked), its
    config.yaml, and the trunk's checkpoint at its decay start with the trunk's metrics up
    to it, unless the branch has it already."""
    import yaml

    from ..formats.adapter import link_or_copy
    from ..fsio import write_atomic

    folder.root.mkdir(parents=True, exist_ok=True)
    folder.stop_request.unlink(missing_ok=True)  # a stop asked of an earlier bake
    # the examples and the split files the config names, as the trunk has them
    for name in (EXAMPLES, TRAIN_SPLIT, VALIDATION_SPLIT):
        mine, trunks = folder.root / name, bake.folder.root / name
        if not trunks.exists() or (mine.exists() and os.path.samestat(mine.stat(), trunks.stat())):
            continue
        tmp = folder.root / f".tmp-{name}"
        tmp.unlink(missing_ok=True)
        link_or_copy(trunks, tmp)
        os.replace(tmp, mine)
    full = upstream(bake, "config").summary["config"]  # with the keys that say how it computes
    cfg = branch_config(full, spec(bake, folder.label))
    header = f"# written by overbrainer for branch {folder.label} of {bake.folder.name}; edits are overwritten\n"
    write_atomic(folder.config, (header + yaml.safe_dump(cfg, sort_keys=False)).encode())

    name = inputs["branch"]["from"]
    start = int(name.split("-")[1])
    seed = folder.checkpoints / name
    fp = fingerprint(train.NAME, train.VERSION, inputs)
    # a branch of an older trajectory (the trunk's learning rate changed): its checkpoints
    # go to its attic first, so the seed below is the current trunk's
    train.set_aside_other_runs(folder.root, folder.checkpoints, fp, inputs)
    if seed.exists():
        return
    folder.checkpoints.mkdir(parents=True, exist_ok=True)
    ckpt.remove_partial(folder.checkpoints)
    tmp = ckpt.tmp_dir(folder.checkpoints, start)
    tmp.mkdir()
    for f in sorted((bake.folder.checkpoints / name).iterdir()):
        link_or_copy(f, tmp / f.name)
    from ..portable.common import truncate_metrics

    if bake.folder.metrics.exists():
        shutil.copy2(bake.folder.metrics, folder.metrics)
        truncate_metrics(folder.metrics, start)
    os.replace(tmp, seed)


def labels(bake: Bake) -> list[str]:
    """The branches of this bake: one per budget of the plan, then those ``overbrainer
    decay`` made (``branches/at-<s>/branch.json``), by step."""
    budgets = getattr(bake.plan.train, "budgets", None) or []
    out = [str(b) for b in budgets]
    made = []
    if bake.folder.branches.is_dir():
        for p in bake.folder.branches.iterdir():
            m = AT.match(p.name)
            # one whose trunk checkpoint is gone (moved to the attic by a changed trunk)
            # stays on disk as it is, out of the graph
            at = int(m.group(1)) if m else None
            if m and (p / "branch.json").is_file() and ckpt.step_dir(bake.folder.checkpoints, at).is_dir():
                made.append((at, p.name))
    return out + [name for _, name in sorted(made)]


def steps_of(label: str) -> list[Step]:
    return [Step(train, label), Step(merge, label), Step(bake_step, label)]


def stable_checkpoints(bake: Bake) -> list[int]:
    """The trunk's complete checkpoints of the stable phase (at or before its decay
    start, of a known trajectory): where a decay may branch off."""
    out = []
    for step, path in ckpt.complete(bake.folder.checkpoints):
        try:
            meta = ckpt.read_meta(path)
        except (OSError, ValueError):
            continue
        if meta.get("trajectory") and step <= meta.get("decay_start", -1) and meta.get("phase") != "decay":
            out.append(step)
    return out


def make_at_branch(bake: Bake, at: int, steps: int | None) -> str:
    """Ask for branch ``at-<at>``: its branch.json, after checking that the trunk has a
    stable checkpoint there (OverbrainerError, one line, otherwise). Its label."""
    from ..fsio import write_atomic

    stable = stable_checkpoints(bake)
    there = ", ".join(str(s) for s in stable) or "none yet"
    if at not in stable:
        done = {s for s, _ in ckpt.complete(bake.folder.checkpoints)}
        what = "is in the decay" if at in done else "has no checkpoint"
        raise OverbrainerError(f"decay --at {at}: step {at} of {bake.folder.name} {what}; "
                               f"the stable checkpoints are: {there}")
    config = upstream(bake, "config").summary["config"]
    decay = steps if steps is not None else config["lr_scheduler_kwargs"]["num_decay_steps"]
    if decay < 1:
        why = "a decay needs at least one step" if steps is not None else \
            "the trunk has no decay of its own to copy (train.budgets)"
        raise OverbrainerError(f"decay --at {at}: {why}; give --steps N")
    label = at_label(at)
    folder = bake.folder.branch(label)
    asked = {"at": at, "steps": decay}
    if folder.branch_json.exists():
        had = json.loads(folder.branch_json.read_text())
        if had != asked:
            raise OverbrainerError(f"decay --at {at}: branch {label} decays {had['steps']} steps already; "
                                   f"give --steps {had['steps']} to go on with it, or remove {folder.root}")
        return label
    folder.root.mkdir(parents=True, exist_ok=True)
    write_atomic(folder.branch_json, json.dumps(asked))
    return label
