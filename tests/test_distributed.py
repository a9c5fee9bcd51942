"""The built-in trainer on 2 CPU processes (torchrun, gloo): the same math as one process,
and exact resume for that world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bake_json
from test_resume import kill_bake_at

# float32 where bits are compared with another way of computing: train.bf16 "auto" is bf16 on
# a CPU with AMX, and FSDP2's bf16 policy (the layers gathered in bf16) is not autocast's
FP32 = {"lora_dropout": 0.0, "bf16": False}


def metric_lines(folder: Path) -> list[dict]:
    return [m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]


def final(folder: Path) -> bytes:
    return (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes()


def test_two_processes_match_one_and_resume_exactly(project, tmp_path, references):
    one = references.folder(**FP32)
    two = references.folder(**FP32, processes=2)
    # the resumed run profiles two steps on each rank (train.profile changes no weight)
    project.write(**FP32, processes=2, profile={"start": 6, "steps": 2})
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
    profile = runs / "tiny" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == [
        "ops-rank0.txt", "ops-rank1.txt", "trace-rank0.json.gz", "trace-rank1.json.gz"]
    for rank in (0, 1):
        ops = (profile / f"ops-rank{rank}.txt").read_text()
        assert ops.startswith(f"# steps 6-7 of 8 on cpu (rank {rank} of 2), recorded "), ops[:200]
        assert "gloo:all_reduce" in ops or "c10d::allreduce_" in ops, ops  # DDP's all-reduce, recorded


# -- train.shard: FSDP2 on 2 CPU processes (gloo) ------------------------------------------


def weights(folder: Path, name: str = "adapter_model.safetensors") -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "checkpoints/step-000008" / name)


@pytest.mark.parametrize("adapter, file", [
    pytest.param("lora", "adapter_model.safetensors", id="lora"),
    pytest.param("full", "model.safetensors", id="full", marks=pytest.mark.slow),  # 2 more bakes of 2 processes
])
def test_sharded_matches_ddp_bit_for_bit(references, adapter, file):
    """FSDP2 over 2 processes in float32: DDP's losses and DDP's checkpoint, bit for bit
    (2 ranks' reduce-scatter and all-reduce add the same two numbers; AdamW is elementwise
    on the shards), gathered into the layout merge and chat read."""
    ddp = references.folder(**FP32, processes=2, **({"adapter": adapter} if adapter != "lora" else {}))
    sharded = references.folder(**FP32, processes=2, shard=True,
                                **({"adapter": adapter} if adapter != "lora" else {}))
    assert "shared by 2 processes (sharded: FSDP2)" in (sharded / "log.txt").read_text()
    meta = json.loads((sharded / "checkpoints/step-000008/meta.json").read_text())
    assert meta["world_size"] == 2 and meta["shard"] is True
    assert metric_lines(sharded) == [{**b, "seconds": a["seconds"]} for a, b in
                                     zip(metric_lines(sharded), metric_lines(ddp), strict=True)]
    mine, theirs = weights(sharded, file), weights(ddp, file)
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and mine[k].equal(theirs[k]) for k in theirs)
    assert (sharded / "merged" / "model.safetensors").is_file()


def run_trainer(run: Path, processes: int = 1):
    import subprocess
    import sys

    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    out = subprocess.run([sys.executable, *launcher, "-m", "overbrainer.trainers.builtin", "config.yaml"],
                         cwd=run, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def copy_run(reference: Path, run: Path, checkpoints: tuple[str, ...] = (), **config) -> Path:
    import shutil

    import yaml

    run.mkdir()
    for data in reference.glob("*.parquet"):  # examples and the split files config.yaml names
        shutil.copy(data, run)
    cfg = yaml.safe_load((reference / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, **config}))
    for name in checkpoints:
        shutil.copytree(reference / "checkpoints" / name, run / "checkpoints" / name)
    return run


def test_sharded_resume_is_exact_and_takes_another_world_size(references, tmp_path):
    """A sharded checkpoint is whole: 2 processes take up step 3 to the uninterrupted
    run's bits; one process takes it up too (the same math, other roundings)."""
    whole = references.folder(lora_dropout=0.0, processes=2, shard=True)
    two = copy_run(whole, tmp_path / "two", ("step-000003",))
    assert "resuming from step-000003 (step 3 of 8)" in run_trainer(two, processes=2)
    assert final(two) == final(whole)
    one = copy_run(whole, tmp_path / "one", ("step-000003",))
    assert "resuming from step-000003 (step 3 of 8, by 2 processes)" in run_trainer(one)
    # the copy has no metrics.jsonl: step 3's line is restored from its checkpoint, as
    # the loop wrote it, then steps 4 to 8 are trained
    restored, *trained = metric_lines(one)
    logged = {k: v for k, v in metric_lines(whole)[2].items() if k != "memory"}  # a GPU's peak: in no checkpoint
    assert restored == {**logged, "restored": True}
    for a, b in zip(metric_lines(whole)[3:], trained, strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert json.loads((one / "checkpoints/step-000008/meta.json").read_text())["world_size"] == 1


def test_a_sharded_run_takes_the_samples_ddp_takes(references):
    """Samples under FSDP2: every rank generates through the root (each layer's weights are
    gathered by all), in step; rank 0 writes. The same answers as DDP's at every sampled
    step, and training is untouched (the same weights: the same losses, bit for bit)."""
    settings = {"every": 4, "max_new_tokens": 6, "prompts": ["Hello?", "Name a colour."]}
    ddp = references.folder(**FP32, processes=2, samples=settings)
    sharded = references.folder(**FP32, processes=2, shard=True, samples=settings)

    def samples(folder: Path) -> list[dict]:
        return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]

    assert [line["step"] for line in samples(sharded)] == [0, 4, 8]
    assert samples(sharded) == samples(ddp)
    assert [{k: v for k, v in m.items() if k != "seconds"} for m in metric_lines(sharded)] == \
        [{k: v for k, v in m.items() if k != "seconds"} for m in metric_lines(ddp)]


