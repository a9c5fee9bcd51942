"""The built-in trainer: one training loop, run as its own process.

    python -m overbrainer.trainers.builtin RUN_DIR/config.yaml

Everything it needs is in ``config.yaml`` (Axolotl's keys) and ``examples.parquet``; its
output goes to ``metrics.jsonl``, ``checkpoints/`` and stdout (the caller's ``log.txt``).
Run again after any interruption, it continues from the newest complete checkpoint and
ends with the same weights, bit for bit, as a run that never stopped (on CPU).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import yaml

from ...folder import TRAINER_ERROR, RunFolder
from ...portable import faults
from ...portable.common import die_with_parent, phase_of, truncate_metrics
from .. import checkpoint as ckpt
from ..dist import World
from ..examples import Example, Order, collate, load_examples, micro_batches
from ..samples import answer, is_sample_step, prompt_text
from . import allocator, cpu_attention
from . import device as hw
from .model import (
    Decoder,
    TokenLoss,
    decoder_layers,
    eager,
    load_model,
    load_weights,
    logit_transform,
    transformers_model,
)
from .profile import Profile

STOP_EXIT = 0  # a stop on request is a success: the stopped marker says it was not the end
OOM_EXIT = 5


ERROR_FILE = TRAINER_ERROR


class DiskFull(Exception):
    pass


class GiveUp(Exception):
    """The trainer cannot go on, for a reason it says in one line (its exit code beside)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def fail(run_dir: Path, message: str, code: int) -> int:
    print(message, flush=True)
    (run_dir / ERROR_FILE).write_text(message + "\n")
    return code


@dataclass
class Training:
    """What `setup` builds, the loop advances and `save` writes: one run's state."""

    cfg: dict
    run_dir: Path
    world: World
    device: torch.device
    bf16: bool
    model: torch.nn.Module  # the PEFT model (LoRA) or the model: what checkpoints hold
    decoder: torch.nn.Module  # what the loop calls: `Decoder(model)`, under DDP or FSDP2 with several processes
    loss: TokenLoss
    train_set: list[Example]
    val_set: list[Example]
    order: Order
    pad_id: int
    pad_multiple: int  # a micro-batch's length is rounded up to a multiple of it (train.pad_to_multiple_of)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    tokenizer: object = None
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    last: dict = field(default_factory=lambda: {"loss": None, "eval_loss": None})
    saved_step: int | None = None

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / self.cfg["output_dir"]

    def batch(self, micro: list[Example]) -> dict[str, torch.Tensor]:
        """A micro-batch's tensors on the training device."""
        return hw.to_device(collate(micro, self.pad_id, self.pad_multiple, self.cfg["sequence_len"]), self.device)

    def say(self, message: str) -> None:
        if self.world.main:
            print(message, flush=True)


# -- setup -------------------------------------------------------------------------------


