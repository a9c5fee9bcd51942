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
    from ..inputs.conversations import split_sources  # pyarrow: only when there is work

    summary = split_sources(
        bake.sources, bake.folder.examples, validation=bake.plan.split.validation, seed=bake.plan.split.seed
    )
    s = summary.as_dict()
    bake.say(
        f"split: {s['rows']} conversations ({s['train']} train, {s['validation']} validation), "
        f"{s['duplicates']} duplicates dropped"
    )
    for line in mix_lines(s):
        bake.say(line)
    return Outputs([EXAMPLES], summary=s)


def mix_lines(summary: dict) -> list[str]:
    """The mix the split made, one line per source: its format, train examples and tokens."""
    train = summary["train"] or 1
    tokens = summary["train_tokens_estimate"] or 1
    lines = []
    for s in summary["sources"]:
        formats = ", ".join(f"{name} ({n})" if len(s["formats"]) > 1 else name for name, n in s["formats"].items())
        lines.append(
            f"split: {s['source']}: {formats}; {s['train']} train examples ({100 * s['train'] / train:.0f}%), "
            f"~{s['tokens']:,} tokens ({100 * s['tokens'] / tokens:.0f}%), {s['validation']} validation"
        )
    return lines
