"""Train: run the trainer in its own process, from the last checkpoint of this fingerprint.

While it trains, this process follows ``metrics.jsonl``: each new line is shown, mirrored to
the trackers the plan reports to (``trackers/``) with the samples of ``samples.jsonl``, and at each new checkpoint the run folder's
``loss.png`` is drawn again, so a long run has a picture while it runs.

Checkpoints made under another fingerprint (an older learning rate, other data) are moved
to ``attic/`` before training starts, never deleted: a trained model is expensive. All but
those of the same *trajectory*: every input that shapes the weights up to a step, which is
everything but where the run ends and where its decay begins. Up to the start of its decay
a warmup-stable-decay run is the same run whatever its length, so a checkpoint at or before
the decay start of both its own run and this one is this run's own, and training resumes
from the latest such one (a plan whose ``train.steps`` grew trains only the new steps).
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OverbrainerError, RunFailed, RunStopped
from ..folder import CHECKPOINTS, LOG, METRICS, RunFolder
from ..portable.common import oom_kills, read_json_lines, signal_name
from ..stamps import fingerprint, outputs_digest
from ..trainers import checkpoint as ckpt
from ..trainers.samples import read_samples
from . import NotReady, Outputs, upstream

if TYPE_CHECKING:
    from .context import Bake

NAME = "train"
VERSION = 1
# config.yaml keys that say how the steps are computed, not what they compute: a run
# resumes across a change of them (a checkpoint made on the GPU goes on on the CPU, an
# out-of-memory run goes on with gradient checkpointing), and a finished one stays done.
# The math is the same; the bits are the same only on the same device and build.
# (dataset_prepared_path is where Axolotl caches its tokenized data: keyed by all of the
# config, it changes with these too, and names no part of the run)
HOW_IT_COMPUTES = ("device", "deterministic", "torch_compile", "gradient_checkpointing", "liger", "liger_rope",
                   "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy",
                   "dataset_prepared_path")
# config.yaml keys that say what is looked at while it trains, not what it trains: greedy
# samples (taken with the RNG state put back) change no weight; a finished run stays done
WATCHING = ("samples", "profile")
# the same, as the plan's train settings name them (the bake step's model card leaves them out)
HOW_IT_COMPUTES_SETTINGS = ("device", "deterministic", "compile", "gradient_checkpointing", "liger", "samples",
                            "profile")

TARGETS = [f"{CHECKPOINTS}/", METRICS, LOG]
# config.yaml keys that say where a run ends and where its decay begins, not how its weights
# get there before that: they are left out of the trajectory
WHERE_IT_ENDS = ("max_steps", "save_at")
WHERE_DECAY_BEGINS = ("num_stable_steps", "num_decay_steps")
TRAJECTORY_ENV = "OVERBRAINER_TRAJECTORY"


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
    cfg = {k: v for k, v in cfg.items() if k not in HOW_IT_COMPUTES + WATCHING}
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
    # a checkpoint whose sidecar does not read cannot be sorted out by fingerprint
    ckpt.set_aside_unreadable(folder.checkpoints, say=lambda m: bake.say(f"warning: {m}; training goes on from the checkpoint before it"))
    kept = set_aside_other_runs(folder.root, folder.checkpoints, fp, inputs)
    if kept:
        bake.say(f"train: resumes from {kept.name} (the stable phase is unchanged)")
    max_steps = inputs["config"]["max_steps"]
    kills = oom_kills() if bake.plan.where == "here" else None  # the kernel's OOM kills, before
    code = launch(bake, fp, max_steps, trajectory(inputs))
    if code != 0:
        said = folder.trainer_error
        if said.exists():  # the trainer said why, in one line
            raise RunFailed(f"training failed: {said.read_text().strip()}", log_tail="")
        killed = killed_line(code, folder, max_steps, inputs["config"], kills, bake.plan.train.device,
                             bake.plan.train.processes)
        if killed:
            raise RunFailed(f"training failed: {killed}", log_tail="")
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


def trajectory(inputs: dict) -> str:
    """The fingerprint of what shapes the weights up to the decay: the train step's inputs
    but where the run ends and where its decay begins."""
    cfg = {k: v for k, v in inputs["config"].items() if k not in WHERE_IT_ENDS}
    cfg["lr_scheduler_kwargs"] = {k: v for k, v in cfg["lr_scheduler_kwargs"].items() if k not in WHERE_DECAY_BEGINS}
    # (a branch's inputs name the trunk checkpoint it decays from: a cache of its first steps)
    rest = {k: v for k, v in inputs.items() if k != "branch"}
    return fingerprint("trajectory", 1, {**rest, "config": cfg})


def decay_start(cfg: dict) -> int:
    """The step (count of optimizer steps done) at which config `cfg`'s decay begins."""
    return cfg["warmup_steps"] + cfg["lr_scheduler_kwargs"]["num_stable_steps"]


def shares_trajectory(meta: dict, step: int, traj: str, start: int) -> bool:
    """Whether the checkpoint (`meta`, at `step`) is a point of trajectory `traj` before the
    decay of both its own run and one whose decay starts at `start`."""
    return meta.get("trajectory") == traj and step <= min(meta.get("decay_start", -1), start)


