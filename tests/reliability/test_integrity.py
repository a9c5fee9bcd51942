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
