"""stop, resume and status racing a running bake: one trainer ever, run.json and stamps
never torn, every state one of the seven."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from functools import partial

import psutil
from helpers import cli

from overbrainer import Run
from overbrainer.journal import STATES
from overbrainer.portable.common import die_with_parent


def test_status_stop_and_resume_racing_a_bake(project, tmp_path, references):
    project.write(steps=40, save_every=10, eval_every=10)
    reference = references.folder(steps=40, save_every=10, eval_every=10)
    cli("bake", str(project.plan_path), "--detach")
    run = Run(tmp_path / "runs" / "tiny")
    seen, torn, stop = set(), [], threading.Event()

    def read_forever():
        while not stop.is_set():
            for path in [run.folder.run_json, *run.folder.stamps.glob("*.json")]:
                try:
                    text = path.read_text()
                except FileNotFoundError:
                    continue
                try:
                    json.loads(text)
                except ValueError:
                    torn.append(path.name)
            seen.add(run.state)
            # a few hundred looks a second: readers that spin would starve the trainer they
            # watch of one of the machine's two cores
            time.sleep(0.002)

    readers = [threading.Thread(target=read_forever) for _ in range(3)]
    for r in readers:
        r.start()
    try:
        for _ in range(3):  # stop and resume while it runs, and while it starts again
            deadline = time.monotonic() + 180
            while run.progress()["step"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            run.stop(wait=True, timeout=300)
            assert run.state == "stopped"
            run.resume()
            run.resume()  # a second resume of a run already starting starts nothing more
        run.wait(poll=0.2, show=False)
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert not torn
    assert seen <= set(STATES) and {"running", "stopped", "done"} <= seen
    attempts = run.status["attempts"]
    assert len(attempts) == 4 and all(a.get("end") for a in attempts)
    final = "checkpoints/step-000040/adapter_model.safetensors"
    assert (run.folder.root / final).read_bytes() == (reference / final).read_bytes()


def test_a_job_whose_bake_died_before_its_exec_never_runs(tmp_path):
    """A bake SIGKILLed between its fork of a job and the job's exec: the kernel has nobody
    to send the parent-death signal for, so the job itself looks and dies before it runs.
    (Simulated with a parent pid that is not its parent's; the real window is microseconds.)"""
    marker = tmp_path / "ran"
    not_the_parent = psutil.Process().ppid()
    child = subprocess.Popen(["touch", str(marker)], preexec_fn=partial(die_with_parent, not_the_parent))
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not marker.exists()
    child = subprocess.Popen(["touch", str(marker)], preexec_fn=partial(die_with_parent, os.getpid()))
    assert child.wait(timeout=30) == 0
    assert marker.exists()