def setup(cfg: dict, run_dir: Path, device: str = "auto", deterministic: bool = False) -> Training:
    """The model on its device, the data, the optimizer and the schedule; then the newest
    complete checkpoint's state, when there is one."""
    # shard alone (the plan refuses it: nothing to share) still runs FSDP2, in a world of one
    world = World(shard=bool(cfg.get("shard")))
    try:
        device = hw.pick(device, world.local_rank)
    except hw.Unavailable as e:
        raise GiveUp(str(e), 2) from None
    hw.configure(device, deterministic, cfg.get("tf32") in (True, "auto"))
    world.connect(device)
    torch.manual_seed(cfg["seed"])  # the same initial adapter on every rank
    # every rank computes as rank 0 does: "auto" reads the machine, and nodes may differ
    bf16 = world.agree(hw.use_bf16(cfg.get("bf16", False), device))
    if cfg.get("torch_compile") == "auto":
        # train.compile "auto": where it was measured to pay off; a layer the compiler fails
        # on then runs as it is (with dynamo's warning) rather than ending the run
        cfg["torch_compile"] = world.agree(hw.use_compile(device, cfg, bf16, world.size, deterministic))
        if cfg["torch_compile"]:
            import torch._dynamo as dynamo

            dynamo.config.suppress_errors = True
    if cfg.get("liger", "auto") == "auto" and not any(cfg.get(k) for k in hw.LIGER_KEYS):
        # train.liger "auto" (config.yaml names no Liger kernel): where they were measured to help
        cfg.update(dict.fromkeys(hw.LIGER_KEYS, hw.use_liger(device, cfg, world.size, deterministic)))
    found = checkpoint_to_resume(cfg, run_dir, world)
    # out of memory before the first step: the model (or its optimizer state) does not fit
    at_start = partial(memory_errors_at_start, cfg, device, saved_step=found[0] if found else None)
    # sharded, every rank builds the model in host memory and `fully_shard` moves its own
    # slice of each layer to the device: the whole model is never on one GPU
    load_on = torch.device("cpu") if world.shard else device
    with at_start(f"loading the model onto {load_on}"):
        model, tokenizer = load_model(cfg, load_on, bf16, sharded=world.shard, computes_on=device)
        if found:
            load_weights(model, found[1], cfg)  # into the whole model, before it is sharded
    if world.size > 1:
        torch.manual_seed(cfg["seed"] + 7919 * world.rank)  # but its own dropout
    # config.yaml's datasets and test_datasets, as Axolotl reads them
    held_out = cfg.get("test_datasets") or []
    train_set, val_set, dropped = load_examples(run_dir / cfg["datasets"][0]["path"], tokenizer, cfg["sequence_len"],
                                                validation=run_dir / held_out[0]["path"] if held_out else None)
    if not train_set:
        raise GiveUp("no training conversation keeps an assistant token within train.sequence_len; "
                     "raise train.sequence_len", 3)
    if dropped and world.main:
        print(f"{dropped} conversations dropped: nothing of the assistant left within sequence_len", flush=True)
    mbs, gas = cfg["micro_batch_size"], cfg["gradient_accumulation_steps"]
    if gas % world.size:  # the plan checks it; a rank without a micro-batch would hang the others
        raise GiveUp(f"config.yaml: gradient_accumulation_steps {gas} cannot be shared equally by {world.size} "
                     f"processes; make it a multiple of {world.size}", 2)
    lengths = [len(e.ids) for e in train_set] if cfg.get("group_by_length") else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    fused_loss = bool(cfg.get("liger_fused_linear_cross_entropy"))
    if fused_loss and "lm_head" in (cfg.get("lora_target_modules") or ()):
        # Liger's fused loss takes the output layer's weight alone: an adapter on it would
        # get no gradient, so the output layer and its loss stay plain (the rest is Liger's)
        cfg["liger_fused_linear_cross_entropy"] = fused_loss = False
        if world.main:
            print("lm_head carries a LoRA adapter: its loss is not fused (Liger's fused loss cannot take an "
                  "adapter)", flush=True)
    transform = logit_transform(model)
    if fused_loss and transform["scale"] != 1.0 and getattr(model.get_output_embeddings(), "bias", None) is not None:
        # a scale goes onto the hidden states of Liger's fused loss, which a bias would not follow
        cfg["liger_fused_linear_cross_entropy"] = fused_loss = False
    with at_start(f"checking the output layer on {device}"):
        same = TokenLoss(**transform).matches_the_model(model)
    if not same:
        # a family that does something of its own to the logits: its forward's, at every position
        transform["whole"] = True
        cfg["liger_fused_linear_cross_entropy"] = fused_loss = False
        if world.main:
            print(f"{model.config.model_type}: its forward does something to the logits the trainer does not know "
                  "of: the loss is taken from the model's own logits, at every position (slower)", flush=True)
    # the loss compiled with the layers, but not sharded (FSDP2's hooks gather the output layer; not tried compiled)
    loss = TokenLoss(fused=fused_loss, compiled=bool(cfg.get("torch_compile")) and not world.shard, **transform)
    with at_start(f"placing the model on {device}"):
        decoder = world.wrap(Decoder(model, loss), device, layers=decoder_layers(model), bf16=bf16)
    # after the wrap: sharded, the parameters are this rank's slices (DTensors)
    params = [p for p in model.parameters() if p.requires_grad]
    # fused AdamW (one kernel for every parameter) where torch has it for the device; on
    # the CPU the loop keeps the per-parameter one, whose bits every CPU checkpoint holds
    fused = {"fused": True} if device.type in ("cuda", "mps") else {}
    optimizer = torch.optim.AdamW(params, lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"], **fused)
    scheduler = make_schedule(optimizer, cfg["warmup_steps"], cfg["lr_scheduler_kwargs"]["num_stable_steps"],
                              cfg["lr_scheduler_kwargs"]["num_decay_steps"])
    t = Training(
        cfg=cfg, run_dir=run_dir, world=world, device=device, bf16=bf16, model=model, decoder=decoder, loss=loss,
        train_set=train_set, val_set=val_set, order=Order(len(train_set), mbs * gas, cfg["seed"], lengths),
        pad_id=pad_id, pad_multiple=hw.pad_multiple(cfg, device, bf16), params=params, optimizer=optimizer,
        scheduler=scheduler, tokenizer=tokenizer,
    )
    if found:
        with at_start(f"loading {found[1].name}'s optimizer state onto {device}"):
            resume(t, *found)
    return t


def checkpoint_to_resume(cfg: dict, run_dir: Path, world: World) -> tuple[int, Path, dict] | None:
    """The newest complete, intact checkpoint (step, folder, sidecar), if this world can
    take it up: the same number of processes, or any number for a sharded run's (its
    state is whole)."""
    checkpoints = run_dir / cfg["output_dir"]
    if world.main:
        ckpt.remove_partial(checkpoints)
        ckpt.latest_intact(checkpoints, say=lambda m: print(m, flush=True))
    world.barrier()
    done = ckpt.complete(checkpoints)
    if not done:
        return None
    step, folder = done[-1]
    meta = ckpt.read_meta(folder)
    made = meta.get("world_size", 1)
    if bool(meta.get("shard")) != world.shard:
        how = "with" if meta.get("shard") else "without"
        raise GiveUp(f"{folder.name} was made {how} train.shard: set train.shard back to "
                     f"{'true' if meta.get('shard') else 'false'} to resume it", 2)
    if made != world.size and not world.shard:
        raise GiveUp(f"{folder.name} was made by {made} processes, not {world.size}: "
                     f"set train.processes back to {made} to resume it", 2)
    return step, folder, meta


def resume(t: Training, step: int, folder: Path, meta: dict) -> None:
    """Take up a checkpoint's optimizer (its state mapped onto this run's device, whatever
    device saved it), schedule, RNG and counters; its weights are in the model already."""
    state = ckpt.load_state(folder)  # on the CPU: optimizer.load_state_dict moves it to the params
    # the saved groups carry the saving device's AdamW kernel (fused on a GPU, per parameter
    # on the CPU): this device's own instead, set before loading, since the load places each
    # step count by it (on the parameter's device for the fused kernel, which needs it there)
    for group in state["optimizer"].get("param_groups", []):
        group["fused"] = t.optimizer.defaults.get("fused")
    if t.world.shard:
        t.world.load_optimizer(t.decoder, t.optimizer, state["optimizer"])
    else:
        t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    # the next step's learning rate from this run's schedule, not the one saved: a checkpoint
    # of the stable phase may come from a run of another length (the train step's
    # trajectory), whose schedule gives its last step another rate (the same on a plain resume)
    rates = [base * rate(t.scheduler.last_epoch) for base, rate in zip(t.scheduler.base_lrs, t.scheduler.lr_lambdas)]
    for group, lr in zip(t.optimizer.param_groups, rates):
        group["lr"] = lr
    t.scheduler._last_lr = rates
    if t.world.size == 1:
        ckpt.set_rng_state(state["rng"])
    elif ckpt.has_rank_rng(folder, t.world.rank):
        ckpt.set_rng_state(ckpt.load_rank_rng(folder, t.world.rank))
    else:
        # a rank the checkpoint's (smaller) world did not have: a dropout stream of its own
        torch.manual_seed(t.cfg["seed"] + 7919 * t.world.rank + 104729 * step)
    t.step, t.saved_step = step, step
    t.tokens, t.seconds = meta["tokens"], meta["seconds"]
    t.last = {"loss": meta.get("loss"), "eval_loss": meta.get("eval_loss"), "eval_step": meta.get("eval_step")}
    moved = f", saved on {meta['device']}" if meta.get("device", str(t.device)) != str(t.device) else ""
    made = meta.get("world_size", 1)
    if made != t.world.size:
        moved += f", by {made} processes"
    print(f"resuming from {folder.name} (step {step} of {t.cfg['max_steps']}{moved})", flush=True)


def restore_metric_line(t: Training, metrics_path: Path, warmup: int, stable: int, evaluated: bool) -> None:
    """The metric line of the step resumed from, when metrics.jsonl lost it (deleted or
    damaged): rebuilt from the checkpoint (its loss, tokens, seconds, and its eval loss when
    that step `evaluated`) and the schedule (that step's learning rate), as the loop wrote
    it, so that the run's record ends at its last step."""
    index = t.step - 1
    lr = t.scheduler.base_lrs[0] * t.scheduler.lr_lambdas[0](index)
    line = {"step": t.step, "tokens": t.tokens, "loss": t.last["loss"], "lr": lr}
    if evaluated:  # the checkpoint's eval loss is an earlier step's otherwise
        line["eval_loss"] = t.last["eval_loss"]
    line.update(seconds=round(t.seconds, 3), phase=phase_of(index, warmup, stable), restored=True)
    with open(metrics_path, "a") as f:
        f.write(json.dumps(line) + "\n")
    t.say(f"warning: {metrics_path.name} had no line for step {t.step} (deleted or damaged): that line is "
          f"restored from its checkpoint; the loss curve before it is lost")


# -- one optimizer step, evaluation, checkpoints -----------------------------------------


def train_step(t: Training, batch: list[Example]) -> tuple[float, int]:
    """Forward and backward of this rank's micro-batches of one step: (the step's loss,
    its real tokens), summed over every rank.

    Each micro-batch's summed loss is divided by the step's loss tokens, so the gradient is
    that of the whole step whatever the micro-batching and however many ranks share it;
    DDP all-reduces (averaging: hence `world.scale`) after the last micro-batch only."""
    loss_tokens = sum(e.loss_tokens for e in batch)
    mine = t.world.mine(micro_batches(batch, t.cfg["micro_batch_size"]))
    step_loss = torch.zeros((), dtype=hw.sum_dtype(t.device), device=t.device)
    step_tokens = 0
    for i, micro in enumerate(mine):
        inputs = t.batch(micro)
        with t.world.accumulating(t.decoder, last=i == len(mine) - 1):
            with hw.compute(t.bf16, t.device):
                loss = t.loss(t.decoder, inputs) / loss_tokens
            (loss * t.world.scale).backward()
        step_loss += loss.detach()  # on the device: read once a step, not once a micro-batch
        step_tokens += sum(len(e.ids) for e in micro)
    return t.world.sum(step_loss.item()), int(t.world.sum(step_tokens))


@torch.no_grad()
def evaluate(t: Training) -> float | None:
    """Mean loss per assistant token over the validation set (shared by the ranks)."""
    if not t.val_set:
        return None
    decoder = getattr(t.decoder, "module", t.decoder)  # no gradients: no DDP (FSDP2 gathers: its own)
    t.model.eval()
    total = torch.zeros((), dtype=hw.sum_dtype(t.device), device=t.device)
    count = 0
    mine, counted = t.world.even(micro_batches(t.val_set, t.cfg["micro_batch_size"]))
    for micro in mine[:counted]:
        inputs = t.batch(micro)
        with hw.compute(t.bf16, t.device):
            total += t.loss(decoder, inputs)
        count += sum(e.loss_tokens for e in micro)
    for micro in mine[counted:]:  # sharded, a rank short of a micro-batch still joins the gathers
        with hw.compute(t.bf16, t.device):
            t.loss(decoder, t.batch(micro))
    t.model.train()
    return t.world.sum(total.item()) / max(t.world.sum(count), 1)


def take_samples(t: Training, path: Path) -> float:
    """Append the greedy answers of the weights as they are to samples.jsonl (rank 0; the
    others go on to the next step's all-reduce and wait there); the seconds it took.

    Sharded, every rank generates (each layer's weights are gathered by all of them), in
    step: through the FSDP2 root (`Generating`), with transformers' `synced_gpus`, so that
    a rank done early keeps joining the gathers of the others' forwards; rank 0 writes.

    The RNG state is put back afterwards, so a run that samples trains the same weights as
    one that does not, and a resume takes the same samples again."""
    if not (t.world.main or t.world.shard):
        return 0.0
    settings, began = t.cfg["samples"], time.monotonic()
    model = Generating(t.decoder, t.device, synced=t.world.size > 1) if t.world.shard else t.model
    t.model.eval()
    # generation runs the layers as they are: compiled, each new length of its cache would
    # be another compilation
    with torch.random.fork_rng(devices=[t.device] if t.device.type == "cuda" else []), eager():
        with hw.compute(t.bf16, t.device):
            rows = [{"prompt": prompt_text(messages),
                     "answer": answer(model, t.tokenizer, messages, settings["max_new_tokens"])}
                    for messages in settings["prompts"]]
    t.model.train()
    if t.world.main:
        with open(path, "a") as f:
            f.write(json.dumps({"step": t.step, "samples": rows}) + "\n")
    return time.monotonic() - began


@dataclass
class Generating:
    """A sharded model as `samples.complete` calls it: `generate` through the FSDP2 root's
    forward (`Decoder.forward`), whose hooks gather the weights outside the layers."""

    decoder: torch.nn.Module
    device: torch.device
    synced: bool

    def generate(self, **kwargs):
        return self.decoder(generate={**kwargs, "synced_gpus": self.synced})


def save(t: Training, k: int) -> None:
    """Checkpoint step `k`: every rank's RNG goes in, then rank 0 writes the rest and
    renames the folder into place (checkpoint.py: never half there). Sharded, the
    weights and optimizer state are gathered to rank 0 first (every rank takes part)."""
    weights = optimizer_state = None
    if t.world.shard:
        weights, optimizer_state = t.world.full_state(t.decoder, t.optimizer, trainable_only=bool(t.cfg.get("adapter")))
        weights = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}  # Decoder's own prefix
    if t.world.size > 1:
        t.world.barrier()
        ckpt.save_rank_rng(t.checkpoints, k, t.world.rank)
        t.world.barrier()
        if not t.world.main:
            t.world.barrier()
            t.saved_step = k
            return
    cfg = t.cfg
    warmup, stable = cfg["warmup_steps"], cfg["lr_scheduler_kwargs"]["num_stable_steps"]
    phase = phase_of(k - 1, warmup, stable) if k else "warmup"
    meta = {
        "step": k,
        "steps": cfg["max_steps"],
        "phase": phase,
        # a checkpoint before the decay is not annealed: compare such ones with each
        # other, not with the final model
        # (a trunk of train.budgets ends without a decay: its last checkpoint is stable)
        "decayed": phase == "decay" or (k == cfg["max_steps"] and cfg["lr_scheduler_kwargs"]["num_decay_steps"] > 0),
        "loss": t.last["loss"],
        "eval_loss": t.last["eval_loss"],
        "eval_step": t.last.get("eval_step"),  # the step that eval loss is from
        "lr": t.scheduler.get_last_lr()[0],
        "tokens": t.tokens,
        "seconds": round(t.seconds, 3),
        "data": t.order.position(k),
        "fingerprint": os.environ.get("OVERBRAINER_FINGERPRINT", ""),
        # what shaped the weights so far, and where this run's decay begins: a run of
        # another length resumes from this checkpoint when it is before both decays
        "trajectory": os.environ.get("OVERBRAINER_TRAJECTORY", ""),
        "decay_start": warmup + stable,
        "adapter": cfg.get("adapter") or "full",
        "base_model": cfg["base_model"],
        "world_size": t.world.size,
        "shard": t.world.shard,
        "device": str(t.device),
        "bf16": t.bf16,
        "liger": bool(cfg.get("liger_fused_linear_cross_entropy")),
        "compile": bool(cfg.get("torch_compile")),
        "pad_to_multiple_of": t.pad_multiple,
        "peak_memory": hw.peak_memory(t.device),
    }
    try:
        ckpt.save(t.checkpoints, k, t.model, t.optimizer, t.scheduler, meta, weights, optimizer_state)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        shutil.rmtree(ckpt.tmp_dir(t.checkpoints, k), ignore_errors=True)
        previous = f"step-{t.saved_step:06d} is intact" if t.saved_step else "no earlier checkpoint"
        raise DiskFull(f"no space left on the device while saving checkpoint step-{k:06d} in {t.checkpoints} "
                       f"({previous}); free some space and bake again to resume") from None
    t.saved_step = k
    t.world.barrier()


