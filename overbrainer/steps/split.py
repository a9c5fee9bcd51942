"""Validate the conversations and split them into train and validation: examples.parquet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..folder import EXAMPLES
from . import Outputs
from .resolve import data_pins

if TYPE_CHECKING:
    from .context import Bake

NAME = "split"
VERSION = 1
TARGETS = [EXAMPLES]


def inputs(bake: Bake) -> dict:
    return {"split": bake.plan.split.model_dump(mode="json"), "data": data_pins(bake)}


def run(bake: Bake, inputs: dict) -> Outputs:
    from ..inputs.conversations import split_conversations  # pyarrow: only when there is work

    names = {p: bake.shown(p) for p in bake.data_paths}
    summary = split_conversations(
        bake.data_paths,
        bake.folder.examples,
        validation=bake.plan.split.validation,
        seed=bake.plan.split.seed,
        display_names=names,
        # the source column names each file as the plan does: the same wherever the bake runs
        source_names={p: rel for rel, p in zip(bake.plan.data_files, bake.data_paths)},
    )
    s = summary.as_dict()
    bake.say(
        f"split: {s['rows']} conversations ({s['train']} train, {s['validation']} validation), "
        f"{s['duplicates']} duplicates dropped"
    )
    return Outputs([EXAMPLES], summary=s)
