"""The tampering matrix: damage each file of a finished run in turn — doit's database, each
stamp, run.json, each file of the last checkpoint, metrics, config, examples, merged, baked —
with random bytes of the same size, by cutting it in half, or by deleting it; then bake again.

Every case ends either bitwise equal to the untouched run (the final adapter, the merged and
the baked weights) with every step's stamp matching its outputs, or with one clear line and an
exit code other than 0. It never reports done over a missing or damaged target.

A fast subset runs by default; ``pytest --tamper-matrix`` runs every case.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import cli

from overbrainer.graph.driver import compile_bake
from overbrainer.graph.tasks import STEPS
from overbrainer.steps import check

FINAL = "checkpoints/step-000008"
FILES = [
    ".doit.db",
    *(f".stamps/{m.NAME}.json" for m in STEPS),
    "run.json",
    "plan.json",
    f"{FINAL}/adapter_model.safetensors",
    f"{FINAL}/adapter_config.json",
    f"{FINAL}/trainer_state.pt",
    f"{FINAL}/meta.json",
    "checkpoints/step-000006/trainer_state.pt",
    "metrics.jsonl",
    "config.yaml",
    "examples.parquet",
    "merged/model.safetensors",
    "merged/config.json",
    "baked/model.safetensors",
    "baked/README.md",
]
DAMAGES = ("garbage", "truncate", "delete")
FAST = {(".doit.db", "garbage"), ("run.json", "garbage"), (".stamps/merge.json", "truncate"),
        ("baked/model.safetensors", "delete")}
COMPARED = (f"{FINAL}/adapter_model.safetensors", "merged/model.safetensors", "baked/model.safetensors")


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
        return
    size = path.stat().st_size
    path.write_bytes(os.urandom(size) if how == "garbage" else path.read_bytes()[: size // 2])


def every_step_matches(plan: Path, runs: Path) -> None:
    compiled = compile_bake(plan, runs=runs)
    for module in STEPS:
        status = check(compiled, module)
        assert status.up_to_date, (module.NAME, status.reason)


@pytest.mark.parametrize(
    "name, how",
    [pytest.param(f, d, marks=[] if (f, d) in FAST else [pytest.mark.full_tamper_matrix]) for f in FILES for d in DAMAGES],
    ids=[f"{f}:{d}" for f in FILES for d in DAMAGES],
)
def test_a_tampered_run_ends_equal_or_with_one_line(baked_copy, references, tmp_path, record_property, name, how):
    project = baked_copy()
    reference = references.folder()
    runs = tmp_path / "runs"
    folder = runs / "tiny"
    damage(folder / name, how)
    proc = cli("bake", str(project.plan_path), "--foreground", "--json", check=None)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "done" != report.get("state"), proc.stderr
        record_property("outcome", f"refused: {errors[0]}")  # the README's figures: --junitxml
        return
    assert report["state"] == "done", report
    for compared in COMPARED:
        assert (folder / compared).read_bytes() == (reference / compared).read_bytes(), compared
    every_step_matches(project.plan_path, runs)
    record = json.loads((folder / "run.json").read_text())
    assert record["state"] == "done" and record["attempts"][-1]["exit"] == 0
    record_property("outcome", f"equal; reran {','.join(report['ran']) or 'nothing'}")
