"""Merge the final adapter into the base model: merged/, HF safetensors + tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..folder import MERGED
from ..fsio import replace_folder
from ..stamps import outputs_digest
from . import Outputs, upstream

if TYPE_CHECKING:
    from .context import Bake

NAME = "merge"
VERSION = 1
TARGETS = [f"{MERGED}/"]


def inputs(bake: Bake) -> dict:
    train, base, config = upstream(bake, "train"), upstream(bake, "base"), upstream(bake, "config")
    last = train.summary["checkpoint"]
    return {
        "checkpoint": outputs_digest(train, f"checkpoints/{last}"),
        "checkpoint_name": last,
        "base": outputs_digest(base),
        "base_folder": base.summary["folder"],
        "config": outputs_digest(config),
        "adapter": bake.plan.train.adapter,
    }


def run(bake: Bake, inputs: dict) -> Outputs:
    import yaml

    from ..trainers.examples import tokenizer_settings  # torch: only when there is work

    cfg = yaml.safe_load(bake.folder.config.read_text())
    checkpoint = bake.folder.checkpoints / inputs["checkpoint_name"]
    if bake.plan.train.trainer == "axolotl" and inputs["adapter"] == "lora":
        from ..trainers.axolotl import adopt_merged

        # the job's merge-lora made it from this checkpoint: adopted, not merged again
        if adopt_merged(bake.folder.root, checkpoint, bake.folder.merged, tokenizer_settings(cfg)):
            bake.say(f"merge: {bake.shown(checkpoint)} merged by Axolotl's merge-lora")
            return Outputs([MERGED])
    bake.say(f"merge: {bake.shown(checkpoint)} into the base model")
    merge_into(
        Path(inputs["base_folder"]), checkpoint, bake.folder.merged, tokenizer_settings(cfg),
        lora=inputs["adapter"] in ("lora", "qlora"), trust_remote_code=bool(cfg.get("trust_remote_code")),
        dtype="bfloat16" if inputs["adapter"] == "qlora" else "float32", device=bake.plan.train.device,
    )
    return Outputs([MERGED])


def merge_into(base_folder: Path, checkpoint: Path, dest: Path, special_tokens: dict, lora: bool,
               trust_remote_code: bool = False, dtype: str = "float32", device: str = "cpu") -> None:
    """Write base + adapter (or a full checkpoint) as one HF model folder at `dest`,
    through a temp folder renamed into place.

    A QLoRA adapter goes onto the base as it was before quantization, read in 16 bits
    (`dtype` "bfloat16"), as peft merges one: the merged weights are the original ones
    plus the adapter, not the NF4-rounded ones it was trained against. The merge runs on
    the training's `device` (train.device; "auto": a CUDA GPU when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from ..inputs.base_cache import quiet_transformers

    quiet_transformers()
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora:
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code)
        if device != "cpu" and torch.cuda.is_available():
            model.to("cuda" if device in ("auto", "cuda") else device)
        model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload().to("cpu")
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(base_folder, trust_remote_code=trust_remote_code)
    for key, value in special_tokens.items():
        setattr(tokenizer, key, value)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    replace_folder(tmp, dest, fault="merge:before-rename")
