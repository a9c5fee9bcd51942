"""The built-in trainer on a CUDA GPU: ``pytest -m gpu`` (skipped where torch sees none).

The tiny models train in seconds there too; these check that the work really is on the
GPU, that bf16 and QLoRA run, that two GPUs share a step as one does, and that a SIGKILL
under train.deterministic resumes to the same bits."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bake_json, make_project
from test_distributed import metric_lines
from test_resume import kill_bake_at

pytestmark = pytest.mark.gpu

FINAL = "checkpoints/step-000008"


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def meta(folder: Path) -> dict:
    return json.loads((folder / FINAL / "meta.json").read_text())


def test_parameters_and_batches_are_on_the_gpu(project, tmp_path):
    """The loop's own pieces, in this process: the model built from config.yaml, a batch
    moved as the loop moves it, and the loss computed there."""
    project.write(device="cuda", profile={"start": 3, "steps": 2, "memory": True})
    folder = Path(bake_json(str(project.plan_path))["folder"])
    assert meta(folder)["device"] == "cuda:0" and meta(folder)["bf16"] is True  # "auto" on a bf16 GPU
    # train.profile saw the steps' kernels on the GPU, and the allocator's history there
    ops = (folder / "profile" / "ops.txt").read_text()
    assert ops.startswith("# steps 3-4 of 8 on cuda:0, recorded "), ops[:300]
    busy = float(re.search(r"^# kernels ran ([0-9.]+) s a step: the GPU busy ", ops, re.M).group(1))
    assert busy > 0, ops[:600]
    with open(folder / "profile" / "memory.pickle", "rb") as f:
        assert pickle.load(f)["segments"]  # the CUDA caching allocator's segments, for memory_viz
    assert "on cuda:0, computing in bf16" in (folder / "log.txt").read_text()
    try:  # train.liger "auto": Liger's kernels where liger_kernel imports
        import liger_kernel.transformers  # noqa: F401

        liger = True
    except ImportError:
        liger = False
    assert meta(folder)["liger"] is liger
    assert ("with Liger's kernels" in (folder / "log.txt").read_text()) is liger
    probe = f"""
import sys, yaml, torch
from pathlib import Path
from overbrainer.trainers.builtin import device as hw
from overbrainer.trainers.builtin.model import Decoder, TokenLoss, load_model
from overbrainer.trainers.examples import collate, load_examples
cfg = yaml.safe_load(Path({str(folder / 'config.yaml')!r}).read_text())
dev = hw.pick("cuda")
model, tok = load_model(cfg, dev, bf16=True)
assert all(p.device.type == "cuda" for p in model.parameters())
assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
train, _, _ = load_examples(Path({str(folder / 'examples.parquet')!r}), tok, 96)
batch = hw.to_device(collate(train[:2], tok.pad_token_id), dev)
assert all(v.device.type == "cuda" for v in batch.values())
with hw.compute(True, dev):
    loss = TokenLoss(mask=False)(Decoder(model), batch)
assert loss.device.type == "cuda"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_bf16_off_trains_in_float32_and_differs(project, tmp_path):
    project.write(device="cuda", bf16=False)
    fp32 = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "fp32"))["folder"])
    project.write(device="cuda", bf16=True)
    bf16 = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "bf16"))["folder"])
    assert meta(fp32)["bf16"] is False and meta(bf16)["bf16"] is True
    for a, b in zip(metric_lines(fp32), metric_lines(bf16), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


def test_qlora_trains_and_merges_on_the_gpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    from tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "tiny64", hidden=64)
    project = make_project(tmp_path / "project", base)
    project.write(adapter="qlora", device="cuda")
    folder = Path(bake_json(str(project.plan_path))["folder"])
    assert meta(folder)["adapter"] == "qlora" and meta(folder)["device"] == "cuda:0"
    assert (folder / "merged" / "model.safetensors").is_file() and (folder / "baked").is_dir()


