"""run.json: a run's state, its process and its attempts, read by anyone and written by one
process at a time (under ``.run.lock``). The low level that both the bake driver, which
keeps the record while it bakes, and the `Run` API, which reads it and asks for a stop,
stand on::

    {
      "state": "running",          # planned starting queued running stopping stopped done failed
      "slurm_job": "1234",         # where.slurm: the batch job training it (queued: pending there)
      "where": "here",
      "plan_file": "/abs/plans/demo.json",
      "process": {"pid": 4242, "create_time": 1733150000.12, "host": "box"},
      "step": 18, "steps": 54,
      "task": "train",             # the step under way
      "stages": [["config", "train.learning_rate: 0.003 → 0.001"], ["train", "..."]],  # each step
                                   # this attempt began, with why: what a follower prints
      "reason": null,              # why it is stopped or failed, in words
      "result": {"ran": [...], "skipped": [...], "error": null, "kind": null, "log_tail": ""},
      "attempts": [{"start": "...", "end": "...", "pid": 4242, "exit": 0, "reason": "done"}]
    }

A process that ended without saying so (killed, crashed, the machine rebooted) is shown as
``failed`` with the reason `DIED`, never as running: the pid is checked together with its
create time, so a reused pid is not mistaken for the run.
"""

from __future__ import annotations

import json
import os
import socket

from .folder import RunFolder
from .fsio import write_atomic

__all__ = ["STATES", "ACTIVE", "FINAL", "DIED", "read", "status", "update", "this_process", "alive"]

STATES = ("planned", "starting", "queued", "running", "stopping", "stopped", "done", "failed")
ACTIVE = ("starting", "queued", "running", "stopping")
FINAL = ("stopped", "done", "failed")
DIED = "process ended without saying so"


def read(folder: RunFolder) -> dict:
    """run.json as it is on disk; {} when there is none (or it cannot be read)."""
    try:
        data = json.loads(folder.run_json.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def status(folder: RunFolder) -> dict:
    """run.json, with a process that ended without saying so shown as such."""
    data = read(folder)
    if not data:
        data = {"state": "planned" if folder.plan_json.exists() else "unknown"}
    if data.get("state") in ACTIVE and not alive(data.get("process")):
        data = {**data, "state": "failed", "reason": DIED}
    return data


def update(folder: RunFolder, _only_if: tuple[str, ...] | None = None, **fields) -> dict:
    """Change run.json: read, modify and write under a lock, so that a stop and the
    supervisor's step count never undo each other; with `_only_if`, only while the state
    is one of those (a stop that comes as the run ends must not turn its final state back
    into "stopping"). A stop asked stays asked: "stopping" is not turned into "running"."""
    import fcntl

    folder.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.run_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = read(folder)
        if _only_if is not None and data.get("state") not in _only_if:
            return data
        if data.get("state") == "stopping" and fields.get("state") in ("queued", "running"):
            fields = {k: v for k, v in fields.items() if k != "state"}
        data.update(fields)
        write_atomic(folder.run_json, json.dumps(data, indent=1) + "\n", fault="runjson:before-replace")
        return data
    finally:
        os.close(fd)


def this_process() -> dict:
    import psutil

    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()}


def alive(process: dict | None) -> bool:
    """Whether the process a run.json names is still the one that wrote it."""
    if not process:
        return False
    import psutil

    if process.get("host") not in (None, socket.gethostname()):
        return True  # another machine's process: this one cannot tell
    try:
        p = psutil.Process(process["pid"])
        return abs(p.create_time() - process["create_time"]) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError):
        return False
