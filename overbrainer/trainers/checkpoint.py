"""Checkpoints: what is saved at a step, and how it is written so it is never half there.

``checkpoints/step-NNNNNN/`` holds, after N optimizer steps::

    adapter_model.safetensors   the LoRA weights (PEFT's layout: loadable with
    adapter_config.json         PeftModel.from_pretrained on the base model)
    model.safetensors           instead of the two above, for a full fine-tune
    config.json                 (full fine-tune only) the model's config
    trainer_state.pt            optimizer, scheduler and every RNG state: exact resume.
                                Under train.shard the optimizer state is gathered whole
                                and keyed by parameter name (torch.distributed.checkpoint's
                                full state dict), so it fits any world size
    rng-rankN.pt                (several processes) each rank's RNG state
                                Tensors, numbers and strings only: read with
                                torch.load(weights_only=True)
    meta.json                   the readable sidecar: step, steps, phase, decayed, loss,
                                eval_loss, tokens, seconds, data position, fingerprint

It is written into ``checkpoints/.tmp-step-NNNNNN/``, every file fsynced, then renamed
into place: a folder named ``step-*`` with a ``meta.json`` is complete. Temp folders left by
a killed process are removed when training starts again, never read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..folder import META
from ..fsio import fsync_dir, fsync_tree
from ..hashing import hash_file
from ..portable import faults

STATE = "trainer_state.pt"


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:06d}"


def complete(checkpoints: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first: ``step-NNNNNN`` (the built-in trainer's) and
    ``checkpoint-N`` (the Axolotl trainer's, Hugging Face Trainer's layout, whose plugin
    writes the same meta.json last), each with its meta.json."""
    out = []
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            prefix = next((x for x in ("step-", "checkpoint-") if p.name.startswith(x)), None)
            if prefix and p.is_dir() and (p / META).is_file():
                try:
                    out.append((int(p.name[len(prefix):]), p))
                except ValueError:
                    continue
    return sorted(out)


def intact(folder: Path) -> bool:
    """Whether every file the sidecar names is there with its hash (older checkpoints
    without hashes are taken as they are)."""
    try:
        files = read_meta(folder).get("files")
    except (OSError, ValueError):
        return False
    if files is None:
        return True
    return all((folder / name).is_file() and hash_file(folder / name) == digest for name, digest in files.items())


def latest_intact(checkpoints: Path, say=print) -> tuple[int, Path] | None:
    """The newest checkpoint that is whole: every file with its hash, and its state files
    readable as plain tensors (`unloadable`). A damaged one is moved to ``corrupt-step-N``
    beside it (kept, never used) and the one before it is taken."""
    for step, folder in reversed(complete(checkpoints)):
        why = "a file is missing or changed" if not intact(folder) else unloadable(folder)
        if why is None:
            return step, folder
        set_aside(folder, why, say)
    return None


def set_aside_unreadable(checkpoints: Path, say=print) -> None:
    """Move each checkpoint whose meta.json does not read (torn, garbled) to
    ``corrupt-step-N``: without its sidecar nothing of it can be checked or resumed."""
    for _, folder in complete(checkpoints):
        try:
            read_meta(folder)
        except DamagedMeta as e:
            set_aside(folder, f"its meta.json is {e.why}", say)


def set_aside(folder: Path, why: str, say) -> None:
    aside = folder.with_name(f"corrupt-{folder.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    say(f"{folder.name} is damaged ({why}): set aside as {aside.name}")


def unloadable(folder: Path) -> str | None:
    """Why the checkpoint's state files do not load with ``torch.load(weights_only=True)``
    (something in them is not tensors, numbers or strings, or they are torn), or None. A
    hash that matches does not make a pickle safe: it may have been written to match."""
    import pickle

    import torch

    for path in [folder / STATE, *sorted(folder.glob("rng-rank*.pt"))]:
        if not path.is_file():
            continue  # a layout without it (the Axolotl trainer's)
        try:
            torch.load(path, weights_only=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
                ImportError, KeyError, IndexError, OSError):
            return f"{path.name} holds something else than tensors, numbers and strings"
    return None


class DamagedMeta(ValueError):
    """A checkpoint's meta.json that does not read as a JSON object: its path and why."""

    def __init__(self, path: Path, why: str):
        self.path, self.why = path, why
        super().__init__(f"{path} is damaged: {why}")


def read_meta(folder: Path) -> dict:
    """The checkpoint's sidecar; `DamagedMeta`, naming the file, when it is torn, garbled
    or not an object (never JSON's own words alone)."""
    path = folder / META
    try:
        meta = json.loads(path.read_bytes())
    except ValueError:  # JSON's errors and a bad UTF-8 byte alike
        raise DamagedMeta(path, "not JSON: cut short or garbled") from None
    if not isinstance(meta, dict):
        raise DamagedMeta(path, f"a JSON {type(meta).__name__}, not an object")
    return meta


def remove_partial(checkpoints: Path) -> None:
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        # this process's GPU only: asking for every GPU's state would open a CUDA context
        # on each (under torchrun, every rank on every GPU), and a CPU run none at all
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_initialized():  # training on the CPU: its GPU's generator is not used
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])  # the current device: the trainer set it
    elif "cuda" in state:  # checkpoints before: every GPU's
        torch.cuda.set_rng_state_all(state["cuda"])


def save(checkpoints: Path, step: int, model, optimizer, scheduler, meta: dict,
         weights: dict | None = None, optimizer_state: dict | None = None) -> Path:
    """Write checkpoint `step` atomically. `model` is the PEFT model (LoRA) or the model;
    `weights` and `optimizer_state`, when given, are what is saved of them (a sharded
    model's, gathered: its own parameters are slices)."""
    import torch

    final = step_dir(checkpoints, step)
    tmp = tmp_dir(checkpoints, step)
    tmp.mkdir(parents=True, exist_ok=True)  # other ranks may have put their RNG in
    # PEFT writes the adapter alone; a plain model writes its weights and config
    model.save_pretrained(tmp, safe_serialization=True, **({} if weights is None else {"state_dict": weights}))
    faults.point("checkpoint:between-files")
    torch.save(
        {"optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state, "scheduler": scheduler.state_dict(), "rng": rng_state()},
        tmp / STATE,
    )
    # the sidecar, last, names every file with its hash: a checkpoint altered or cut short
    # later (a disk fault, a bad copy) is found out before it is resumed from
    meta = {**meta, "files": {p.name: hash_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    fsync_tree(tmp)
    faults.point("checkpoint:before-rename")
    if final.exists():
        # only a rerun of the very same step can meet its own folder: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(checkpoints)
    return final


def tmp_dir(checkpoints: Path, step: int) -> Path:
    # one trainer per run folder (the bake's lock): the name needs no pid
    return checkpoints / f".tmp-{step_dir(checkpoints, step).name}"


def save_rank_rng(checkpoints: Path, step: int, rank: int) -> None:
    """A rank's RNG state, into the checkpoint being written (several processes)."""
    import torch

    tmp = tmp_dir(checkpoints, step)
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")


def has_rank_rng(folder: Path, rank: int) -> bool:
    return (folder / f"rng-rank{rank}.pt").is_file()


def load_rank_rng(folder: Path, rank: int) -> dict:
    import torch

    return torch.load(folder / f"rng-rank{rank}.pt", weights_only=True, map_location="cpu")


def load_state(folder: Path) -> dict:
    import torch

    return torch.load(folder / STATE, weights_only=True, map_location="cpu")