def out_of_memory(t: Training, step: int | None = None, doing: str = "", host: bool = False) -> GiveUp:
    """Out of memory in the loop, as one line: the step (and what it was `doing` besides
    training: evaluating, sampling, saving), the peak, what to lower."""
    step = t.step + 1 if step is None else step
    where = f"{doing} at step {step}" if doing else f"at step {step}"
    fix = "lower train.micro_batch_size (raising gradient_accumulation_steps) or train.sequence_len (a new run)"
    if not t.cfg.get("gradient_checkpointing"):
        fix = "set train.gradient_checkpointing and bake again to resume, or " + fix
    return memory_error(t.device, f"{where} of {t.cfg['max_steps']}", t.saved_step, fix, host)


def memory_error(device: torch.device, where: str, saved_step: int | None, fix: str, host: bool) -> GiveUp:
    """"out of GPU memory <where> (peak, size, device; the checkpoint kept); <fix>": exit 5;
    "out of memory" for the `host`'s (the CPU allocator's), with the host's figures."""
    if host:
        device = torch.device("cpu")
    peak = hw.peak_memory(device) / 2**30
    size = hw.memory_size(device)
    of = f" of {size / 2**30:.1f} GiB" if size else ""
    kept = f"step-{saved_step:06d} is intact" if saved_step else "no checkpoint yet"
    what = "memory" if host else "GPU memory"
    return GiveUp(f"out of {what} {where} (peak {peak:.1f} GiB{of} on {device}; {kept}); {fix}", OOM_EXIT)


