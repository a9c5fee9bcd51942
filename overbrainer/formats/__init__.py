"""What a bake writes into ``baked/``, one writer per format.

=====================  ===========================================================  ==========
format                 what it puts in ``baked/``                                   module
=====================  ===========================================================  ==========
``safetensors``        the merged model: ``merged/``'s files, hard-linked           (bake step)
``gguf-<type>``        ``<name>-<type>.gguf``: the merged model for llama.cpp        ``gguf``
``ollama``             ``Modelfile``: ``FROM`` the first GGUF listed, chat template  ``ollama``
``adapter``            ``adapter/``: the final LoRA adapter alone (PEFT's layout)    ``adapter``
(always)               ``README.md`` (the model card), ``loss.png``                  ``card``
=====================  ===========================================================  ==========

This module is what the plan-checking path needs (`check_formats`): it imports nothing heavy.
The writers import numpy, gguf or matplotlib themselves, and are imported only to bake.
"""

from __future__ import annotations

from ..errors import OverbrainerError
from ..plan import BAKE_FORMATS

__all__ = ["GGUF_TYPES", "GGUF_ARCHITECTURES", "check_formats", "gguf_types"]

GGUF_TYPES = tuple(f.removeprefix("gguf-") for f in BAKE_FORMATS if f.startswith("gguf-"))
GGUF_ARCHITECTURES = ("llama",)  # transformers model_type values the GGUF writer knows


def gguf_types(formats: list[str]) -> list[str]:
    """The GGUF types asked for, in the plan's order: ``["q8_0", "f16"]``."""
    return [f.removeprefix("gguf-") for f in formats if f.startswith("gguf-")]


def check_formats(formats: list[str], base_config: dict, adapter: str = "lora") -> None:
    """Raise OverbrainerError (one line) when the base model or the training cannot give what
    ``bake.formats`` asks for; to be called before any training, once the base's
    ``config.json`` is known. ``adapter`` is the plan's ``train.adapter``."""
    if "adapter" in formats and adapter not in ("lora", "qlora"):
        raise OverbrainerError(
            f'bake.formats: adapter needs train.adapter "lora" or "qlora" (a {adapter} fine-tune has no '
            "adapter of its own); remove it from bake.formats"
        )
    ggufs = [f for f in formats if f.startswith("gguf-")]
    if not ggufs:
        return
    named = ", ".join(ggufs)
    are, them = ("is", "it") if len(ggufs) == 1 else ("are", "them")
    arch = base_config.get("model_type") or "unknown"
    if arch not in GGUF_ARCHITECTURES:
        raise OverbrainerError(
            f"bake.formats: {named} {are} not supported for {arch} models "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)}); remove {them} from bake.formats"
        )
    # llama variants the writer does not carry over (llama.cpp would need more tensors or keys)
    rope = base_config.get("rope_parameters") or base_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    unsupported = []
    if rope_type != "default":
        unsupported.append(f"rope_type {rope_type!r}")
    if base_config.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if unsupported:
        raise OverbrainerError(
            f"bake.formats: {named} {are} not supported for {arch} models with "
            f"{' and '.join(unsupported)} (supported: default rope, no MLP bias); remove {them} "
            "from bake.formats"
        )
