"""The helpers every process of a run shares, with or without overbrainer installed.

This module is the one copy of each: the package imports them from here, and so do the
job runner (``runner.py``) and the Axolotl plugin (``axolotl_plugin.py``), which run where
overbrainer may not be installed. Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from . import faults

__all__ = [
    "NO_METRICS_EXIT", "METRICS", "LOG", "STOP", "STOPPED", "TRAINER_ERROR", "META", "now", "die_with_parent", "write_atomic", "write_json", "read_json", "read_json_lines",
    "fsync_dir", "fsync_tree", "log_line", "append_log", "has_metric_line", "truncate_metrics", "phase_of", "run_commands",
    "proc_start", "oom_kills", "signal_name", "cpu_flags", "cpu_has_amx",
]

NO_METRICS_EXIT = 86  # the job ended well but wrote no metric line (its plugin did not load)

# the run-folder files that processes without overbrainer read or write (``folder.py``
# names the others, and lists them all)
METRICS = "metrics.jsonl"  # one line per logged step, and stage events
LOG = "log.txt"  # the trainer's own output
STOP = "stop"  # a stop request: save a checkpoint at the next step and end
STOPPED = "stopped.json"  # the trainer stopped early, on request
TRAINER_ERROR = "trainer-error.txt"  # one line: why the trainer gave up
META = "meta.json"  # a checkpoint's sidecar, written last: with it the checkpoint is whole


def proc_start(pid: int) -> tuple[str | None, int | None]:
    """(state, start time in clock ticks since boot) of process `pid`, from /proc/PID/stat
    (Linux): the start time names a process across pid reuse, and no change of the wall
    clock moves it. (None, None) where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None, None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot (Linux's
    ``/proc/vmstat`` ``oom_kill``, 4.13 and later), or None where it does not say. A job
    that died of SIGKILL while this count rose was, most likely, one of them."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """This CPU's feature flags (Linux's /proc/cpuinfo: "flags" on x86, "Features" on Arm);
    None where it cannot tell (no /proc/cpuinfo: macOS, Windows)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags or None


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has Intel AMX's bf16 tiles (Sapphire Rapids and newer Xeons), where
    bf16 training measured 1.6-2.2x float32's speed (bench section 4): train.bf16 "auto" there."""
    return "amx_bf16" in (cpu_flags(cpuinfo) or ())


def signal_name(code: int) -> str | None:
    """The signal that ended a process, from its exit code as `subprocess` (-9) or a shell
    (137) gives it; None for an ordinary exit."""
    number = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else 0
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return f"signal {number}"


