"""Any budget from one run: checkpoints of the stable phase reused across a changed length,
budgets as decay branches, a decay from a chosen checkpoint. Each ends bitwise equal (CPU)
to a fresh run of the equivalent single-budget plan from step 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bake_json, cli, make_project

# warmup and decay in steps: the same for every length, so lengths share their stable phase
SCHEDULE = {"warmup_steps": 2, "decay_steps": 2}


def adapter(checkpoint: Path) -> bytes:
    return (checkpoint / "adapter_model.safetensors").read_bytes()


def losses(metrics: Path) -> list[tuple[int, float]]:
    lines = map(json.loads, metrics.read_text().splitlines())
    return [(m["step"], m["loss"]) for m in lines if "step" in m]


def test_data_order_is_a_function_of_seed_and_step():
    from overbrainer.trainers.examples import Order

    lengths = [(i * 37) % 50 + 5 for i in range(30)]
    for grouped in (None, lengths):
        a, b = Order(30, 4, seed=3, lengths=grouped), Order(30, 4, seed=3, lengths=grouped)
        # asked in another order (a resume, a branch): the same examples at each step
        assert [a.step(k) for k in range(40)] == [b.step(k) for k in reversed(range(40))][::-1]
        assert Order(30, 4, seed=4, lengths=grouped).step(0) != a.step(0)


def test_longer_plan_resumes_from_the_stable_phase(project, tmp_path, references):
    """steps 8 → 12 with the decay 2 steps long: checkpoints up to step 6 (the old decay's
    start) are kept, step 8 goes to the attic, and the run ends as a fresh 12-step one."""
    runs = tmp_path / "runs"
    project.write(steps=8, save_every=2, schedule=SCHEDULE)
    bake_json(str(project.plan_path), "--runs", str(runs))
    folder = runs / "tiny"
    project.write(steps=12)
    dry = cli("bake", str(project.plan_path), "--runs", str(runs), "--dry-run").stdout
    assert "resumes from step-000006 (the stable phase is unchanged)" in dry
    why = cli("why", str(project.plan_path), "--runs", str(runs), "train", check=None).stdout
    assert "resumes from step-000006" in why
    report = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "train" in report["ran"] and "split" not in report["ran"]
    assert "resuming from step-000006 (step 6 of 12)" in (folder / "log.txt").read_text()
    attic = [p.name for p in (folder / "attic").glob("*/checkpoints/*")]
    assert attic == ["step-000008"]
    reference = references.folder(steps=12, save_every=2, schedule=SCHEDULE)
    assert adapter(folder / "checkpoints/step-000012") == adapter(reference / "checkpoints/step-000012")
    assert losses(folder / "metrics.jsonl") == losses(reference / "metrics.jsonl")
    meta = json.loads((folder / "checkpoints/step-000012/meta.json").read_text())
    assert meta["decay_start"] == 10 and meta["trajectory"]


def test_a_changed_trajectory_reuses_nothing(project, tmp_path):
    runs = tmp_path / "runs"
    project.write(steps=6, save_every=2, schedule=SCHEDULE)
    bake_json(str(project.plan_path), "--runs", str(runs))
    project.write(steps=8, learning_rate=0.001)
    dry = cli("bake", str(project.plan_path), "--runs", str(runs), "--dry-run").stdout
    assert "resumes from" not in dry
