"""Resolve the plan: every setting with its default, every input pinned by content hash."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

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
    return Outputs([PLAN_JSON])