def sorted_out(checkpoints: Path, fp: str, inputs: dict) -> tuple[list[Path], list[Path], Path | None]:
    """The complete checkpoints this run goes on from (its own fingerprint's, or another's
    of the same trajectory before both decays), those it does not, and the newest reused
    checkpoint of another fingerprint that it resumes from (None: none, or one of its own
    is newer). Reads meta.json files only."""
    traj, start = trajectory(inputs), decay_start(inputs["config"])
    keep, aside, reused = [], [], None
    for step, path in ckpt.complete(checkpoints):
        try:
            meta = ckpt.read_meta(path)
        except (OSError, ValueError):
            aside.append(path)
            continue
        if meta.get("fingerprint") == fp:
            keep.append(path)
            reused = None
        elif shares_trajectory(meta, step, traj, start):
            keep.append(path)
            reused = path
        else:
            aside.append(path)
    # a checkpoint a branch decays from (train.budgets' save_at) that is not there, before
    # kept ones: training goes on from before it, so that it is made (the later ones aside)
    have = {int(p.name.split("-")[-1]) for p in keep}
    missing = [s for s in inputs["config"].get("save_at") or () if s not in have and any(h > s for h in have)]
    if missing:
        later = [p for p in keep if int(p.name.split("-")[-1]) > min(missing)]
        keep = [p for p in keep if p not in later]
        aside = sorted(aside + later, key=lambda p: int(p.name.split("-")[-1]))
        reused = next((p for p in reversed(keep) if p not in later), None) if reused in later else reused
    return keep, aside, reused


def reuse_note(bake: Bake, inputs: dict, fp: str) -> str | None:
    """What `why` and ``--dry-run`` add for a train step that would run: the checkpoint of
    another length it resumes from."""
    _, _, reused = sorted_out(bake.folder.checkpoints, fp, inputs)
    return f"resumes from {reused.name} (the stable phase is unchanged)" if reused else None


def foresee(bake: Bake) -> str | None:
    """`reuse_note` for a train step that waits for the config step to rerun (``--dry-run``,
    `why`): the config that step would write, foreseen from the plan and the config it wrote
    last (its chat template, special tokens and micro-batch kept), and the checkpoints that
    config would resume from. Only on the path where config reruns (it validates the plan)."""
    from . import NotReady
    from .config import build_config, schedule_steps

    try:
        config, split = upstream(bake, "config"), upstream(bake, "split")
        now = inputs(bake)
    except NotReady:
        return None
    old = config.summary.get("config")
    if old is None:
        return None
    bake.validate()
    train = bake.plan.train.model_copy(update={"micro_batch_size": old["micro_batch_size"],
                                               "gradient_accumulation_steps": old["gradient_accumulation_steps"]})
    cfg = build_config(train, old["base_model"], schedule_steps(train, split.summary["train"]),
                       old.get("special_tokens", {}), bake.plan.trust_remote_code, old.get("chat_template_jinja"))
    cfg = {k: v for k, v in cfg.items() if k not in HOW_IT_COMPUTES + WATCHING}
    foreseen = {**now, "config": {**cfg, "base_model": now["config"]["base_model"]}}
    return reuse_note(bake, foreseen, fingerprint(NAME, VERSION, foreseen))


def set_aside_other_runs(run_dir: Path, checkpoints: Path, fp: str, inputs: dict) -> Path | None:
    """Move checkpoints (and their metrics) of another fingerprint to attic/, but those of
    the same trajectory before both decays (`sorted_out`); the newest of those that the
    trainer resumes from, if any. Metrics are copied, not moved, when checkpoints stay:
    the trainer cuts them back to the step it resumes from."""
    keep, aside, reused = sorted_out(checkpoints, fp, inputs)
    if not aside:
        return reused
    old = ckpt.read_meta(aside[-1]).get("fingerprint") or "unknown"
    when = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    dest = RunFolder(run_dir).attic / f"{when}-{old[:8]}"
    dest.mkdir(parents=True, exist_ok=True)
    metrics = RunFolder(run_dir).metrics
    if not keep:
        shutil.move(str(checkpoints), str(dest / CHECKPOINTS))
        if metrics.exists():
            shutil.move(str(metrics), str(dest / METRICS))
        return reused
    (dest / CHECKPOINTS).mkdir()
    for path in aside:
        shutil.move(str(path), str(dest / CHECKPOINTS / path.name))
    if metrics.exists():
        shutil.copy2(metrics, dest / METRICS)
    return reused


