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
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from ...folder import TRAINER_ERROR, RunFolder
from ...portable import faults
from ...portable.common import die_with_parent, phase_of, truncate_metrics
from .. import checkpoint as ckpt
from ..dist import World
from ..examples import IGNORE, Order, collate, load_examples, micro_batches, tokenizer_settings

STOP_EXIT = 0  # a stop on request is a success: the stopped marker says it was not the end


ERROR_FILE = TRAINER_ERROR


class DiskFull(Exception):
    pass


def fail(run_dir: Path, message: str, code: int) -> int:
    print(message, flush=True)
    (run_dir / ERROR_FILE).write_text(message + "\n")
    return code


def train(config_path: Path) -> int:
    cfg = yaml.safe_load(config_path.read_text())
    run_dir = config_path.parent
    checkpoints = run_dir / cfg["output_dir"]
    folder = RunFolder(run_dir)
    metrics_path = folder.metrics
    stop_request, stopped_marker = folder.stop_request, folder.stopped_marker
    fingerprint = os.environ.get("OVERBRAINER_FINGERPRINT", "")

    max_steps = cfg["max_steps"]
    mbs, gas = cfg["micro_batch_size"], cfg["gradient_accumulation_steps"]
    warmup = cfg["warmup_steps"]
    stable = cfg["lr_scheduler_kwargs"]["num_stable_steps"]
    decay = cfg["lr_scheduler_kwargs"]["num_decay_steps"]
    save_every, eval_every = cfg["save_steps"], cfg["eval_steps"]

    world = World()
    torch.manual_seed(cfg["seed"])  # the same initial adapter on every rank
    bf16 = use_bf16(cfg.get("bf16", False))
    model, tokenizer = load_model(cfg, bf16)
    if world.size > 1:
        torch.manual_seed(cfg["seed"] + 7919 * world.rank)  # but its own dropout
    examples_path = run_dir / cfg["datasets"][0]["path"]
    train_set, val_set, dropped = load_examples(examples_path, tokenizer, cfg["sequence_len"])
    if not train_set:
        return fail(run_dir, "no training conversation keeps an assistant token within train.sequence_len; "
                    "raise train.sequence_len", 3)
    if dropped:
        print(f"{dropped} conversations dropped: nothing of the assistant left within sequence_len", flush=True)
    lengths = [len(e.ids) for e in train_set] if cfg.get("group_by_length") else None
    order = Order(len(train_set), mbs * gas, cfg["seed"], lengths)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"])
    scheduler = make_schedule(optimizer, warmup, stable, decay)

    step, tokens, seconds = 0, 0, 0.0
    last = {"loss": None, "eval_loss": None}
    if world.main:
        ckpt.remove_partial(checkpoints)
        ckpt.latest_intact(checkpoints, say=lambda m: print(m, flush=True))
    world.barrier()
    done = ckpt.complete(checkpoints)
    if done:
        step, folder = done[-1]
        meta = ckpt.read_meta(folder)
        load_weights(model, folder, cfg)
        state = ckpt.load_state(folder)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if meta.get("world_size", 1) != world.size:
            raise SystemExit(f"{folder.name} was made by {meta.get('world_size', 1)} processes, not {world.size}")
        ckpt.set_rng_state(state["rng"] if world.size == 1 else ckpt.load_rank_rng(folder, world.rank))
        tokens, seconds = meta["tokens"], meta["seconds"]
        last = {"loss": meta.get("loss"), "eval_loss": meta.get("eval_loss")}
        print(f"resuming from {folder.name} (step {step} of {max_steps})", flush=True)
    saved_step = step if done else None

    def save_checkpoint(k: int) -> None:
        nonlocal saved_step
        if world.size > 1:
            # every rank's RNG goes in, then rank 0 writes the rest and renames
            world.barrier()
            ckpt.save_rank_rng(checkpoints, k, world.rank)
            world.barrier()
            if not world.main:
                world.barrier()
                saved_step = k
                return
        phase = phase_of(k - 1, warmup, stable) if k else "warmup"
        meta = {
            "step": k,
            "steps": max_steps,
            "phase": phase,
            # a checkpoint before the decay is not annealed: compare such ones with each
            # other, not with the final model
            "decayed": phase == "decay" or k == max_steps,
            "loss": last["loss"],
            "eval_loss": last["eval_loss"],
            "lr": scheduler.get_last_lr()[0],
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "data": order.position(k),
            "fingerprint": fingerprint,
            "adapter": cfg.get("adapter") or "full",
            "base_model": cfg["base_model"],
            "world_size": world.size,
            "bf16": bf16,
            "peak_memory": peak_memory(),
        }
        try:
            ckpt.save(checkpoints, k, model, optimizer, scheduler, meta)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            shutil.rmtree(ckpt.tmp_dir(checkpoints, k), ignore_errors=True)
            previous = f"step-{saved_step:06d} is intact" if saved_step else "no earlier checkpoint"
            raise DiskFull(f"no space left on the device while saving checkpoint step-{k:06d} in {checkpoints} "
                           f"({previous}); free some space and bake again to resume") from None
        saved_step = k
        world.barrier()

    say = print if world.main else (lambda *a, **k: None)
    if world.main:
        truncate_metrics(metrics_path, step)
        stopped_marker.unlink(missing_ok=True)
    say(
        f"training {sum(p.numel() for p in params):,} parameters on {len(train_set)} conversations "
        f"({len(val_set)} for validation), {max_steps} steps of {mbs}x{gas}"
        + (", computing in bf16" if bf16 else "")
        + (f" shared by {world.size} processes" if world.size > 1 else ""),
        flush=True,
    )

    model.train()
    started = time.monotonic() - seconds
    while step < max_steps:
        # a stop asked by `overbrainer stop`: save where we are, say so, end
        if world.agree(stop_request.exists()):
            if saved_step != step:
                save_checkpoint(step)
            if world.main:
                stopped_marker.write_text(json.dumps({"step": step, "steps": max_steps}))
            say(f"stopped at step {step} on request", flush=True)
            world.close()
            return STOP_EXIT

        lr = scheduler.get_last_lr()[0]
        phase = phase_of(step, warmup, stable)
        batch = [train_set[i] for i in order.step(step)]
        loss_tokens = sum(e.loss_tokens for e in batch)

        # micro-steps: each micro-batch's summed loss over the step's loss tokens, so the
        # gradient is that of the whole step whatever the micro-batching
        # (with several processes, each takes its share of the micro-batches)
        step_loss, step_tokens = 0.0, 0
        for micro in world.mine(micro_batches(batch, mbs)):
            inputs = collate(micro, pad_id)
            with compute(bf16):
                loss = token_loss(model, inputs) / loss_tokens
            loss.backward()
            step_loss += loss.item()
            step_tokens += int(inputs["attention_mask"].sum())
        world.sum_grads(params)
        step_loss = world.sum(step_loss)
        tokens += int(world.sum(step_tokens))

        torch.nn.utils.clip_grad_norm_(params, cfg["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        faults.point("train:step")

        line = {"step": step, "tokens": tokens, "loss": round(step_loss, 6), "lr": lr}
        if step % eval_every == 0 or step == max_steps:
            with compute(bf16):
                line["eval_loss"] = round(evaluate(model, val_set, mbs, pad_id, world), 6) if val_set else None
            last["eval_loss"] = line["eval_loss"]
        seconds = time.monotonic() - started
        line.update(seconds=round(seconds, 3), phase=phase)
        last["loss"] = line["loss"]
        if world.main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        say(
            f"step {step}/{max_steps} loss {step_loss:.4f}"
            + (f" eval {line['eval_loss']:.4f}" if line.get("eval_loss") is not None else "")
            + f" lr {lr:.3g} {tokens / max(seconds, 1e-9):.0f} tok/s",
            flush=True,
        )

        if step % save_every == 0 or step == max_steps:
            save_checkpoint(step)

    world.close()
    return 0


# -- helpers beside the loop -------------------------------------------------------------


def token_loss(model, inputs: dict) -> torch.Tensor:
    """The summed cross-entropy over the positions that have a label.

    The output layer runs only where loss is taken: with assistant-only loss that is a
    fraction of the positions, and the vocabulary projection is the largest matmul of a
    small model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
    ).last_hidden_state
    targets = inputs["labels"][:, 1:]
    where = targets != IGNORE
    logits = base.get_output_embeddings()(hidden[:, :-1][where])
    return F.cross_entropy(logits.float(), targets[where], reduction="sum")


@torch.no_grad()
def evaluate(model, examples, mbs: int, pad_id: int, world: World) -> float:
    """Mean loss per assistant token over the validation set (shared by the ranks)."""
    model.eval()
    total, count = 0.0, 0
    for micro in world.mine(micro_batches(examples, mbs)):
        inputs = collate(micro, pad_id)
        total += token_loss(model, inputs).item()
        count += sum(e.loss_tokens for e in micro)
    model.train()
    return world.sum(total) / max(world.sum(count), 1)


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


def use_bf16(setting) -> bool:
    """Whether to compute in bfloat16: the plan's true or false, or "auto": where the
    hardware does bf16 arithmetic natively (elsewhere it would be emulated, and slower)."""
    if setting != "auto":
        return bool(setting)
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def compute(bf16: bool):
    """Where the forward pass runs: autocast to bf16 (matmuls in bf16, sums and softmax in
    float32), or plain float32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)


def load_model(cfg: dict, bf16: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    base = cfg["base_model"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    for key, value in tokenizer_settings(cfg).items():
        setattr(tokenizer, key, value)
    lora = cfg.get("adapter") == "lora"
    # a LoRA's base is frozen: in bf16 it is read as it is (no cast per step, half the
    # memory); the adapter and its optimizer stay float32, as every trained weight does
    dtype = torch.bfloat16 if bf16 and lora else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=dtype, attn_implementation="sdpa", trust_remote_code=bool(cfg.get("trust_remote_code"))
    )
    model.config.use_cache = False
    if lora:
        from peft import LoraConfig, get_peft_model

        settings = LoraConfig(
            r=cfg["lora_r"],
            lora_alpha=cfg["lora_alpha"],
            lora_dropout=cfg["lora_dropout"],
            target_modules=cfg["lora_target_modules"],
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, settings)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return model, tokenizer


def load_weights(model, folder: Path, cfg: dict) -> None:
    """Put a checkpoint's trained weights into the freshly built model, exactly."""
    if cfg.get("adapter") == "lora":
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{folder}: adapter weights do not fit the model: {unexpected[:3]}")
    else:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f))
        model.load_state_dict(state, strict=False)


def peak_memory() -> int:
    """Bytes: the most this process has held (RSS on CPU, allocated on GPU)."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stop_on_signal(stop_request: Path) -> None:
    """SIGTERM (and SIGINT: Ctrl-C reaches the whole foreground process group) ask for a
    stop: the loop saves a checkpoint at its next step and ends, as `overbrainer stop` does."""
    import signal

    def ask(signum, frame):
        stop_request.write_text(f"signal {signum}\n")

    signal.signal(signal.SIGTERM, ask)
    signal.signal(signal.SIGINT, ask)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m overbrainer.trainers.builtin RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    config = Path(argv[0]).absolute()
    (config.parent / ERROR_FILE).unlink(missing_ok=True)
    if "LOCAL_RANK" in os.environ:
        # under torchrun: die with it (a killed bake kills torchrun, which cannot then
        # take its workers down; a parent-death signal is not inherited across fork)
        die_with_parent()
    _stop_on_signal(RunFolder(config.parent).stop_request)
    try:
        return train(config)
    except DiskFull as e:
        return fail(config.parent, str(e), 4)


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
