"""What a bake writes into ``baked/``, one writer per format.

=====================  ===========================================================  ==========
format                 what it puts in ``baked/``                                   module
=====================  ===========================================================  ==========
``safetensors``        the merged model: ``merged/``'s files, hard-linked           (bake step)
``gguf-<type>``        ``<name>-<type>.gguf``: the merged model for llama.cpp        ``llama_cpp``
                       (llama.cpp's converter and quantizer; plain Llama: ``gguf``)
``ollama``             ``Modelfile``: ``FROM`` the first GGUF listed, chat template  ``ollama``
(``overbrainer push``)  uploads ``baked/`` to the Hub                                 ``push``
``adapter``            ``adapter/``: the final LoRA adapter alone (PEFT's layout)    ``adapter``
(always)               ``README.md`` (the model card), ``loss.png``                  ``card``
=====================  ===========================================================  ==========

This module is what the plan-checking path needs (`check_formats`): it imports nothing heavy.
The writers import numpy, gguf or matplotlib themselves, and are imported only to bake.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import OverbrainerError
from ..plan import BAKE_FORMATS

__all__ = ["GGUF_TYPES", "PYTHON_GGUF_TYPES", "TESTED_ARCHITECTURES", "check_formats", "gguf_types",
           "llama_cpp_architectures", "python_writer_covers"]

GGUF_TYPES = tuple(f.removeprefix("gguf-") for f in BAKE_FORMATS if f.startswith("gguf-"))
# what formats/gguf.py writes in pure Python (the gguf package's numpy quantizers), for plain
# Llama models: no llama.cpp build needed, and faster (bench/bake.py)
PYTHON_GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4", "tq2_0", "tq1_0")
# the families tests/test_gguf_families.py bakes, loads in llama.cpp and compares with
# transformers; llama.cpp's converter knows more (llama_cpp_architectures.txt), untested here
TESTED_ARCHITECTURES = {
    "LlamaForCausalLM": "Llama (default and llama3 RoPE)",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2/2.5",
    "Qwen3ForCausalLM": "Qwen3",
    "Gemma2ForCausalLM": "Gemma 2",
    "Gemma3ForCausalLM": "Gemma 3",
    "Phi3ForCausalLM": "Phi-3",
}


def gguf_types(formats: list[str]) -> list[str]:
    """The GGUF types asked for, in the plan's order: ``["q8_0", "f16"]``."""
    return [f.removeprefix("gguf-") for f in formats if f.startswith("gguf-")]


@functools.cache
def llama_cpp_architectures() -> frozenset[str]:
    """The architectures the pinned llama.cpp converter registers (a file shipped with the
    package, so that the config step knows them without building llama.cpp)."""
    text = (Path(__file__).parent / "llama_cpp_architectures.txt").read_text()
    return frozenset(x.strip() for x in text.splitlines() if x.strip() and not x.startswith("#"))


def python_writer_covers(config: dict, qtype: str) -> bool:
    """Whether formats/gguf.py (pure Python, no llama.cpp) writes this model in ``qtype``:
    the Llama architecture with default RoPE and no MLP bias."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    return (config.get("model_type") == "llama" and rope_type == "default" and not config.get("mlp_bias")
            and qtype in PYTHON_GGUF_TYPES)


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
    if all(python_writer_covers(base_config, t) for t in gguf_types(ggufs)):
        return
    named = ", ".join(ggufs)
    are, them = ("is", "it") if len(ggufs) == 1 else ("are", "them")
    archs = base_config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in llama_cpp_architectures():
        shown = arch or f"{base_config.get('model_type') or 'unknown'} (no architectures in config.json)"
        raise OverbrainerError(
            f"bake.formats: {named} {are} not supported for {shown} models: llama.cpp's converter "
            f"does not know that architecture (supported: {', '.join(TESTED_ARCHITECTURES.values())}, and "
            f"the others in overbrainer/formats/llama_cpp_architectures.txt); remove {them} from bake.formats"
        )

