"""Exact resume: a bake killed with SIGKILL anywhere in training, then rerun, ends with the
same weights, bit for bit, as one that was never killed (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    bake_json,
    can_build_the_kernel,
    cli,
    held,
    make_project,
    needs_cpp_compiler,
    trainers_of,
)

from overbrainer.portable.common import oom_kills

FINAL = "checkpoints/step-000008"


def bake_in(runs: Path, plan: Path) -> dict:
    return bake_json(str(plan), "--runs", str(runs))


def kill_bake_at(runs: Path, plan: Path, metric_lines: int) -> None:
    """Start a bake, SIGKILL it once metrics.jsonl has `metric_lines` lines."""
    metrics = runs / "tiny" / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(plan), "--foreground", "--runs", str(runs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= metric_lines:
            break
        assert proc.poll() is None, "the bake ended before it could be killed"
        time.sleep(0.02)
    children = psutil.Process(proc.pid).children(recursive=True)
    for child in reversed(children):  # the trainers first, frozen at once: a fast one would go on past the mark
        try:
            child.suspend()
        except psutil.Error:
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for child in children:  # thawed: one caught between fork and exec must still see its bake gone
        try:
            child.resume()
        except psutil.Error:
            pass
    # the trainer dies with the bake that started it: nobody is left writing the folder
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def weights(folder: Path) -> bytes:
    return (folder / FINAL / "adapter_model.safetensors").read_bytes()


def losses(folder: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]


def killed_then_rerun_ends_as(reference: Path, project, runs: Path) -> None:
    """The project's bake, SIGKILLed mid-training and rerun, trains again and ends with the
    reference's losses and adapter, bit for bit."""
    kill_bake_at(runs, project.plan_path, 5)
    report = bake_in(runs, project.plan_path)
    assert "train" in report["ran"]
    assert losses(runs / "tiny") == losses(reference)
    assert weights(runs / "tiny") == weights(reference)


@pytest.fixture
def reference(references):
    return references.folder()


@pytest.mark.parametrize("at", [1, 5])
def test_sigkill_then_rerun_is_bitwise_equal(project, tmp_path, reference, at):
    runs = tmp_path / "killed"
    kill_bake_at(runs, project.plan_path, at)
    folder = runs / "tiny"
    assert not (folder / ".stamps" / "train.json").exists()
    assert not (folder / FINAL).exists()
    report = bake_in(runs, project.plan_path)
    assert "train" in report["ran"]
    log = (folder / "log.txt").read_text()
    if at == 5:
        assert "resuming from step-000003" in log or "resuming from step-000006" in log
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)
    merged = (folder / "merged" / "model.safetensors").read_bytes()
    assert merged == (reference / "merged" / "model.safetensors").read_bytes()


