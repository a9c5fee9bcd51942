"""Train: run the trainer in its own process, from the last checkpoint of this fingerprint.

Checkpoints made under another fingerprint (an older learning rate, other data) are moved
to ``attic/`` before training starts, never deleted: a trained model is expensive.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OverbrainerError, RunFailed, RunStopped
from ..folder import CHECKPOINTS, LOG, METRICS, RunFolder
from ..stamps import fingerprint, outputs_digest
from ..trainers import checkpoint as ckpt
from . import NotReady, Outputs, upstream

if TYPE_CHECKING:
    from .context import Bake

NAME = "train"
VERSION = 1
# config.yaml keys that say how the steps are computed, not what they compute: a run
# resumes across a change of them (a checkpoint made on the GPU goes on on the CPU, an
# out-of-memory run goes on with gradient checkpointing), and a finished one stays done.
# The math is the same; the bits are the same only on the same device and build.
HOW_IT_COMPUTES = ("device", "deterministic", "torch_compile", "gradient_checkpointing", "liger_rope",
                   "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")

TARGETS = [f"{CHECKPOINTS}/", METRICS, LOG]


def inputs(bake: Bake) -> dict:
    split, base = upstream(bake, "split"), upstream(bake, "base")
    # config.yaml as the config step wrote it (its stamp keeps it as data; the stamp's
    # manifest holds config.yaml to it); a stamp older than that reads the file
    cfg = upstream(bake, "config").summary.get("config")
    if cfg is None:
        import yaml

        try:
            cfg = yaml.safe_load(bake.folder.config.read_text())
        except (OSError, yaml.YAMLError):
            raise NotReady("config") from None
    cfg = {k: v for k, v in cfg.items() if k not in HOW_IT_COMPUTES}
    # the run is what the config says, with the base model known by its content rather
    # than by where the cache put it: a cache moved elsewhere retrains nothing
    cfg["base_model"] = outputs_digest(base)
    # the world size changes the arithmetic (gradients are all-reduced): exact per size
    # (nodes too: the world is processes x nodes)
    world = {"processes": bake.plan.train.processes}
    if bake.plan.train.nodes > 1:
        world["nodes"] = bake.plan.train.nodes
    return {"config": cfg, "examples": outputs_digest(split), **world}


def run(bake: Bake, inputs: dict) -> Outputs:
    from ..formats import check_formats

    folder = bake.folder
    base_folder = Path(upstream(bake, "base").summary["folder"])
    check_formats(list(bake.plan.bake.formats), json.loads((base_folder / "config.json").read_text()),
                  bake.plan.train.adapter)
    fp = fingerprint(NAME, VERSION, inputs)
    set_aside_other_runs(folder.root, folder.checkpoints, fp)
    max_steps = inputs["config"]["max_steps"]
    code = launch(bake, fp, max_steps)
    if code != 0:
        said = folder.trainer_error
        if said.exists():  # the trainer said why, in one line
            raise RunFailed(f"training failed: {said.read_text().strip()}", log_tail="")
        raise RunFailed(
            f"training failed (exit code {code}); the end of {bake.shown(folder.log)}:",
            log_tail=tail(folder.log, 15),
        )
    if folder.stopped_marker.exists():
        step = json.loads(folder.stopped_marker.read_text()).get("step")
        raise RunStopped(f"stopped at step {step} of {max_steps}; run the same bake again to resume")
    done = ckpt.complete(folder.checkpoints)
    if not done or done[-1][0] != max_steps:
        raise RunFailed(f"the trainer ended without its final checkpoint (step {max_steps})", tail(folder.log, 15))
    meta = ckpt.read_meta(done[-1][1])
    bake.tell(device=meta.get("device"))  # where it trained, as its checkpoint says
    summary = {
        "steps": max_steps,
        "checkpoint": done[-1][1].name,
        "loss": meta["loss"],
        "eval_loss": meta["eval_loss"],
        "tokens": meta["tokens"],
        "seconds": meta["seconds"],
        "tokens_per_second": round(meta["tokens"] / max(meta["seconds"], 1e-9), 1),
        "peak_memory": meta.get("peak_memory"),
        "device": meta.get("device"),
    }
    return Outputs([CHECKPOINTS, METRICS], summary=summary)


def set_aside_other_runs(run_dir: Path, checkpoints: Path, fp: str) -> None:
    """Move checkpoints (and their metrics) of another fingerprint to attic/."""
    done = ckpt.complete(checkpoints)
    others = [p for _, p in done if ckpt.read_meta(p).get("fingerprint") != fp]
    if not others:
        return
    old = ckpt.read_meta(others[-1]).get("fingerprint") or "unknown"
    when = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    dest = RunFolder(run_dir).attic / f"{when}-{old[:8]}"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(checkpoints), str(dest / CHECKPOINTS))
    metrics = RunFolder(run_dir).metrics
    if metrics.exists():
        shutil.move(str(metrics), str(dest / METRICS))


def launch(bake: Bake, fp: str, max_steps: int) -> int:
    """Run the trainer's job where the plan says, printing its metric lines as they come."""
    from ..trainers import NoTrainingData, get_trainer
    from ..where import target_for
    from ..where.bundle import Base

    folder = bake.folder
    train = bake.plan.train
    own = dict(nodes=train.nodes, rendezvous=train.rendezvous, run_id=bake.plan.name,
               deterministic=train.deterministic) if train.trainer == "builtin" else {}
    trainer = get_trainer(train.trainer, processes=train.processes, **own)
    seen = [_line_count(folder.metrics)]

    def poll() -> None:
        seen[0] = _report_new_lines(bake, folder.metrics, seen[0], max_steps)

    # where the plan says: here, an exported bundle, or another machine over ssh
    base = Base.from_stamp(upstream(bake, "base"))
    target = target_for(bake.plan.where, base, bake.hashes, bake.plan_dir, say=bake.say, shown=bake.shown)
    bake.tell(state="running", steps=max_steps, where=target.where)
    try:
        return target.run(trainer, folder.root, {"OVERBRAINER_FINGERPRINT": fp}, folder.log, poll)
    except NoTrainingData as e:
        raise OverbrainerError(str(e)) from None
    finally:
        poll()


def _report_new_lines(bake: Bake, metrics: Path, seen: int, max_steps: int) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return seen
    if len(lines) < seen:  # truncated by a resume
        seen = len(lines)
    for raw in lines[seen:]:
        try:
            m = json.loads(raw)
        except ValueError:
            break  # a line still being written
        seen += 1
        if "step" not in m:
            continue  # a stage event
        bake.tell(step=m["step"])
        rate = m["tokens"] / max(m["seconds"], 1e-9)
        ev = f"  eval {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else ""
        bake.say(f"  step {m['step']}/{max_steps}  loss {m['loss']:.4f}{ev}  lr {m['lr']:.2e}  {rate:.0f} tok/s  {m['phase']}")
    return seen


def _line_count(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
