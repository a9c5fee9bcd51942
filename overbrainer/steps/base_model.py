"""Fetch or import the base model into a local Hugging Face folder (a shared cache)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BaseModelError
from ..inputs.base_cache import materialize
from . import Outputs
from .resolve import base_pin

if TYPE_CHECKING:
    from .context import Bake

NAME = "base"
VERSION = 2
TARGETS = ["(the base model, in the shared cache)"]


def inputs(bake: Bake) -> dict:
    return {"base": base_pin(bake), "trust_remote_code": bake.plan.trust_remote_code}


def check_tensors(folder: Path, source: str, trust_remote_code: bool = False) -> None:
    """Refuse a model folder whose weights lack tensors its config calls for: loading it
    would quietly start those from random numbers. Built on the meta device: no weights
    are read, only the safetensors headers, each checked against its file (a truncated or
    damaged file is refused here, naming it, not in the trainer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..inputs.base_model import safetensors_header

    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        names.update(safetensors_header(f, source))
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise BaseModelError(f"base {source!r}: its config.json cannot build a model ({str(e).splitlines()[0]}); fix or replace it") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    expected = {k for k in model.state_dict() if k not in tied}
    missing = sorted(k for k in expected if k not in names and not any(n.endswith(k) for n in names))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise BaseModelError(
            f"base {source!r}: the weights lack {len(missing)} tensors the config calls for ({shown}); "
            "the download is incomplete: fetch the model again"
        )


def run(bake: Bake, inputs: dict) -> Outputs:
    folder = materialize(bake.base, log=bake.say)
    check_tensors(folder, bake.base.source, bake.plan.trust_remote_code)
    entries = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".lock")
    )
    return Outputs(entries, root=str(folder), summary={"folder": str(folder)})
