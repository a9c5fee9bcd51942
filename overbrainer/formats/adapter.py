"""The LoRA adapter alone, ``baked/adapter/``, for servers that load adapters over a base
model (vLLM's ``--lora-modules``, PEFT's ``PeftModel.from_pretrained(base, "baked/adapter")``).

It is the final checkpoint's ``adapter_model.safetensors`` and ``adapter_config.json``, as PEFT
wrote them: the optimizer state and the sidecar stay in ``checkpoints/``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import OverbrainerError

__all__ = ["ADAPTER_FILES", "write_adapter"]

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def write_adapter(checkpoint: Path, dest: Path) -> None:
    missing = [name for name in ADAPTER_FILES if not (checkpoint / name).is_file()]
    if missing:
        raise OverbrainerError(
            f"bake.formats: adapter: {checkpoint} has no {', '.join(missing)} (a full fine-tune "
            "has no adapter); remove adapter from bake.formats"
        )
    dest.mkdir()
    for name in ADAPTER_FILES:
        link_or_copy(checkpoint / name, dest / name)


def link_or_copy(src: Path, dest: Path) -> None:
    # a hard link costs no disk and keeps the content: the files it links are replaced by
    # their writers, never edited in place
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)
