"""Fetch or import the base model into a local Hugging Face folder (a shared cache)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..base import materialize
from . import Outputs
from .resolve import base_pin

if TYPE_CHECKING:
    from ..build import Bake

NAME = "base"
VERSION = 1
TARGETS = ["(the base model, in the shared cache)"]


def inputs(bake: Bake) -> dict:
    return {"base": base_pin(bake)}


def run(bake: Bake, inputs: dict) -> Outputs:
    folder = materialize(bake.base, log=bake.say)
    entries = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".lock")
    )
    return Outputs(entries, root=str(folder), summary={"folder": str(folder)})
