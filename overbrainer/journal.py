"""run.json: a run's state, its process and its attempts, read by anyone and written by one
process at a time (under ``.run.lock``). The low level that both the bake driver, which
keeps the record while it bakes, and the `Run` API, which reads it and asks for a stop,
stand on::

    {
      "state": "running",          # planned starting queued running stopping stopped done failed
      "slurm_job": "1234",         # where.slurm: the batch job this bake follows (queued: pending there)
      "slurm_jobs": {"train": "1234", "merge": "1235"},  # the last job of each step sent there
      "where": "here",
      "plan_file": "/abs/plans/demo.json",
      "process": {"pid": 4242, "create_time": 1733150000.12, "host": "box",
                  "boot": "5c1e...", "ticks": 2574683},  # Linux: since boot, in clock ticks
      "step": 18, "steps": 54,
      "task": "train",             # the step under way
      "stages": [["config", "train.learning_rate: 0.003 → 0.001"], ["train", "..."]],  # each step
                                   # this attempt began, with why: what a follower prints
      "reason": null,              # why it is stopped or failed, in words
      "result": {"ran": [...], "skipped": [...], "error": null, "kind": null, "log_tail": ""},
      "attempts": [{"start": "...", "end": "...", "pid": 4242, "exit": 0, "reason": "done"}]
    }

A process that ended without saying so (killed, crashed, the machine rebooted) is shown as
``failed`` with the reason `DIED`, never as running: the pid is checked together with when
it started, so a reused pid is not mistaken for the run. On Linux that is the kernel's
start time in clock ticks since boot (and the boot's id), which a change of the wall clock
does not move: NTP stepping the clock, or a virtual machine resumed from a snapshot, moves
every process's ``create_time`` at once, and a bake must not then call its own live run
dead. Elsewhere it is ``create_time``, to the second.
"""

from __future__ import annotations

import json
import os
import socket

from .errors import RunStateError
from .folder import RunFolder
from .fsio import write_atomic
from .portable.common import proc_start

__all__ = ["STATES", "ACTIVE", "FINAL", "DIED", "Damaged", "read", "load", "status", "update", "this_process", "alive",
           "problem", "no_run"]

STATES = ("planned", "starting", "queued", "running", "stopping", "stopped", "done", "failed")
ACTIVE = ("starting", "queued", "running", "stopping")
FINAL = ("stopped", "done", "failed")
DIED = "process ended without saying so"


class Damaged(RunStateError):
    """run.json cannot be read, or holds what no overbrainer wrote."""


def read(folder: RunFolder) -> dict:
    """run.json as it is on disk, for the one process that writes it next: {} when there is
    none, or when it is damaged (the writer makes it whole again)."""
    try:
        return load(folder)
    except Damaged:
        return {}


def load(folder: RunFolder) -> dict:
    """run.json, checked (`problem`): {} when there is none; `Damaged` (one line, with the
    repair) when it cannot be read or a field has the wrong type."""
    try:
        text = folder.run_json.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no run there (yet): the caller says why
        return {}
    except OSError as e:
        raise Damaged(f"{folder.run_json} cannot be read ({e.strerror or e}); fix its permissions") from None
    try:
        data = json.loads(text)
        why = problem(data)
    except (ValueError, RecursionError) as e:
        why = f"not JSON ({str(e).split(':')[0]})" if text.strip() else "empty"
    if why:
        raise Damaged(f"{folder.run_json} is damaged: {why}; `overbrainer status --repair {folder.root}` "
                      "rebuilds it from the stamps and checkpoints")
    return data


_TYPES = {
    "state": (str,), "where": (str,), "plan_file": (str,), "plan_hash": (str,), "reason": (str, type(None)),
    "task": (str, type(None)), "step": (int, type(None)), "steps": (int, type(None)), "slurm_job": (str, int, type(None)),
    "slurm_jobs": (dict,),
    "process": (dict, type(None)), "result": (dict, type(None)), "attempts": (list,), "stages": (list,),
    "trackers": (dict,),
}


def problem(data) -> str | None:
    """What is wrong with run.json's content `data`, in a few words; None when nothing."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for key, types in _TYPES.items():
        if key in data and (not isinstance(data[key], types) or isinstance(data[key], bool)):
            return f'"{key}" is {json.dumps(data[key])[:40]}, not {" or ".join(_TYPE_WORDS[t] for t in types)}'
    if "state" not in data:
        return '"state" is missing'
    if data["state"] not in STATES:
        return f'"state" is {json.dumps(data["state"])[:40]}, not one of {", ".join(STATES)}'
    process = data.get("process")
    if process is not None and not (isinstance(process.get("pid"), int) and
                                    isinstance(process.get("create_time"), (int, float))):
        return '"process" lacks a pid and create_time'
    if not all(isinstance(a, dict) for a in data.get("attempts", [])):
        return '"attempts" holds something else than objects'
    return None


def no_run(folder: RunFolder) -> RunStateError | None:
    """The error for a folder that is no run (neither run.json nor plan.json), or None."""
    if folder.run_json.exists() or folder.plan_json.exists():
        return None
    return RunStateError(f"{folder.root} is not a run folder (no run.json or plan.json); give a run folder "
                         "(runs/NAME), a run name or its plan file")


_TYPE_WORDS = {str: "a string", int: "a whole number", dict: "an object", list: "a list", type(None): "null"}


def status(folder: RunFolder) -> dict:
    """run.json, checked (`load`), with a process that ended without saying so shown as
    such; "unknown" for a folder with neither run.json nor plan.json (`no_run` says so)."""
    data = load(folder)
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
    record = {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()}
    boot, ticks = _boot_id(), proc_start(me.pid)[1]
    if boot and ticks is not None:
        record.update(boot=boot, ticks=ticks)
    return record


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def alive(process: dict | None) -> bool:
    """Whether the process a run.json names is still the one that wrote it."""
    if not process:
        return False
    import psutil

    if process.get("host") not in (None, socket.gethostname()):
        return True  # another machine's process: this one cannot tell
    try:
        p = psutil.Process(process["pid"])
        if isinstance(process.get("ticks"), int) and process.get("boot"):
            same = process["boot"] == _boot_id() and proc_start(p.pid)[1] == process["ticks"]
        else:  # not Linux, or written by an older overbrainer: the wall clock's create time
            same = abs(p.create_time() - process["create_time"]) < 1.0
        return same and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError):
        return False
