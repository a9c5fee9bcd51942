"""Where a job runs. ``here``: a local process, its output appended to the run's log.txt.

A target runs a trainer's commands one after the other in the run folder, writing a stage
event into the metrics file before each; it skips the commands after the first once the
trainer's stop marker exists (a stopped job is not merged), and fails a job that exits 0
without a single metric line when the trainer requires one (its plugin did not load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from .trainers.protocol import Trainer

__all__ = ["Here", "NO_METRICS_EXIT"]

NO_METRICS_EXIT = 86  # the job ended well but wrote no metric line


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def has_metric_line(path: Path) -> bool:
    try:
        return any('"step"' in line for line in path.read_text().splitlines())
    except OSError:
        return False


class Here:
    """Run the job on this machine, as a child that dies with the process baking it."""

    name = "here"

    def resolve(self, command: list[str]) -> list[str]:
        program, *args = command
        if program == "python":
            return [sys.executable, *args]
        return [program, *args]

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        """Run every command of the job; the first non-zero exit code, or 0."""
        root = str(run_dir)
        trainer.prepare(run_dir, root)
        full_env = {**os.environ, **trainer.env(root), **env}
        metrics = run_dir / trainer.metrics_file()
        marker = trainer.stop_marker()
        stages = trainer.stages()
        for i, command in enumerate(trainer.commands()):
            if i > 0 and marker and (run_dir / marker).exists():
                break  # stopped early with a snapshot: nothing after training runs
            if stages:
                with open(metrics, "a") as f:
                    f.write(json.dumps({"stage": stages[i], "time": _now()}) + "\n")
            code = self._run_one(self.resolve(command), run_dir, full_env, log, poll)
            if code != 0:
                return code
        if trainer.metrics_required() and not (marker and (run_dir / marker).exists()) and not has_metric_line(metrics):
            with open(log, "a") as f:
                f.write("the job ended without writing a metric line: its metrics plugin did not load\n")
            return NO_METRICS_EXIT
        return 0

    def _run_one(self, command: list[str], cwd: Path, env: dict, log: Path, poll: Callable[[], None]) -> int:
        with open(log, "ab") as out:
            out.write(f"--- {_now()} {' '.join(command)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )
            while True:
                code = proc.poll()
                poll()
                if code is not None:
                    return code
                time.sleep(0.2)


def _die_with_parent() -> None:
    """Linux: the job gets SIGKILL when the process that started it dies, so that a killed
    bake never leaves a trainer writing the run folder behind it."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
