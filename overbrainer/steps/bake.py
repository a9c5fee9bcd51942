"""Bake the model people use: baked/, in the plan's formats, with a model card.

``baked/`` holds, by ``bake.formats`` (see ``overbrainer/formats/``)::

    model.safetensors config.json tokenizer*   safetensors: merged/'s files, hard-linked
    <name>-<type>.gguf                         gguf-<type>: one file per type asked for
    Modelfile                                  ollama: FROM the first GGUF listed
    adapter/                                   adapter: the final LoRA adapter alone
    README.md  loss.png                        always: the model card and its loss curve

It is written into ``.tmp-baked/`` and renamed into place, so ``baked/`` is whole or absent.
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING

from ..folder import BAKED, METRICS
from ..fsio import replace_folder
from ..inputs.base_model import hub_base
from ..stamps import outputs_digest
from . import Outputs, upstream
from .train import HOW_IT_COMPUTES_SETTINGS

if TYPE_CHECKING:
    from .context import Bake

NAME = "bake"
VERSION = 2
TARGETS = [f"{BAKED}/"]


def inputs(bake: Bake) -> dict:
    merge, train, split = upstream(bake, "merge"), upstream(bake, "train"), upstream(bake, "split")
    formats = bake.plan.bake.formats
    out = {
        "merged": outputs_digest(merge),
        "bake": bake.plan.bake.model_dump(mode="json"),
        # the card's table and loss curve
        "metrics": outputs_digest(train, METRICS),
        "card": {
            "name": bake.plan.name,
            "base": bake.plan.base,
            # the Hub's names for the front matter: never a local path
            "base_model": hub_base(bake.base),
            "license": bake.plan.bake.license or _license(bake),
            "datasets": sorted({s.entry.partition("@")[0].partition(":")[0] for s in bake.sources if s.kind == "hub"}),
            "data": split.summary,
            # what it trains, not how the steps computed it (a finished run stays baked)
            "train": bake.plan.train.model_dump(mode="json", exclude=set(HOW_IT_COMPUTES_SETTINGS)),
            "result": train.summary,
        },
    }
    if "adapter" in formats:
        last = train.summary["checkpoint"]
        out["adapter"] = {"checkpoint": last, "digest": outputs_digest(train, f"checkpoints/{last}")}
    return out


def _license(bake: Bake) -> str | None:
    """The base model's licence: an alias's, else what its folder's card declares."""
    from pathlib import Path

    from ..inputs.base_model import ALIASES, base_license

    if bake.base.kind == "alias":
        return ALIASES[bake.base.location].license
    return base_license(Path(upstream(bake, "base").summary["folder"]))


def run(bake: Bake, inputs: dict) -> Outputs:
    from ..formats import check_formats, gguf_types
    from ..formats.adapter import link_or_copy, write_adapter
    from ..formats.card import model_card, plot_loss, read_metrics

    folder = bake.folder
    formats = inputs["bake"]["formats"]
    name = inputs["card"]["name"]
    # the config step checked the base; this is the merged model, in case it differs
    check_formats(formats, json.loads((folder.merged / "config.json").read_text()), bake.plan.train.adapter)
    tmp = folder.root / ".tmp-baked"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files: dict[str, str] = {}  # what baked/ holds -> the format that made it (for the card)
    if "safetensors" in formats:
        for src in sorted(folder.merged.iterdir()):
            link_or_copy(src, tmp / src.name)
            files[src.name] = "safetensors"
    ggufs: list[str] = []
    if gguf_types(formats):
        from ..formats.llama_cpp import write_ggufs

        ggufs = write_ggufs(folder.merged, tmp, name, gguf_types(formats), say=bake.say, log=folder.log)
        files.update({g: f"gguf-{t}" for g, t in zip(ggufs, gguf_types(formats))})
    if "ollama" in formats:
        from ..formats.ollama import modelfile

        text = modelfile(folder.merged, ggufs[0], num_ctx=bake.plan.train.sequence_len, warn=bake.say)
        (tmp / "Modelfile").write_text(text, encoding="utf-8")
        files["Modelfile"] = "ollama"
    if "adapter" in formats:
        write_adapter(folder.checkpoints / inputs["adapter"]["checkpoint"], tmp / "adapter")
        files["adapter/"] = "adapter"
    metrics = read_metrics(folder.metrics)
    plot_loss(metrics, tmp / "loss.png", title=name)
    (tmp / "README.md").write_text(model_card(inputs["card"], metrics, files), encoding="utf-8")
    replace_folder(tmp, folder.baked, fault="bake:before-rename")
    return Outputs([BAKED])