def too_big_to_load(cfg: dict, device: torch.device) -> str:
    """What to change when the model itself (or its optimizer state) does not fit on
    `device` (the CPU's for host memory: there every process holds the whole model, and
    sharding does not help)."""
    ways = []
    if device.type == "cuda" and cfg.get("adapter") != "qlora":
        ways.append('train.adapter "qlora" (the base in 4 bits)')
    if not cfg.get("adapter"):  # a full fine-tune
        ways.append('train.adapter "lora" (no gradients nor optimizer state for the base)')
        if device.type == "cuda" and not cfg.get("shard"):
            ways.append("train.shard with train.processes >= 2 (FSDP2: a slice of the model on each GPU)")
    ways.append("a smaller base, or a " + ("machine" if device.type == "cpu" else "device") + " with more memory")
    return "the model does not fit: " + ", or ".join(ways)


@contextmanager
def memory_errors_at_start(cfg: dict, device: torch.device, doing: str, saved_step: int | None = None):
    """Out of memory before the first step (loading the model, its checkpoint, the
    optimizer state), as one line (exit 5): the model is too big for the device, however
    small the batches."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if hw.is_out_of_memory(e):
            host = hw.is_host_memory(e)
            fix = too_big_to_load(cfg, torch.device("cpu") if host else device)
            raise memory_error(device, doing, saved_step, fix, host) from None
        raise


@contextmanager
def memory_errors_told(t: Training, step: int | None = None, doing: str = ""):
    """Around everything the loop does on the device (a step's forward and backward, the
    optimizer's first step, which allocates its moments, evaluation, samples, the gathers of
    a sharded save): an out-of-memory error ends the run in one line (`out_of_memory`); the
    checkpoints on disk are whole (each is renamed into place only when written)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if hw.is_out_of_memory(e):
            raise out_of_memory(t, step, doing, hw.is_host_memory(e)) from None
        raise