def killed_line(code: int, folder: RunFolder, max_steps: int, cfg: dict, kills: int | None,
                device: str = "auto", processes: int = 1) -> str | None:
    """Why the trainer died, in one line, when a signal ended it (this bake did not: a stop
    is asked through the stop file): the step it had reached, the checkpoint kept, and for
    SIGKILL while the kernel's out-of-memory killer struck (its count rose: `kills` is the
    count before; the count is the machine's, hence "most likely"), what needs the host's
    memory on `device` and how to need less. None for a trainer that exited on its own."""
    name = signal_name(code)
    if name is None and code == 1 and "Signal 9 (SIGKILL) received by PID" in tail(folder.log, 40):
        name = "SIGKILL"  # a worker under torchrun, which exits 1 and says which signal
    if name is None:
        return None
    lines = read_json_lines(folder.metrics)
    step = max((line["step"] for line in lines if isinstance(line.get("step"), int)), default=0)
    done = ckpt.complete(folder.checkpoints)
    kept = f"{done[-1][1].name} is intact, and the same bake resumes from it" if done else (
        "no checkpoint was made yet: the same bake starts again")
    after = f"after step {step} of {max_steps}" if step else "before its first step"
    now = oom_kills() if kills is not None else None
    if name == "SIGKILL" and now is not None and now > kills:
        import psutil

        from ..inputs.sizing import device_memory

        device = device_memory(device)[0]  # the plan's train.device, "auto" resolved as sizing does
        ram = psutil.virtual_memory().total / 2**30
        return (f"the trainer was killed (SIGKILL) {after}, most likely by the kernel's out-of-memory killer (it "
                f"ended a process meanwhile; this machine has {ram:.1f} GiB of memory, shared with other programs, "
                f"and a container's limit may be lower); {kept}; to need less, "
                + host_memory_fix(cfg, step, device, processes))
    return f"the trainer was killed by {name} {after}, not by this bake; {kept}"


def host_memory_fix(cfg: dict, step: int, device: str, processes: int) -> str:
    """What to change when the trainer ran out of this machine's memory: before its first
    step, loading the model (every process loads it whole); later, on the CPU, the
    activations of a micro-batch (on a GPU they are the GPU's, not the host's)."""
    ways = []
    if processes > 1:
        ways.append(f"fewer train.processes ({processes} each hold the model in this machine's memory)")
    if step and device == "cpu":
        if not cfg.get("gradient_checkpointing"):
            ways.append("set train.gradient_checkpointing (the run resumes)")
        ways.append("lower train.micro_batch_size (raising gradient_accumulation_steps) or train.sequence_len "
                    "(a new run)")
    if device == "cpu" and not cfg.get("adapter"):  # a full fine-tune's gradients and AdamW state, here
        ways.append('train.adapter "lora" (no gradients nor optimizer state for the base)')
    ways.append("a smaller base, or a machine with more memory")
    return ", or ".join(ways)


def launch(bake: Bake, fp: str, max_steps: int, traj: str = "") -> int:
    """Run the trainer's job where the plan says, following its metrics as they come."""
    from ..trainers import NoTrainingData, get_trainer
    from ..where import target_for
    from ..where.bundle import Base

    folder = bake.folder
    train = bake.plan.train
    own = dict(nodes=train.nodes, rendezvous=train.rendezvous, run_id=bake.plan.name,
               deterministic=train.deterministic, device=train.device) if train.trainer == "builtin" else {}
    trainer = get_trainer(train.trainer, processes=train.processes, **own)
    follower = Follower(bake, max_steps, fp)
    # where the plan says: here, an exported bundle, or another machine over ssh
    base = Base.from_stamp(upstream(bake, "base"))
    target = target_for(bake.plan.where, base, bake.hashes, bake.plan_dir, say=bake.say, shown=bake.shown,
                        tell=bake.tell, processes=bake.plan.train.processes)
    bake.tell(state="running", steps=max_steps, where=target.where)
    code = None
    try:
        code = target.run(trainer, folder.root, {"OVERBRAINER_FINGERPRINT": fp, TRAJECTORY_ENV: traj}, folder.log,
                          follower.poll)
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
                self.mirror.lines(_read_lines(folder.metrics, 0)[0], read_samples(folder.samples))

    def poll(self) -> None:
        trunk_stop = getattr(self.bake.folder, "trunk_stop", None)
        if trunk_stop is not None and trunk_stop.exists():  # a branch's trainer: a stop asked of the run
            self.bake.folder.stop_request.touch()
        lines, self.seen = _read_lines(self.bake.folder.metrics, self.seen)
        for m in lines:
            _show(self.bake, m, self.max_steps)
        if self.mirror:
            # read after the metrics: the trainer writes a step's samples before its line
            samples = read_samples(self.bake.folder.samples) if self.bake.folder.samples.exists() else []
            if lines or samples:
                self.mirror.lines(lines, samples)
        done = ckpt.complete(self.bake.folder.checkpoints)
        new = [p for _, p in done if p.name not in self.checkpoints]
        if new:
            self.checkpoints.update(p.name for p in new)
            try:
                draw_loss(self.bake.folder)
            except OSError as e:  # a picture: a full disk must not end the run the trainer saves
                self.bake.say(f"warning: loss.png not drawn ({e.strerror or e}); training goes on")
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
        raw = metrics.read_bytes().decode("utf-8", errors="replace").splitlines()  # a damaged byte spoils its line only
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
        return len(path.read_bytes().splitlines())
    except OSError:
        return 0


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
