"""No false success, no clobbering: a damaged doit database, two plans that want one run
folder, and an archive that ``overbrainer import`` must bound before it writes anything."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import bake_json, cli


def test_a_damaged_doit_database_never_reports_done_over_a_missing_target(baked_copy, tmp_path):
    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    reference = (folder / "baked" / "model.safetensors").read_bytes()
    (folder / ".doit.db").write_bytes(os.urandom(5000))
    shutil.rmtree(folder / "baked")
    proc = cli("bake", str(project.plan_path), "--foreground", "--json", check=0)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Traceback" not in proc.stderr + proc.stdout
    assert report["state"] == "done" and "bake" in report["ran"], report
    assert (folder / "baked" / "model.safetensors").read_bytes() == reference
    warnings = [line for line in proc.stderr.splitlines() if ".doit.db" in line]
    assert len(warnings) == 1 and "rebuilt from the stamps" in warnings[0], proc.stderr
    run = json.loads((folder / "run.json").read_text())
    assert run["attempts"][-1]["exit"] == 0 and run["state"] == "done"


def test_two_plan_files_with_one_name_never_share_a_run_folder(baked_copy, tmp_path):
    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    baked = (folder / "baked" / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(project.root, other, symlinks=True)
    plan = json.loads((other / "plan.json").read_text())
    plan["train"]["learning_rate"] = 0.001
    (other / "plan.json").write_text(json.dumps(plan))
    stamps = {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()}

    for command in (("bake", "--foreground"), ("bake",), ("split",)):
        proc = cli(*command[:1], str(other / "plan.json"), *command[1:], check=2)
        (line,) = proc.stderr.strip().splitlines()
        assert "Traceback" not in line and str(project.plan_path.relative_to(tmp_path)) in line, line
        assert str((other / "plan.json").relative_to(tmp_path)) in line and "--force" in line, line
    assert {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()} == stamps
    assert (folder / "baked" / "model.safetensors").read_bytes() == baked

    # the same file, moved: the same plan
    moved = tmp_path / "moved"
    project.root.rename(moved)
    assert bake_json(str(moved / "plan.json"), "--foreground")["ran"] == []
    # the same file, edited: the same plan, validated again and rebaked
    (moved / "plan.json").write_text(json.dumps(plan))
    assert "config" in bake_json(str(moved / "plan.json"), "--check", check=1)["would_run"]
    # another file, taken over on purpose; from then on it owns the folder
    report = bake_json(str(other / "plan.json"), "--foreground", "--force")
    assert report["state"] == "done" and "train" in report["ran"]
    run = json.loads((folder / "run.json").read_text())
    assert run["plan_file"] == str((other / "plan.json").resolve())
    plan["train"]["learning_rate"] = 0.002
    (moved / "plan.json").write_text(json.dumps(plan))
    proc = cli("bake", str(moved / "plan.json"), "--foreground", check=2)
    assert "--force" in proc.stderr


@pytest.mark.parametrize("names", [("ü.json", "é.json"), ("a b.json", "a-b.json")])
def test_default_names_of_different_files_differ(tmp_path, names):
    from overbrainer.folder import default_name

    first, second = (default_name(tmp_path / n) for n in names)
    assert first != second and first.isascii() and second.isascii()
    assert default_name(tmp_path / "demo.json") == "demo"