# -- the loop ----------------------------------------------------------------------------


def train(config_path: Path, device: str = "auto", deterministic: bool = False) -> int:
    cfg = yaml.safe_load(config_path.read_text())
    run_dir = config_path.parent
    folder = RunFolder(run_dir)
    metrics_path = folder.metrics
    stop_request, stopped_marker = folder.stop_request, folder.stopped_marker
    t = setup(cfg, run_dir, device, deterministic)
    world, max_steps = t.world, cfg["max_steps"]
    # no eval_steps: no validation rows (config.yaml has no test_datasets then)
    save_every, eval_every = cfg["save_steps"], cfg.get("eval_steps") or max_steps
    save_at = set(cfg.get("save_at") or ())  # where budgets branch off (train.budgets)
    warmup, stable = cfg["warmup_steps"], cfg["lr_scheduler_kwargs"]["num_stable_steps"]
    samples = cfg.get("samples")
    if world.main:
        if t.step and truncate_metrics(metrics_path, t.step) != t.step:
            # the checkpoint says which step its eval loss is from (older ones do not: then
            # this run's rule, which a checkpoint of a run of another length may not follow)
            made = t.last.get("eval_step")
            evaluated = made == t.step if made is not None else t.step % eval_every == 0 or t.step == max_steps
            restore_metric_line(t, metrics_path, warmup, stable, evaluated)
        # the samples past the checkpoint are taken again (from scratch: step 0's too)
        truncate_metrics(folder.samples, t.step if t.step else -1)
        stopped_marker.unlink(missing_ok=True)
    t.say(
        f"training {sum(p.numel() for p in t.params):,} parameters on {len(t.train_set)} conversations "
        f"({len(t.val_set)} for validation), {max_steps} steps of {cfg['micro_batch_size']}x"
        f"{cfg['gradient_accumulation_steps']} on {t.device}"
        + (", computing in bf16" if t.bf16 else "")
        + cpu_kernels_line(t)
        + (allocator.described(allocator.tcmalloc()) if t.device.type == "cpu" else "")
        + (" with Liger's kernels" if cfg.get("liger_fused_linear_cross_entropy") else "")
        + (", its decoder layers compiled (the first step waits for the compiler)" if cfg.get("torch_compile") else "")
        + (f" shared by {world.size} processes" if world.size > 1 else "")
        + (" (sharded: FSDP2)" if world.shard else "")
    )
    if t.bf16 and t.device.type == "cpu" and hw.cpu_has_bf16() is False:
        t.say("warning: train.bf16 is true, but this CPU has no bf16 instructions (AVX512-BF16, AMX): "
              "its bf16 matmuls are emulated, many times slower than float32 (25x measured on AVX2); "
              'train.bf16 "auto" or false trains in float32')

    t.model.train()
    hw.reset_peak(t.device)
    started = time.monotonic() - t.seconds
    if samples and t.step == 0:
        with memory_errors_told(t, 0, "taking samples"):
            started += take_samples(t, folder.samples)  # what the base answers, to compare with
    # train.profile: torch.profiler over its steps (a stop or an error inside them writes what was recorded)
    profile = Profile(cfg.get("profile"), folder.profile, t.device, world.rank, world.size, t.step, max_steps)
    with profile:
        while t.step < max_steps:
            # a stop asked by `overbrainer stop`: save where we are, say so, end
            if world.agree(stop_request.exists()):
                profile.finish()  # what it recorded, without the stop's own checkpoint
                if t.saved_step != t.step:
                    with memory_errors_told(t, t.step, "saving"):
                        save(t, t.step)
                if world.main:
                    stopped_marker.write_text(json.dumps({"step": t.step, "steps": max_steps}))
                t.say(f"stopped at step {t.step} on request")
                world.close()
                return STOP_EXIT

            # schedule: this step's learning rate and examples (a function of the step alone)
            started += profile.before(t.step + 1)  # starting or writing a profile is not training time
            lr = t.scheduler.get_last_lr()[0]
            phase = phase_of(t.step, warmup, stable)
            batch = [t.train_set[i] for i in t.order.step(t.step)]

            with memory_errors_told(t):
                # micro-steps: forward and backward of each micro-batch, gradients summed
                step_loss, step_tokens = train_step(t, batch)
                # clip, step, zero_grad: the update, then the gradients' memory given back
                torch.nn.utils.clip_grad_norm_(t.params, cfg["max_grad_norm"])
                t.optimizer.step()
            t.tokens += step_tokens
            t.scheduler.step()
            t.optimizer.zero_grad(set_to_none=True)
            t.step += 1
            faults.point("train:step")

            # eval, after the update: the validation loss of the weights this step made
            line = {"step": t.step, "tokens": t.tokens, "loss": round(step_loss, 6), "lr": lr}
            if t.step % eval_every == 0 or t.step == max_steps:
                with memory_errors_told(t, t.step, "evaluating"):
                    value = evaluate(t)
                line["eval_loss"] = round(value, 6) if value is not None else None
                t.last["eval_loss"], t.last["eval_step"] = line["eval_loss"], t.step
            t.seconds = time.monotonic() - started
            line.update(seconds=round(t.seconds, 3), phase=phase)
            if profile.records(t.step):
                line["profiled"] = True  # slower than the others: recorded by torch.profiler
            if t.device.type == "cuda":
                # the most GPU memory held so far (as Axolotl logs it): what sizing is held to
                line["memory"] = hw.peak_memory(t.device)
            t.last["loss"] = line["loss"]

            # samples, before the step's metrics line: the bake, which follows that file, finds a
            # step's samples there once it reads the step (their time is not training time)
            if samples and is_sample_step(t.step, samples["every"], max_steps):
                with memory_errors_told(t, t.step, "taking samples"):
                    started += take_samples(t, folder.samples)

            # log: one metrics line a step (the bake follows the file), and the console
            if world.main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(line) + "\n")
            t.say(
                f"step {t.step}/{max_steps} loss {step_loss:.4f}"
                + (f" eval {line['eval_loss']:.4f}" if line.get("eval_loss") is not None else "")
                + f" lr {lr:.3g} {t.tokens / max(t.seconds, 1e-9):.0f} tok/s"
            )

            # checkpoint, last: a kill anywhere above loses at most this step
            if t.step % save_every == 0 or t.step == max_steps or t.step in save_at:
                with memory_errors_told(t, t.step, "saving"):
                    save(t, t.step)

    world.close()
    return 0


