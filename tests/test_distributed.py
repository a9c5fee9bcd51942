"""The built-in trainer on 2 CPU processes (torchrun, gloo): the same math as one process,
and exact resume for that world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bake_json
from test_resume import kill_bake_at


def metric_lines(folder: Path) -> list[dict]:
    return [m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]


def final(folder: Path) -> bytes:
    return (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes()


def test_two_processes_match_one_and_resume_exactly(project, tmp_path, references):
    one = references.folder(lora_dropout=0.0)
    two = references.folder(lora_dropout=0.0, processes=2)
    project.write(lora_dropout=0.0, processes=2)
    log = (two / "log.txt").read_text()
    assert "torch.distributed.run" in log and "shared by 2 processes" in log
    meta = json.loads((two / "checkpoints/step-000008/meta.json").read_text())
    assert meta["world_size"] == 2
    # the same examples, the same normalization: one process's losses, up to summation order
    for a, b in zip(metric_lines(one), metric_lines(two), strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)

    runs = tmp_path / "killed"
    kill_bake_at(runs, project.plan_path, 5)
    again = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "resuming from step-000003" in (runs / "tiny" / "log.txt").read_text()
    assert again["state"] == "done"
    assert final(runs / "tiny") == final(two)


# -- train.shard: FSDP2 on 2 CPU processes (gloo) ------------------------------------------


def weights(folder: Path, name: str = "adapter_model.safetensors") -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "checkpoints/step-000008" / name)


@pytest.mark.parametrize("adapter, file", [("lora", "adapter_model.safetensors"), ("full", "model.safetensors")])
def test_sharded_matches_ddp(references, adapter, file):
    """FSDP2 over 2 processes: the same checkpoint files as DDP's (the gathered weights,
    in the layout merge and chat read), the same losses within float32 rounding."""
    ddp = references.folder(lora_dropout=0.0, processes=2, adapter=adapter)
    sharded = references.folder(lora_dropout=0.0, processes=2, adapter=adapter, shard=True)
    assert "shared by 2 processes (sharded: FSDP2)" in (sharded / "log.txt").read_text()
    meta = json.loads((sharded / "checkpoints/step-000008/meta.json").read_text())
    assert meta["world_size"] == 2 and meta["shard"] is True
    for a, b in zip(metric_lines(ddp), metric_lines(sharded), strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    mine, theirs = weights(sharded, file), weights(ddp, file)
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
        assert (mine[k] - theirs[k]).abs().max() <= 1e-5, k
    assert (sharded / "merged" / "model.safetensors").is_file()


def test_sharded_resume_is_exact(project, tmp_path, references):
    whole = references.folder(lora_dropout=0.0, processes=2, shard=True)
    project.write(lora_dropout=0.0, processes=2, shard=True)
    runs = tmp_path / "killed"
    kill_bake_at(runs, project.plan_path, 5)
    again = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "resuming from step-000003" in (runs / "tiny" / "log.txt").read_text()
    assert again["state"] == "done"
    assert final(runs / "tiny") == final(whole)
