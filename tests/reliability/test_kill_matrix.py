"""The kill matrix: SIGKILL a bake at many points — in split, at training steps, while a
checkpoint is written (between its files, before its rename), during merge and bake,
while run.json and stamps are written — then bake again. Every case must finish with the
final adapter and merged weights bitwise equal to an uninterrupted bake, lose no completed
checkpoint, and never take a half-written file for finished.

A fast subset runs by default; ``pytest --kill-matrix`` runs every case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overbrainer.graph.driver import compile_bake
from overbrainer.graph.tasks import STEPS
from overbrainer.stamps import read_stamp
from overbrainer.steps import check
from overbrainer.trainers import checkpoint as ckpt

# one case of each kind of place; a kill between training steps is the one tests/test_resume.py
# already makes at every run (steps 1 and 5), so it is left to the full matrix
FAST = {
    ("split:before-rename", 1),
    ("checkpoint:between-files", 2),
    ("checkpoint:before-rename", 1),
    ("merge:before-rename", 1),
    ("stamp:before-replace", 4),
}
CASES = [
    ("split:before-rename", 1),
    ("stamp:before-replace", 1),
    ("stamp:before-replace", 2),
    ("stamp:before-replace", 3),
    ("stamp:before-replace", 4),
    ("stamp:before-replace", 5),
    ("stamp:before-replace", 6),
    ("stamp:before-replace", 7),
    ("runjson:before-replace", 1),
    ("runjson:before-replace", 3),
    ("runjson:before-replace", 9),
    ("checkpoint:between-files", 1),
    ("checkpoint:between-files", 2),
    ("checkpoint:before-rename", 1),
    ("checkpoint:before-rename", 3),
    ("train:step", 1),
    ("train:step", 3),
    ("train:step", 5),
    ("train:step", 8),
    ("merge:before-rename", 1),
    ("bake:before-rename", 1),
]
FINAL = "checkpoints/step-000008"


@pytest.fixture
def plan(project) -> Path:
    return project.plan_path


def bake(plan: Path, runs: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OVERBRAINER_FAULT"}
    if fault:
        env["OVERBRAINER_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(plan), "--foreground", "--runs", str(runs)],
        capture_output=True, text=True, env=env, timeout=600,
    )


@pytest.fixture
def reference(references) -> Path:
    return references.folder()


def finished_checkpoints(folder: Path) -> dict[int, dict]:
    return {step: ckpt.read_meta(p)["files"] for step, p in ckpt.complete(folder / "checkpoints")}


def assert_nothing_half_done_passes(plan: Path, runs: Path) -> None:
    """Every step with a stamp must still be up to date: a stamp never covers a torn output."""
    compiled = compile_bake(plan, runs=runs)
    for module in STEPS:
        if read_stamp(compiled.folder.stamp(module.NAME)) is not None:
            status = check(compiled, module)
            assert status.up_to_date, (module.NAME, status.reason)


@pytest.mark.parametrize(
    "point, nth",
    [pytest.param(p, n, marks=[] if (p, n) in FAST else [pytest.mark.full_matrix]) for p, n in CASES],
    ids=[f"{p}@{n}" for p, n in CASES],
)
def test_killed_bake_finishes_bitwise_equal(plan, reference, tmp_path, point, nth):
    runs = tmp_path / "runs"
    killed = bake(plan, runs, fault=f"{point}@{nth}")
    # the bake itself was killed (-9), or it saw its trainer killed and said so (1)
    assert killed.returncode in (-9, 1), (killed.returncode, killed.stderr)
    if killed.returncode == 1:
        assert "training failed" in killed.stderr and "Traceback" not in killed.stderr.splitlines()[0]
    folder = runs / "tiny"
    assert_nothing_half_done_passes(plan, runs)
    before = finished_checkpoints(folder) if folder.exists() else {}

    again = bake(plan, runs)
    assert again.returncode == 0, again.stderr
    after = finished_checkpoints(folder)
    for step, files in before.items():
        assert after.get(step) == files, f"checkpoint {step} was lost or changed"
    for name in (f"{FINAL}/adapter_model.safetensors", "merged/model.safetensors", "baked/model.safetensors"):
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name
    assert not any(p.name.startswith(".tmp") for p in (folder / "checkpoints").iterdir())