@pytest.mark.skipif("gpus() < 2", reason="needs 2 GPUs")
def test_two_gpus_match_one(project, tmp_path):
    # Liger off: "auto" turns it on for one process only, and the two runs should differ
    # in their world size alone
    project.write(device="cuda", lora_dropout=0.0, bf16=False, liger=False)
    one = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "one"))["folder"])
    project.write(processes=2)
    two = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "two"))["folder"])
    assert meta(two)["world_size"] == 2
    for a, b in zip(metric_lines(one), metric_lines(two), strict=True):
        assert a["tokens"] == b["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=1e-3)


def test_sigkill_and_resume_is_bitwise_under_deterministic(project, tmp_path):
    project.write(device="cuda", deterministic=True)
    whole = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "whole"))["folder"])
    killed = tmp_path / "killed"
    kill_bake_at(killed, project.plan_path, 5)
    again = Path(bake_json(str(project.plan_path), "--runs", str(killed))["folder"])
    assert "resuming from step-" in (again / "log.txt").read_text()
    final = f"{FINAL}/adapter_model.safetensors"
    assert (again / final).read_bytes() == (whole / final).read_bytes()


def test_sharded_alone_on_the_gpu(project, tmp_path):
    """FSDP2 on CUDA in a world of one (the trainer on a config with shard: true, which
    the plan keeps for 2 GPUs or more): DTensor slices on the GPU, the bf16 policy, fused
    AdamW over them, the checkpoint gathered to the usual files, and a resume that maps
    the optimizer state by name back onto the GPU."""
    import shutil

    import yaml

    project.write(device="cuda", lora_dropout=0.0, adapter="full")
    plain = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "plain"))["folder"])
    run = tmp_path / "sharded"
    run.mkdir()
    for name in ("config.yaml", "examples.parquet", "train.parquet", "validation.parquet"):
        shutil.copy(plain / name, run / name)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "shard": True}))
    trainer = [sys.executable, "-m", "overbrainer.trainers.builtin", "config.yaml"]
    out = subprocess.run(trainer, cwd=run, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "on cuda:0, computing in bf16 (sharded: FSDP2)" in out.stdout
    assert meta(run)["shard"] is True and meta(run)["device"] == "cuda:0"
    assert (run / FINAL / "model.safetensors").is_file() and (run / FINAL / "config.json").is_file()
    # bf16 gathers (FSDP2's policy) against bf16 autocast over float32 weights: close, not equal
    for a, b in zip(metric_lines(plain), metric_lines(run), strict=True):
        assert a["tokens"] == b["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    shutil.rmtree(run / FINAL)
    again = subprocess.run(trainer, cwd=run, capture_output=True, text=True)
    assert again.returncode == 0 and "resuming from step-000006" in again.stdout, again.stderr[-2000:]
    assert meta(run)["step"] == 8


@pytest.mark.skipif("gpus() < 2", reason="needs 2 GPUs")
def test_two_gpus_sharded_match_ddp(project, tmp_path):
    project.write(device="cuda", lora_dropout=0.0, bf16=False, adapter="full", processes=2)
    ddp = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "ddp"))["folder"])
    project.write(shard=True)
    sharded = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "sharded"))["folder"])
    assert meta(sharded)["world_size"] == 2 and meta(sharded)["shard"] is True
    for a, b in zip(metric_lines(ddp), metric_lines(sharded), strict=True):
        assert a["tokens"] == b["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    assert (sharded / "merged" / "model.safetensors").is_file()


def test_liger_leaves_a_lora_on_lm_head_its_gradient(project):
    """Liger's fused loss takes the output layer's weight alone: with lm_head among the
    LoRA targets the trainer keeps that loss plain (and says so), so the adapter on lm_head
    trains; the other kernels stay Liger's."""
    pytest.importorskip("liger_kernel")
    from safetensors import safe_open

    project.write(device="cuda", lora_target_modules=["q_proj", "v_proj", "lm_head"])
    folder = Path(bake_json(str(project.plan_path))["folder"])
    assert "lm_head carries a LoRA adapter" in (folder / "log.txt").read_text()
    with safe_open(folder / FINAL / "adapter_model.safetensors", "pt") as f:
        names = [k for k in f.keys() if "lm_head" in k and "lora_B" in k]
        assert names and all(f.get_tensor(k).abs().max() > 0 for k in names)  # lora_B starts at zero
