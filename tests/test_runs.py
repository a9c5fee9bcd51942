"""Runs of their own: detached processes, stop and resume, a process that died, one
trainer per folder, progress while it runs, and the Python API."""

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
from helpers import bake_json, cli, hold_at_step, stop_held, trainers_of

import overbrainer
from overbrainer import Run, journal

STEPS = 40


@pytest.fixture
def long_project(project):
    """The tiny plan, long enough to be caught running."""
    project.write(steps=STEPS, save_every=10, eval_every=10)
    return project


def until(predicate, timeout=180, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def final_weights(folder: Path) -> bytes:
    return (folder / f"checkpoints/step-{STEPS:06d}/adapter_model.safetensors").read_bytes()


@pytest.fixture
def reference(references):
    return references.folder(steps=STEPS, save_every=10, eval_every=10)


def test_detached_run_outlives_its_parent_and_shows_progress(long_project, tmp_path):
    started = time.monotonic()
    report = json.loads(cli("bake", str(long_project.plan_path), "--detach", "--json").stdout.splitlines()[-1])
    assert time.monotonic() - started < 60
    run = Run(report["folder"])
    # the command that started it has exited; the run goes on in its own session
    assert psutil.Process(report["pid"]).status() != psutil.STATUS_ZOMBIE
    assert os.getsid(report["pid"]) != os.getsid(0)
    until(lambda: run.progress()["step"] >= 3, what="three steps")
    progress = run.progress()
    assert progress["state"] in ("running", "stopping", "done") and progress["steps"] == STEPS
    assert progress["loss"] is not None
    records = run.records()
    assert records and records[0]["stage"] == "train"  # the job's stage event, then its steps
    assert [r for r in records if "step" in r][0]["step"] == 1
    table = run.metrics()
    assert table.num_rows == len(table.column("step").to_pylist()) >= 3
    status = json.loads(cli("status", report["folder"], "--json").stdout)
    assert status["process"]["pid"] == report["pid"] and status["where"] == "here"
    model = run.wait(poll=0.2, show=False)
    assert run.state == "done" and model.path == run.folder.baked
    assert run.progress()["step"] == STEPS and run.progress()["eta"] == 0.0
    assert run.checkpoints() == [10, 20, 30, 40]
    attempt = run.status["attempts"][-1]
    assert attempt["exit"] == 0 and attempt["reason"] == "done" and attempt["end"]


def test_stop_and_resume_twice_is_bitwise_equal(long_project, tmp_path, reference):
    runs = tmp_path / "stopped"
    cli("bake", str(long_project.plan_path), "--detach", "--runs", str(runs))
    run = Run(runs / "tiny")
    for at in (5, 22):
        trainers = hold_at_step(run.folder.root, at)
        stop = stop_held(run.folder.root, trainers, run.folder.stop_request)
        assert "stopped" in stop, stop
        assert run.state == "stopped" and run.status["reason"].startswith("stopped at step")
        step = run.checkpoints()[-1]
        assert step >= at and not trainers_of(run.folder.root)
        assert run.progress()["step"] == step  # metrics past the checkpoint are dropped on resume, never kept
        run.resume()
    run.wait(poll=0.2, show=False)
    assert run.state == "done"
    assert final_weights(run.folder.root) == final_weights(reference)
    assert len(run.status["attempts"]) == 3
    assert [a["reason"].split(" ")[0] for a in run.status["attempts"]] == ["stopped", "stopped", "done"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="start times since boot are read from /proc")
def test_a_step_of_the_wall_clock_leaves_a_live_run_running(tmp_path):
    """NTP stepping the clock, or a virtual machine resumed from a snapshot, moves every
    process's wall-clock create time at once: a live run must not then look dead."""
    me = journal.this_process()  # this test's process stands for the run's
    assert journal.alive(me) and isinstance(me["ticks"], int) and me["boot"]
    written_before_the_step = {**me, "create_time": me["create_time"] - 30}
    assert journal.alive(written_before_the_step)
    assert not journal.alive({**me, "ticks": me["ticks"] + 1})  # the same pid, reused by another process
    assert not journal.alive({**me, "boot": "another boot"})
    # run.json written so, as `overbrainer status` reads it from another process
    folder = tmp_path / "runs" / "tiny"
    Run(folder).update(state="running", process=written_before_the_step)
    status = json.loads(cli("status", str(folder), "--json").stdout)
    assert status["state"] == "running", status
    Run(folder).update(process={**written_before_the_step, "ticks": me["ticks"] + 1})
    status = json.loads(cli("status", str(folder), "--json").stdout)
    assert status["state"] == "failed" and status["reason"] == "process ended without saying so"


def test_killed_run_shows_failed_then_resumes(long_project, tmp_path, reference):
    runs = tmp_path / "killed"
    cli("bake", str(long_project.plan_path), "--detach", "--runs", str(runs))
    run = Run(runs / "tiny")
    until(lambda: run.progress()["step"] >= 12, what="step 12")
    supervisor = psutil.Process(run.status["process"]["pid"])
    os.killpg(os.getpgid(supervisor.pid), signal.SIGKILL)
    until(lambda: not trainers_of(run.folder.root), what="the trainer to die")
    # SIGKILL lands when the kernel gets to it: the trainer can be gone while the bake is not yet
    until(lambda: not journal.alive(run.status["process"]), what="the bake to die")
    status = json.loads(cli("status", str(run.folder.root), "--json").stdout)
    assert status["state"] == "failed" and status["reason"] == "process ended without saying so"
    assert "process ended without saying so" in cli("--runs", str(runs), "status").stdout
    again = bake_json(str(long_project.plan_path), "--runs", str(runs))
    assert again["state"] == "done" and "train" in again["ran"]
    assert final_weights(run.folder.root) == final_weights(reference)


def test_concurrent_bakes_run_one_trainer(long_project, tmp_path):
    runs = tmp_path / "race"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "overbrainer.cli", "bake", str(long_project.plan_path), "--runs", str(runs), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(3)
    ]
    folder = runs / "tiny"
    most = 0
    while any(p.poll() is None for p in procs):
        most = max(most, len(trainers_of(folder)))
        time.sleep(0.05)
    reports = [json.loads(p.stdout.read().splitlines()[-1]) for p in procs]
    assert most == 1
    assert all(r["state"] == "done" for r in reports), reports
    assert len(Run(folder).status["attempts"]) == 1  # the others never touched run.json
    assert (folder / "log.txt").read_text().count("training ") == 1


def test_python_api_bake_and_thread(long_project, tmp_path):
    run = overbrainer.bake(long_project.plan_path, runs=tmp_path / "api")
    assert isinstance(run, overbrainer.Run) and run.state in ("starting", "running", "stopping", "done")
    model = run.wait(poll=0.2, show=False)
    assert model.chat("hi", max_new_tokens=3) is not None
    assert [r.name for r in overbrainer.runs(tmp_path / "api")] == ["tiny"]
    # baking it again finds it done, and a checkpoint is a model
    again = overbrainer.bake(long_project.plan_path, runs=tmp_path / "api")
    assert again.state == "done" and len(again.status["attempts"]) == 1
    assert again.checkpoint(10).decayed is False and again.checkpoint().step == STEPS
    # in a thread of this process
    long_project.write(learning_rate=0.002)
    thread_run = overbrainer.run(tmp_path / "api" / "tiny")
    thread_run.start(process=False)
    thread_run.wait(poll=0.2, show=False)
    assert thread_run.state == "done" and thread_run.status["process"]["pid"] == os.getpid()
