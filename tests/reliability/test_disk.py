"""A full disk while a checkpoint is written: the previous checkpoint stays intact, the
run says so in one line, and once there is room again it resumes to the same weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_a_checkpoint(project, references, small_disk):
    project.write(steps=40, save_every=10, eval_every=10)
    reference = references.folder(steps=40, save_every=10, eval_every=10)

    runs = small_disk / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs", str(runs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    first = runs / "tiny" / "checkpoints" / "step-000010" / "meta.json"
    while not first.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    # fill the disk but for a little room: logs fit, the next checkpoint does not
    filler = small_disk / "filler"
    stat = os.statvfs(small_disk)
    filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - 24_000))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out, err)
    first_line = err.strip().splitlines()[0]
    assert "no space left on the device while saving checkpoint" in first_line and "step-000010 is intact" in first_line
    assert "Traceback" not in err
    checkpoints = runs / "tiny" / "checkpoints"
    assert not any(p.name.startswith(".tmp") for p in checkpoints.iterdir())
    kept = (checkpoints / "step-000010" / "adapter_model.safetensors").read_bytes()
    assert kept == (reference / "checkpoints/step-000010/adapter_model.safetensors").read_bytes()

    filler.unlink()
    # the finished run is much bigger than the tmpfs: only the training is checked here
    again = subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs", str(runs)],
        capture_output=True, text=True, timeout=300,
    )
    log = (runs / "tiny" / "log.txt").read_text()
    assert "resuming from step-000010" in log or "resuming from step-0000" in log
    final = checkpoints / "step-000040" / "adapter_model.safetensors"
    assert final.read_bytes() == (reference / "checkpoints/step-000040/adapter_model.safetensors").read_bytes(), again.stderr
