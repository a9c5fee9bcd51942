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


def test_longer_plan_resumes_from_the_stable_phase(baked_copy, tmp_path, references):
    """steps 8 → 12 with the decay 2 steps long: checkpoints up to step 6 (the old decay's
    start) are kept, step 8 goes to the attic, and the run ends as a fresh 12-step one."""
    runs = tmp_path / "runs"
    project = baked_copy(steps=8, save_every=2, schedule=SCHEDULE)
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


def kill_during(runs: Path, plan: Path, metrics: Path, lines: int) -> None:
    """Start a bake and SIGKILL it (and its trainer) once `metrics` has `lines` lines."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "overbrainer.cli", "bake", str(plan), "--foreground", "--runs", str(runs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        if proc.poll() is not None:
            raise AssertionError(f"the bake ended before it could be killed: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the bake did not reach the step to kill it at"
        time.sleep(0.02)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for child in children:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)


def test_budgets_are_branches_equal_to_fresh_runs(project, tmp_path, references):
    """budgets [8, 12]: the trunk trains once to step 10 (12 − 2); each budget decays in its
    own branch, killed with SIGKILL in the middle of one; each ends bitwise equal to a fresh
    run of that many steps. A budget added later trains only its decay, and `decay --at`
    from a stable checkpoint is a branch equal to a fresh run too."""
    runs = tmp_path / "runs"
    project.plan["train"].pop("steps")
    project.write(budgets=[12, 8], save_every=2, schedule=SCHEDULE)
    folder = runs / "tiny"
    graph = cli("graph", str(project.plan_path), "--runs", str(runs), "--no-status").stdout
    assert "decay@8" in graph and "bake@12" in graph and "branches/12/baked/" in graph
    assert not any(line.split()[0] == "merge" for line in graph.splitlines())  # the trunk is not a finished model
    kill_during(runs, project.plan_path, folder / "branches/12/metrics.jsonl", 11)  # the decay's first step
    assert not (folder / ".stamps/decay@12.json").exists()
    report = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "decay@12" in report["ran"] and "train" not in report["ran"]
    assert "resuming from step-000010 (step 10 of 12)" in (folder / "branches/12/log.txt").read_text()
    # the trunk: 10 steps, trained once, with a checkpoint at each budget's decay start
    assert [step for step, _ in losses(folder / "metrics.jsonl")] == list(range(1, 11))
    assert {p.name for p in (folder / "checkpoints").iterdir()} >= {"step-000006", "step-000010"}
    for budget in (8, 12):
        reference = references.folder(steps=budget, save_every=2, schedule=SCHEDULE)
        mine = folder / f"branches/{budget}/checkpoints/step-{budget:06d}"
        assert adapter(mine) == adapter(reference / f"checkpoints/step-{budget:06d}")
        assert losses(folder / f"branches/{budget}/metrics.jsonl") == losses(reference / "metrics.jsonl")
        merged = (folder / f"branches/{budget}/merged/model.safetensors").read_bytes()
        assert merged == (reference / "merged/model.safetensors").read_bytes()
    card = (folder / "branches/8/baked/README.md").read_text()
    assert "checkpoints/step-000006" in card
    assert cli("bake", str(project.plan_path), "--runs", str(runs), "--check").returncode == 0

    from overbrainer.runtime.run import Run

    run = Run(folder)
    assert run.branch(8).path == folder / "branches/8/baked"
    assert "branch 12: baked" in cli("status", str(folder)).stdout
    assert "branch 8" in cli("checkpoints", str(folder)).stdout

    # a budget added later: only its decay (from the trunk's step 6, already there)
    project.write(budgets=[8, 10, 12])
    report = bake_json(str(project.plan_path), "--runs", str(runs))
    assert "decay@10" in report["ran"] and "decay@8" not in report["ran"] and "decay@12" not in report["ran"]
    assert (folder / "log.txt").read_text().count("step 10/10") == 1  # the trunk trained nothing again

    # a decay from a chosen stable checkpoint: step 6, 2 steps, is budget 8 again
    bad = cli("decay", str(folder), "--at", "5", check=2).stderr
    assert bad.strip() == "error: decay --at 5: step 5 of tiny has no checkpoint; the stable checkpoints are: 2, 4, 6, 8, 10"
    out = cli("decay", str(folder), "--at", "6", "--steps", "2").stdout
    assert "baked: " in out and (folder / "branches/at-6/baked/README.md").is_file()
    assert adapter(folder / "branches/at-6/checkpoints/step-000008") == adapter(folder / "branches/8/checkpoints/step-000008")
    assert "everything is up to date" in cli("decay", str(folder), "--at", "6", "--steps", "2").stdout


def test_decay_refuses_a_checkpoint_in_the_decay(references):
    folder = references.folder(steps=12, save_every=2, schedule=SCHEDULE)
    err = cli("decay", str(folder), "--at", "12", check=2).stderr
    assert err.strip() == ("error: decay --at 12: step 12 of tiny is in the decay; "
                           "the stable checkpoints are: 2, 4, 6, 8, 10")
    assert not (folder / "branches").exists()


@pytest.mark.parametrize("train, said", [
    ({"budgets": [8, 8]}, "train.budgets: 8 listed more than once; list each budget once"),
    ({"budgets": [3, 8]}, "train: 3 steps (train.budgets) are fewer than the warmup (2) plus the decay (2); make it at least 4"),
    ({"budgets": [8], "steps": 8}, "set either budgets or steps/epochs, not both"),
])
def test_bad_budgets_are_one_line_at_the_plan(tmp_path, tiny_model, train, said):
    project = make_project(tmp_path / "p", tiny_model)
    project.plan["train"].pop("steps")
    project.write(schedule=SCHEDULE, **train)
    err = cli("bake", str(project.plan_path), "--runs", str(tmp_path / "runs"), "--check", check=2).stderr
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny").exists()