def cpu_kernels_line(t: Training) -> str:
    """What of a bf16 step on the CPU the C++ kernels compute, for the log's first line."""
    if not (t.bf16 and t.device.type == "cpu"):
        return ""
    parts = [what for what, used in (("the attention's backward", cpu_attention.serves(t.model)),
                                     ("the loss", t.loss.on_kernel(transformers_model(t.model).get_output_embeddings()))) if used]
    return f" ({' and '.join(parts)}: C++ kernels)" if parts else ""


def make_schedule(optimizer, warmup: int, stable: int, decay: int):
    from transformers import get_wsd_schedule

    return get_wsd_schedule(
        optimizer,
        num_warmup_steps=warmup,
        num_stable_steps=stable,
        num_decay_steps=decay,
        warmup_type="linear",
        decay_type="linear",
        min_lr_ratio=0.0,
    )


def _stop_on_signal(stop_request: Path) -> None:
    """SIGTERM (and SIGINT: Ctrl-C reaches the whole foreground process group) ask for a
    stop: the loop saves a checkpoint at its next step and ends, as `overbrainer stop` does."""
    import signal

    def ask(signum, frame):
        stop_request.write_text(f"signal {signum}\n")

    signal.signal(signal.SIGTERM, ask)
    signal.signal(signal.SIGINT, ask)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m overbrainer.trainers.builtin", allow_abbrev=False,
                                     description="the built-in trainer, on a run folder's config.yaml")
    parser.add_argument("config", type=Path, help="RUN_DIR/config.yaml")
    # where it computes: the plan's train.device and train.deterministic, which are not
    # Axolotl settings and so not config.yaml's
    parser.add_argument("--device", default="auto", help="auto, cpu, mps, cuda or cuda:N (default auto)")
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels (torch)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = args.config.absolute()
    (config.parent / ERROR_FILE).unlink(missing_ok=True)
    if "LOCAL_RANK" in os.environ:
        # under torchrun: die with it (a killed bake kills torchrun, which cannot then
        # take its workers down; a parent-death signal is not inherited across fork)
        die_with_parent()
    _stop_on_signal(RunFolder(config.parent).stop_request)
    try:
        return train(config, args.device, args.deterministic)
    except DiskFull as e:
        return fail(config.parent, str(e), 4)
    except GiveUp as e:
        return fail(config.parent, str(e), e.code)


def exit_now(code: int) -> None:
    """End the process at once, its files closed and its output flushed.

    Everything is on disk by now (checkpoints and metric lines are written and renamed
    before this point). What an ordinary exit would still do is tear down the interpreter
    with torch loaded: 1 to 6 s (torch._dynamo's exit handler, module finalization) that a
    stop or the next step of the bake would wait for, for nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
