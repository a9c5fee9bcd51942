"""Bake the model people use: baked/, in the plan's formats, with a model card."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from ..stamps import outputs_digest
from . import Outputs, upstream
from .merge import replace_folder

if TYPE_CHECKING:
    from ..build import Bake

NAME = "bake"
VERSION = 1
TARGETS = ["baked/"]


def inputs(bake: Bake) -> dict:
    merge, train, split = upstream(bake, "merge"), upstream(bake, "train"), upstream(bake, "split")
    return {
        "merged": outputs_digest(merge),
        "bake": bake.plan.bake.model_dump(mode="json"),
        "card": {
            "name": bake.plan.name,
            "base": bake.plan.base,
            "data": split.summary,
            "train": bake.plan.train.model_dump(mode="json"),
            "result": train.summary,
        },
    }


def run(bake: Bake, inputs: dict) -> Outputs:
    folder = bake.folder
    tmp = folder.root / ".tmp-baked"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if "safetensors" in inputs["bake"]["formats"]:
        for src in sorted(folder.merged.iterdir()):
            _link_or_copy(src, tmp / src.name)
    (tmp / "README.md").write_text(model_card(inputs["card"]))
    replace_folder(tmp, folder.baked)
    return Outputs(["baked"])


def _link_or_copy(src, dest) -> None:
    # a hard link costs no disk and keeps the content (merged/ is replaced, never edited)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def model_card(card: dict) -> str:
    data, train, result = card["data"], card["train"], card["result"]

    def fmt(value):
        return "—" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))

    settings = "\n".join(f"| `{k}` | `{v}` |" for k, v in train.items() if k != "schedule")
    schedule = train["schedule"]
    files = ", ".join(f"`{name}` ({n})" for name, n in data.get("files", {}).items())
    return f"""---
base_model: {card['base']}
library_name: transformers
tags: [overbrainer, {train['adapter']}]
---

# {card['name']}

Fine-tuned from `{card['base']}` by [overbrainer](https://pypi.org/project/overbrainer/)
({train['adapter']}, {result['steps']} steps, the LoRA adapter merged into the weights).

## Data

{data['rows']} conversations from {files}: {data['train']} for training, {data['validation']} for
validation; {data['duplicates']} exact duplicates dropped.

## Result

| | |
|---|---|
| final training loss | {fmt(result['loss'])} |
| final validation loss | {fmt(result['eval_loss'])} |
| tokens trained | {result['tokens']} |
| training time | {result['seconds']:.0f} s ({result['tokens_per_second']:.0f} tokens/s) |

## Settings

| setting | value |
|---|---|
{settings}
| `schedule` | warmup {schedule['warmup']:g}, decay {schedule['decay']:g} (warmup-stable-decay) |

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/baked")
tokenizer = AutoTokenizer.from_pretrained("path/to/baked")
messages = [{{"role": "user", "content": "Hello!"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))
```
"""