def now() -> str:
    """The time, as every file of a run records it (UTC, ISO 8601, seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def die_with_parent(parent: int | None = None) -> None:
    """Linux: this process gets SIGKILL when the one that started it dies, so that a killed
    bake never leaves a trainer writing the run folder behind it (the signal is not
    inherited across fork: each launcher's children call it again). With `parent`, the pid
    that started this one, it also dies at once if that one died before the signal was set
    (a bake killed between its fork and the child's exec: nobody would send it)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


# -- files that readers never see torn -----------------------------------------------------


def write_atomic(path: str | os.PathLike, data: bytes | str, fault: str | None = None, durable: bool = True) -> None:
    """Write a file so that readers see the old content or the new, never a torn one: a
    temp file beside it, fsynced (unless not `durable`: a cache, which losing costs a
    rehash), then renamed over it. `fault` names the fault point between the two
    (``faults.py``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:  # a full disk: no torn temp file left, and the error names the file
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if e.filename is None or e.filename == str(tmp):
            # the temp file is this function's, not the user's: name what they can fix, the
            # folder that refuses new files, or the file that did not fit
            e.filename = str(path.parent if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else path)
        raise
    if fault:
        faults.point(fault)
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, value, fault: str | None = None) -> None:
    write_atomic(path, json.dumps(value, indent=1) + "\n", fault=fault)


def read_json(path: str | os.PathLike):
    """The JSON in `path`, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON Lines file, in file order: a line that is not a whole JSON
    object (torn by a kill, still being written) left out; [] when it cannot be read."""
    try:
        lines = _lines(Path(path))
    except OSError:
        return []
    out = []
    for raw in lines:
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file under `folder` on disk, and the folders that name them."""
    for root, _dirs, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def log_line(message: str) -> str:
    """A line the supervisor writes into a run's log.txt between the trainer's own output."""
    return f"--- {now()} {message}\n"


def append_log(log: Path, message: str) -> None:
    with open(log, "a") as f:
        f.write(log_line(message))


# -- metrics.jsonl -------------------------------------------------------------------------


def has_metric_line(path: Path) -> bool:
    try:
        return any('"step"' in line for line in _lines(path))
    except OSError:
        return False


def truncate_metrics(path: Path, step: int) -> int | None:
    """Drop metric lines past `step`, the checkpoint a resume starts from (they will be
    logged again). Stage events stay; a line torn by a kill, or garbled, goes. The last
    step that stays, or None."""
    if not path.exists():
        return None
    keep, last = [], None
    for raw in _lines(path):
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a line torn by a kill
        if not isinstance(record, dict):
            continue
        if "step" not in record or record["step"] <= step:
            keep.append(raw)
            last = record.get("step", last)
    write_atomic(path, "".join(k + "\n" for k in keep))
    return last


def _lines(path: Path) -> list[str]:
    # a byte that is no UTF-8 (a damaged file) spoils its line, not the file
    return path.read_bytes().decode("utf-8", errors="replace").splitlines()


def phase_of(step_index: int, warmup: int, stable: int) -> str:
    """The schedule phase (warmup, stable, decay) of the 0-based optimizer step `step_index`."""
    if step_index < warmup:
        return "warmup"
    if step_index < warmup + stable:
        return "stable"
    return "decay"


# -- a job's commands ----------------------------------------------------------------------


def run_commands(
    commands: list[list[str]],
    run_dir: Path,
    env: dict[str, str],
    log: Path,
    *,
    metrics_file: str,
    stages: list[str] | None = None,
    stop_marker: str | None = None,
    metrics_required: bool = False,
    poll: Callable[[], None] | None = None,
) -> int:
    """Run a trainer's commands one after the other in the run folder, the way every
    target does (here, in a bundle, over ssh); the first non-zero exit code, or 0.

    A stage event goes into the metrics file before each command; the commands after the
    first are skipped once the stop marker exists (a stopped job is not merged); a job
    that ends well without a metric line fails with `NO_METRICS_EXIT` when the trainer
    requires one. "python" is this interpreter. Each command dies with this process, and
    its output is appended to `log`. `poll` is called about 5 times a second while one
    runs. An OSError starting a program is raised as it is."""
    import subprocess  # here, not at the top: the up-to-date check imports this module

    metrics = run_dir / metrics_file
    stages = stages or []
    for i, command in enumerate(commands):
        if i > 0 and stop_marker and (run_dir / stop_marker).exists():
            break  # stopped early with a snapshot: nothing after training runs
        if stages:
            with open(metrics, "a") as f:
                f.write(json.dumps({"stage": stages[i], "time": now()}) + "\n")
        program, *args = command
        argv = [sys.executable if program == "python" else program, *args]
        with open(log, "ab") as out:
            out.write(log_line(" ".join(argv)).encode())
            out.flush()
            proc = subprocess.Popen(argv, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=partial(die_with_parent, os.getpid()))
            code = _wait(proc, poll)
        if code != 0:
            return code
    stopped = bool(stop_marker) and (run_dir / stop_marker).exists()
    if metrics_required and not stopped and not has_metric_line(metrics):
        with open(log, "a") as f:
            f.write("the job ended without writing a metric line: its metrics plugin did not load\n")
        return NO_METRICS_EXIT
    return 0


def _wait(proc, poll: Callable[[], None] | None) -> int:
    if poll is None:
        return proc.wait()
    while True:
        code = proc.poll()
        poll()
        if code is not None:
            return code
        time.sleep(0.2)
