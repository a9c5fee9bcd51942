"""Train: run the trainer in its own process, from the last checkpoint of this fingerprint.

While it trains, this process follows ``metrics.jsonl``: each new line is shown, mirrored to
the trackers the plan reports to (``trackers/``), and at each new checkpoint the run folder's
``loss.png`` is drawn again, so a long run has a picture while it runs.

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
    out = {"config": cfg, "examples": outputs_digest(split)}
    if cfg.get("shard"):
        # a sharded run's checkpoints are whole (gathered), and a step's math does not
        # depend on how many processes share it: another world size resumes the same run,
        # as another device does (the same math, other bits)
        return out
    # the world size changes the arithmetic (gradients are all-reduced): exact per size
    out["processes"] = bake.plan.train.processes
    # so does the number of nodes (read from the JSON form: the up-to-date check has the
    # remembered plan, without pydantic)
    where = bake.plan.where
    slurm = None if isinstance(where, str) else where.model_dump(mode="json").get("slurm")
    nodes = slurm["nodes"] if slurm else bake.plan.train.nodes  # torchrun's rendezvous across machines
    if nodes > 1:
        out["nodes"] = nodes
    return out


def run(bake: Bake, inputs: dict) -> Outputs:
    from ..formats import check_formats

    folder = bake.folder
    base_folder = Path(upstream(bake, "base").summary["folder"])
    check_formats(list(bake.plan.bake.formats), json.loads((base_folder / "config.json").read_text()),
                  bake.plan.train.adapter)
    fp = fingerprint(NAME, VERSION, inputs)
    if bake.plan.report_to:
        from ..trackers import require

        require(list(bake.plan.report_to))  # before training, in one line
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
    """Run the trainer's job where the plan says, following its metrics as they come."""
    from ..trainers import NoTrainingData, get_trainer
    from ..where import target_for
    from ..where.bundle import Base

    folder = bake.folder
    train = bake.plan.train
    own = dict(nodes=train.nodes, rendezvous=train.rendezvous, run_id=bake.plan.name,
               deterministic=train.deterministic) if train.trainer == "builtin" else {}
    trainer = get_trainer(train.trainer, processes=train.processes, **own)
    follower = Follower(bake, max_steps, fp)
    # where the plan says: here, an exported bundle, or another machine over ssh
    base = Base.from_stamp(upstream(bake, "base"))
    target = target_for(bake.plan.where, base, bake.hashes, bake.plan_dir, say=bake.say, shown=bake.shown,
                        tell=bake.tell, processes=bake.plan.train.processes)
    bake.tell(state="running", steps=max_steps, where=target.where)
    code = None
    try:
        code = target.run(trainer, folder.root, {"OVERBRAINER_FINGERPRINT": fp}, folder.log, follower.poll)
        return code
    except NoTrainingData as e:
        raise OverbrainerError(str(e)) from None
    finally:
        follower.poll()
        follower.close(finished=code == 0 and not folder.stopped_marker.exists())


class Follower:
    """What the bake does with the trainer's output as it comes: each new metrics line shown
    and mirrored to the trackers, and at each new checkpoint the loss curve drawn again and
    the checkpoint handed to the trackers."""

    def __init__(self, bake: Bake, max_steps: int, fp: str):
        self.bake, self.max_steps = bake, max_steps
        folder = bake.folder
        self.seen = _line_count(folder.metrics)
        self.checkpoints = {p.name for _, p in ckpt.complete(folder.checkpoints)}
        self.mirror = None
        if bake.plan.report_to:
            from ..trackers import Mirror

            self.mirror = Mirror(list(bake.plan.report_to), folder, fp, bake.plan.model_dump(mode="json"), bake.say)
            if self.seen:  # lines a bake that died wrote before it could mirror them
                self.mirror.lines(_read_lines(folder.metrics, 0)[0])

    def poll(self) -> None:
        lines, self.seen = _read_lines(self.bake.folder.metrics, self.seen)
        for m in lines:
            _show(self.bake, m, self.max_steps)
        if self.mirror and lines:
            self.mirror.lines(lines)
        done = ckpt.complete(self.bake.folder.checkpoints)
        new = [p for _, p in done if p.name not in self.checkpoints]
        if new:
            self.checkpoints.update(p.name for p in new)
            draw_loss(self.bake.folder)
            for path in new:
                if self.mirror:
                    self.mirror.checkpoint(path)

    def close(self, finished: bool) -> None:
        if self.mirror:
            self.mirror.close(finished)


def draw_loss(folder: RunFolder) -> None:
    """The run folder's loss.png, from metrics.jsonl as it is now (replaced whole)."""
    import io

    from ..formats.card import plot_loss, read_metrics
    from ..fsio import write_atomic

    buf = io.BytesIO()
    plot_loss(read_metrics(folder.metrics), buf, title=folder.name)
    write_atomic(folder.loss_plot, buf.getvalue(), durable=False)  # a picture


def _read_lines(metrics: Path, seen: int) -> tuple[list[dict], int]:
    """The complete lines of metrics.jsonl after the first `seen`, and the new count."""
    try:
        raw = metrics.read_text().splitlines()
    except OSError:
        return [], seen
    if len(raw) < seen:  # truncated by a resume
        seen = len(raw)
    out = []
    for text in raw[seen:]:
        try:
            m = json.loads(text)
        except ValueError:
            break  # a line still being written
        seen += 1
        out.append(m)
    return out, seen


def _show(bake: Bake, m: dict, max_steps: int) -> None:
    if "step" not in m:
        return  # a stage event
    bake.tell(step=m["step"])
    rate = m["tokens"] / max(m["seconds"], 1e-9)
    ev = f"  eval {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else ""
    bake.say(f"  step {m['step']}/{max_steps}  loss {m['loss']:.4f}{ev}  lr {m['lr']:.2e}  {rate:.0f} tok/s  {m['phase']}")


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
