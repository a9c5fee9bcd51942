"""The spine end to end on a tiny model: artifacts, reruns that do nothing, what an edit reruns."""

from __future__ import annotations

import json

import pytest
from helpers import bake_json, cli


def stamp_mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in (folder / ".stamps").iterdir()}


@pytest.fixture
def baked(baked_copy):
    project = baked_copy()
    folder = project.root.parent / "runs" / "tiny"
    return project, {"folder": str(folder), "ran": ["resolve", "base", "split", "config", "train", "merge", "bake"],
                     "state": "done"}


def test_first_bake_runs_every_step(project):
    report = bake_json(str(project.plan_path))
    assert report["ran"] == ["resolve", "base", "split", "config", "train", "merge", "bake"]
    assert report["skipped"] == [] and report["state"] == "done"


def test_bake_makes_every_artifact(baked):
    project, report = baked
    folder = __import__("pathlib").Path(report["folder"])
    for name in ("plan.json", "examples.parquet", "config.yaml", "metrics.jsonl", "log.txt"):
        assert (folder / name).is_file(), name
    steps = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert steps == ["step-000003", "step-000006", "step-000008"]
    for step in steps:
        files = {p.name for p in (folder / "checkpoints" / step).iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "meta.json"} <= files
    meta = json.loads((folder / "checkpoints/step-000008/meta.json").read_text())
    assert meta["step"] == 8 and meta["decayed"] is True and meta["phase"] == "decay"
    assert json.loads((folder / "checkpoints/step-000003/meta.json").read_text())["decayed"] is False

    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["stage"] == "train"  # the job's stage event comes before its steps
    lines = [m for m in records if "step" in m]
    assert [m["step"] for m in lines] == list(range(1, 9))
    for m in lines:
        assert {"step", "tokens", "loss", "lr", "seconds", "phase"} <= set(m)
        assert m["loss"] > 0
    assert [m["step"] for m in lines if "eval_loss" in m] == [4, 8]
    assert [m["phase"] for m in lines] == ["warmup"] * 1 + ["stable"] * 5 + ["decay"] * 2
    assert lines[-1]["tokens"] > lines[0]["tokens"] > 0

    plan = json.loads((folder / "plan.json").read_text())
    assert plan["train"]["learning_rate"] == 0.003 and plan["train"]["schedule"] == {
        "warmup": 0.1, "decay": 0.2, "warmup_steps": None, "decay_steps": None}
    assert len(plan["resolved"]["data"][0]["hash"]) == 64
    assert plan["resolved"]["base"]["kind"] == "folder" and plan["resolved"]["base"]["pin"]

    card = (folder / "baked" / "README.md").read_text()
    assert "final validation loss" in card and "40 conversations" in card


def test_merged_model_loads_and_differs_from_base(baked, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    project, report = baked
    folder = __import__("pathlib").Path(report["folder"])
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(folder / "baked")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    q_merged = merged.model.layers[0].self_attn.q_proj.weight
    q_base = base.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_merged, q_base)  # the adapter went in
    mlp = merged.model.layers[0].mlp.up_proj.weight
    assert torch.equal(mlp, base.model.layers[0].mlp.up_proj.weight)  # not a LoRA target
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = merged.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_rerun_executes_nothing_and_reads_no_weights(baked):
    project, report = baked
    folder = __import__("pathlib").Path(report["folder"])
    before = stamp_mtimes(folder)
    again = bake_json(str(project.plan_path))
    assert again["ran"] == []
    assert sorted(again["skipped"]) == sorted(report["ran"])
    assert stamp_mtimes(folder) == before
    # nothing was hashed again: the hash cache was not even rewritten
    cache = folder / ".hashes.json"
    mtime = cache.stat().st_mtime_ns
    bake_json(str(project.plan_path))
    assert cache.stat().st_mtime_ns == mtime


def test_doit_db_lost_still_runs_nothing(baked):
    project, report = baked
    folder = __import__("pathlib").Path(report["folder"])
    before = stamp_mtimes(folder)
    for p in folder.glob(".doit.db*"):
        p.unlink()
    again = bake_json(str(project.plan_path))
    assert again["ran"] == [] and stamp_mtimes(folder) == before


def test_learning_rate_edit_retrains_without_resplitting(baked):
    project, report = baked
    folder = __import__("pathlib").Path(report["folder"])
    before = stamp_mtimes(folder)
    project.write(learning_rate=0.001)
    dry = cli("bake", str(project.plan_path), "--dry-run", "--json")
    plan = json.loads(dry.stdout.strip().splitlines()[-1])
    assert plan["would_run"] == ["resolve", "config", "train", "merge", "bake"]
    why = {r["step"]: r["why"] for r in plan["steps"]}
    assert "learning_rate: 0.003 → 0.001" in why["config"]
    assert stamp_mtimes(folder) == before  # a dry run writes nothing

    again = bake_json(str(project.plan_path))
    assert again["ran"] == ["resolve", "config", "train", "merge", "bake"]
    assert set(again["skipped"]) == {"base", "split"}
    after = stamp_mtimes(folder)
    assert after["split.json"] == before["split.json"] and after["base.json"] == before["base.json"]
    # the older run's checkpoints were moved aside, not deleted
    attic = list((folder / "attic").glob("*/checkpoints/step-000008/adapter_model.safetensors"))
    assert len(attic) == 1
    lr = [m["lr"] for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]
    assert max(lr) == pytest.approx(0.001)


def test_data_edit_reruns_split_and_after(baked):
    project, report = baked
    with open(project.root / "chats.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "New question?"}, {"role": "assistant", "content": "Arr, a new answer. Fair winds! ⚓"}]}) + "\n")
    again = bake_json(str(project.plan_path))
    assert again["ran"] == ["resolve", "split", "config", "train", "merge", "bake"]
    assert again["skipped"] == ["base"]


def test_doit_runs_the_same_graph(baked):
    import subprocess
    import sys

    from helpers import REPO

    project, report = baked
    proc = subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "train", f"plan={project.plan_path}"],
        capture_output=True, text=True, cwd=project.root.parent,
    )
    assert proc.returncode == 0, proc.stderr
    folder = __import__("pathlib").Path(report["folder"])
    assert (folder / ".stamps" / "bake.json").is_file()
    listing = subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "list", "--all", f"plan={project.plan_path}"],
        capture_output=True, text=True, cwd=project.root.parent,
    )
    for step in ("train:split", "train:config", "train:train", "train:merge", "train:bake"):
        assert step in listing.stdout
