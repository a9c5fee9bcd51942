"""Resolve the plan: every setting with its default, every input pinned by content hash."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..errors import OverbrainerError
from ..folder import PLAN_JSON
from ..fsio import write_atomic
from ..inputs.base_model import pin_base
from ..inputs.sources import pin_sources
from ..version import __version__
from . import Outputs

if TYPE_CHECKING:
    from .context import Bake

NAME = "resolve"
VERSION = 1
TARGETS = [PLAN_JSON]


def data_pins(bake: Bake) -> list[dict]:
    """The plan's data sources, each as written in the plan with its content hash (and a hub
    dataset's commit and config), and its settings where not the default."""
    return pin_sources(bake.sources, bake.hashes)


def base_pin(bake: Bake) -> dict:
    spec = bake.base
    # a local model is known by its content, wherever it lies; a hub model by its name
    where = spec.source if spec.kind in ("hub", "alias") else None
    return {"kind": spec.kind, "source": where, "pin": pin_base(spec, bake.hashes)}


def inputs(bake: Bake) -> dict:
    return {
        "plan": bake.plan.model_dump(mode="json"),
        "data": data_pins(bake),
        "base": base_pin(bake),
    }


def run(bake: Bake, inputs: dict) -> Outputs:
    resolved = dict(inputs["plan"])
    resolved["resolved"] = {
        "plan_file": str(bake.plan_path),
        "data": inputs["data"],
        "base": inputs["base"],
        "overbrainer": __version__,
    }
    write_atomic(bake.folder.plan_json, (json.dumps(resolved, indent=2) + "\n").encode())
    # before anything else is written: hardware the plan names that this machine lacks
    problems = hardware_problems(bake)
    if problems:
        raise OverbrainerError("\n".join(f"{bake.shown(bake.plan_path)}: {p}" for p in problems))
    return Outputs([PLAN_JSON])


def hardware_problems(bake: Bake) -> list[str]:
    """What the built-in trainer, training here, cannot do on this machine of what the plan
    asks (a GPU it lacks, more processes than GPUs, QLoRA without bitsandbytes, Liger off
    CUDA), one line each. A plan that asks nothing of the kind costs no torch import."""
    train = bake.plan.train
    asks = (train.device not in ("auto", "cpu") or train.processes > 1 or train.adapter == "qlora"
            or train.liger is True)
    if train.trainer != "builtin" or bake.plan.where != "here" or not asks:
        return []
    from ..trainers.builtin.device import problems

    return problems(train.device, train.processes, train.adapter, train.liger is True)