def test_trainer_killed_is_a_failed_run_then_resumes(project, tmp_path, reference):
    runs = tmp_path / "crashed"
    metrics = runs / "tiny" / "metrics.jsonl"
    kills = oom_kills()
    proc = subprocess.Popen(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs", str(runs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert proc.poll() is None
        time.sleep(0.02)
    for child in psutil.Process(proc.pid).children(recursive=True):
        os.kill(child.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # one line: the signal, how far it got, what is kept
    first = err.splitlines()[0]
    if oom_kills() != kills:  # the OOM killer ended something else on this machine meanwhile
        assert first.startswith("error: training failed: the trainer was killed (SIGKILL) after step ")
    else:  # SIGKILL from outside, not the out-of-memory killer: its count did not move
        assert first.startswith("error: training failed: the trainer was killed by SIGKILL after step ")
        assert "out-of-memory" not in first
    kept = sorted(p.name for p in (runs / "tiny" / "checkpoints").glob("step-*"))
    if kept:
        assert f"{kept[-1]} is intact, and the same bake resumes from it" in first
    else:
        assert "no checkpoint was made yet: the same bake starts again" in first
    assert "Traceback" not in err
    assert not (runs / "tiny" / ".stamps" / "train.json").exists()
    bake_in(runs, project.plan_path)
    assert weights(runs / "tiny") == weights(reference)


def memory_cgroup(name: str, limit: int) -> Path | None:
    """A memory cgroup under this process's own, holding at most `limit` bytes (cgroup v1's
    memory.limit_in_bytes, or v2's memory.max), or None where this machine lets none be
    made (no memory controller mounted, or not ours to write)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    for mount in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = mount.split()
        kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if kind == "cgroup" and "memory" in options:  # v1
            path = next((v for k, v in own.items() if "memory" in k.split(",")), None)
            limit_file = "memory.limit_in_bytes"
        elif kind == "cgroup2" and "" in own:
            path, limit_file = own[""], "memory.max"
        else:
            continue
        folder = Path(fields[4]) / (path or "/").lstrip("/") / name
        try:
            folder.mkdir(exist_ok=True)
            (folder / limit_file).write_text(str(limit))
            if holds(folder, limit):
                return folder
        except OSError:
            pass
        try:
            folder.rmdir()
        except OSError:
            pass
    return None


def holds(group: Path, limit: int) -> bool:
    """Whether the kernel enforces the group's limit: a process in it that writes four
    times as much is killed (not, say, let swap)."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", f"b = b'x' * {4 * limit}"], timeout=120,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
    except subprocess.SubprocessError:  # the group refused it (preexec_fn's error)
        return False
    return probe.returncode == -signal.SIGKILL


def test_the_out_of_memory_killer_is_named_and_the_rerun_trains(project, tmp_path, reference):
    """A trainer that the kernel's out-of-memory killer ends: the bake says so in one line
    (what to lower, what is kept), the step stays undone, and the next bake trains the run
    to the same weights. The kill is real: the trainer is put, as it starts, into a memory
    cgroup holding 64 MiB, less than importing torch takes."""
    group = memory_cgroup(f"overbrainer-test-{os.getpid()}", 64 * 2**20)
    if group is None:
        pytest.skip("no memory cgroup can be made here (needs a writable cgroup v1 memory controller or v2)")
    runs = tmp_path / "oom"
    folder = runs / "tiny"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground", "--runs",
             str(runs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 300
        while not (trainers := trainers_of(folder)):
            assert proc.poll() is None and time.monotonic() < deadline, "no trainer started"
            time.sleep(0.001)
        with held(trainers):  # still at its first imports: the cgroup takes what it asks next
            for p in trainers:
                (group / "cgroup.procs").write_text(str(p.pid))
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            group.rmdir()  # empty once its process is gone
        except OSError:
            pass
    assert proc.returncode == 1
    first = err.splitlines()[0]
    assert first.startswith("error: training failed: the trainer was killed (SIGKILL) before its first step, "
                            "most likely by the kernel's out-of-memory killer (it ended a process meanwhile; "
                            "this machine has ")
    # before the first step it is the model's loading, not a micro-batch's activations
    assert first.endswith("no checkpoint was made yet: the same bake starts again; to need less, a smaller base, "
                          "or a machine with more memory")
    assert "Traceback" not in err
    assert not (folder / ".stamps" / "train.json").exists()
    bake_in(runs, project.plan_path)
    assert weights(folder) == weights(reference)


def test_partial_checkpoint_is_never_used(project, tmp_path, reference):
    """A temp checkpoint folder left by a kill mid-write is removed, not resumed from."""
    runs = tmp_path / "partial"
    kill_bake_at(runs, project.plan_path, 4)
    checkpoints = runs / "tiny" / "checkpoints"
    fake = checkpoints / ".tmp-step-000004-99999"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "adapter_model.safetensors").write_bytes(b"half a file")
    bake_in(runs, project.plan_path)
    assert not fake.exists()
    assert weights(runs / "tiny") == weights(reference)
    assert cli("bake", str(project.plan_path), "--runs", str(runs)).returncode == 0


def test_bf16_bake_computes_in_bf16_and_resumes_bitwise(project, tmp_path, references):
    """train.bf16: the frozen base in bf16, the adapter and its optimizer in float32;
    killed mid-training and rerun, it ends bit for bit where an uninterrupted bf16 bake does."""
    from safetensors import safe_open

    from overbrainer.trainers.builtin.device import cpu_has_bf16

    reference = references.folder(bf16=True)
    assert "computing in bf16" in (reference / "log.txt").read_text()
    # a CPU that emulates bf16 is named as the reason a bf16 run is slow
    assert ("no bf16 instructions" in (reference / "log.txt").read_text()) == (cpu_has_bf16() is False)
    with safe_open(reference / FINAL / "adapter_model.safetensors", "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float32"}
    assert weights(reference) != weights(references.folder(bf16=False))  # bf16 arithmetic is not fp32's
    project.write(bf16=True)
    killed_then_rerun_ends_as(reference, project, tmp_path / "killed")


def test_bf16_bake_through_the_cpu_kernels_resumes_bitwise(tmp_path, monkeypatch):
    """Heads of 16 in bf16 on the CPU: the C++ attention backward and loss where they run (the
    log says so). Killed mid-training and rerun, the bake ends bit for bit where an
    uninterrupted one does (each sequence's and key head's sums in one thread, the
    vocabulary's parts merged in one order); and its losses are those of the plain paths'
    bake (the Python backward, the compiled or eager loss), within bf16's rounding."""
    from tiny import make_tiny_llama

    project = make_project(tmp_path / "project", make_tiny_llama(tmp_path / "wide", hidden=64))
    project.write(bf16=True)
    bake_in(tmp_path / "reference", project.plan_path)
    reference = tmp_path / "reference" / "tiny"
    log = (reference / "log.txt").read_text()
    assert ("(the attention's backward and the loss: C++ kernels)" in log) == can_build_the_kernel()
    assert "kernels-community" not in log  # bitsandbytes' Hub fetch, on AVX-512 BF16 CPUs: quieted
    killed_then_rerun_ends_as(reference, project, tmp_path / "killed")
    monkeypatch.setenv("OVERBRAINER_CPU_KERNEL", "0")
    bake_in(tmp_path / "python", project.plan_path)
    python = tmp_path / "python" / "tiny"
    assert "C++ kernel" not in (python / "log.txt").read_text()
    ours, theirs = losses(reference), losses(python)
    assert [s for s, _ in ours] == [s for s, _ in theirs]
    assert all(abs(a - b) <= 0.02 * abs(b) for (_, a), (_, b) in zip(ours, theirs)), (ours, theirs)


def test_compiled_bake_resumes_bitwise(project, tmp_path, references):
    """train.compile (what "auto" turns on for a long bf16 LoRA on the CPU), with LoRA's
    dropout: killed mid-training and rerun, the new process compiles again and ends bit
    for bit where an uninterrupted compiled bake does."""
    needs_cpp_compiler()
    reference = references.folder(bf16=True, compile=True)
    assert "its decoder layers compiled" in (reference / "log.txt").read_text()
    project.write(bf16=True, compile=True)
    killed_then_rerun_ends_as(reference, project, tmp_path / "killed")