def test_sharded_alone_is_one_process_bit_for_bit(references, tmp_path):
    """FSDP2 in a world of one (the trainer on a config with shard: true; the plan refuses
    it, and it is what a one-GPU box can test): DTensor slices, the gathered checkpoint
    and the optimizer state by name change no bit of the unsharded run's (in float32:
    under bf16, FSDP2 gathers and computes the layers in bf16, which autocast does not)."""
    reference = references.folder(**FP32)
    run = copy_run(reference, tmp_path / "run", shard=True)
    assert "(sharded: FSDP2)" in run_trainer(run)
    assert final(run) == final(reference)


@pytest.mark.slow  # a bake of 2 processes killed and baked again
def test_sharded_bake_killed_resumes_exactly(project, tmp_path, references):
    whole = references.folder(lora_dropout=0.0, processes=2, shard=True)
    project.write(lora_dropout=0.0, processes=2, shard=True)
    runs = tmp_path / "killed"
    kill_bake_at(runs, project.plan_path, 5)
    again = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "resuming from step-000003" in (runs / "tiny" / "log.txt").read_text()
    assert again["state"] == "done"
    assert final(runs / "tiny") == final(whole)


def test_a_gpu_checkpoint_resumes_with_this_devices_optimizer_kernel(references, tmp_path):
    """A checkpoint's optimizer groups say which AdamW kernel made them (fused on a GPU):
    resumed on the CPU it takes the CPU's own (as `setup` picks it), set before the state
    is loaded (the load places each step count by that flag). Here a CPU checkpoint marked
    as a GPU would mark it resumes to the uninterrupted run's bits."""
    import torch

    from overbrainer.hashing import hash_file

    reference = references.folder(lora_dropout=0.0)
    run = copy_run(reference, tmp_path / "run", ("step-000003",))
    folder = run / "checkpoints" / "step-000003"
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    assert all(group.get("fused") is None for group in state["optimizer"]["param_groups"])
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = True  # what a CUDA run's fused AdamW writes
    torch.save(state, folder / "trainer_state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["trainer_state.pt"] = hash_file(folder / "trainer_state.pt")
    (folder / "meta.json").write_text(json.dumps(meta))
    assert "resuming from step-000003" in run_trainer(run)
    assert final(run) == final(reference)
