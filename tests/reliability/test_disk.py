"""A full disk while a checkpoint is written: the previous checkpoint stays intact, the
run says so in one line, and once there is room again it resumes to the same weights. A
disk full to the last byte: one line too, never doit's traceback, never "done"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import hold_at_step, release


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_after_the_first_checkpoint(proc: subprocess.Popen, folder, disk, room: int) -> None:
    """Once checkpoint 10 is saved and the bake has drawn loss.png for it, fill `disk` but
    for `room` bytes, with the trainer held still meanwhile (it would reach checkpoint 20
    first on an idle machine, and the bake's drawing of loss.png would take the room on a
    busy one)."""
    trainers = hold_at_step(folder, 11)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "loss.png").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the bake did not draw loss.png at checkpoint 10"
            time.sleep(0.01)
        assert not (folder / "checkpoints" / "step-000020").exists()
        stat = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - room))
    finally:
        release(trainers)


def bake_and_fill(project, runs, disk, room: int) -> tuple[str, str, int]:
    """A foreground bake into `runs` on `disk`, filled after its first checkpoint
    (`fill_after_the_first_checkpoint`): its stdout, stderr and exit code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs", str(runs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    fill_after_the_first_checkpoint(proc, runs / "tiny", disk, room=room)
    out, err = proc.communicate(timeout=300)
    return out, err, proc.returncode


def test_full_disk_during_a_checkpoint(project, references, small_disk):
    project.write(steps=40, save_every=10, eval_every=10)
    reference = references.folder(steps=40, save_every=10, eval_every=10)

    runs = small_disk / "runs"
    out, err, code = bake_and_fill(project, runs, small_disk, room=24_000)
    assert code == 1, (out, err)
    first_line = err.strip().splitlines()[0]
    assert "no space left on the device while saving checkpoint" in first_line and "step-000010 is intact" in first_line
    assert "Traceback" not in err
    checkpoints = runs / "tiny" / "checkpoints"
    assert not any(p.name.startswith(".tmp") for p in checkpoints.iterdir())
    kept = (checkpoints / "step-000010" / "adapter_model.safetensors").read_bytes()
    assert kept == (reference / "checkpoints/step-000010/adapter_model.safetensors").read_bytes()

    (small_disk / "filler").unlink()
    # the finished run is much bigger than the tmpfs: only the training is checked here
    again = subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs", str(runs)],
        capture_output=True, text=True, timeout=300,
    )
    log = (runs / "tiny" / "log.txt").read_text()
    assert "resuming from step-000010" in log or "resuming from step-0000" in log
    final = checkpoints / "step-000040" / "adapter_model.safetensors"
    assert final.read_bytes() == (reference / "checkpoints/step-000040/adapter_model.safetensors").read_bytes(), again.stderr


def test_a_disk_full_to_the_last_byte_fails_in_one_line(project, small_disk):
    """No room even for a line of metrics or run.json: the bake fails saying what and where
    (doit's database, which it cannot save either, is a warning), with no traceback, and
    nothing is called done."""
    project.write(steps=40, save_every=10, eval_every=10)
    runs = small_disk / "runs"
    out, err, code = bake_and_fill(project, runs, small_disk, room=0)
    assert code != 0, (out, err)
    assert "Traceback" not in err and "sqlite3" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ("no space left" in errors[0] or "disk" in errors[0]), err
    (small_disk / "filler").unlink()
    status = json.loads(subprocess.run([sys.executable, "-m", "overbrainer.cli", "status", str(runs / "tiny"), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert status["state"] == "failed", status
    # no half-written checkpoint that a resume would take for a finished one
    kept = sorted(p.name for p in (runs / "tiny" / "checkpoints").iterdir())
    assert kept == ["step-000010"], kept
