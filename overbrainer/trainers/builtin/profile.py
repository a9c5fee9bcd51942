"""``train.profile``: where a few steps of the built-in trainer spend their time.

config.yaml's ``profile`` (``{"start", "steps", "memory"}``) names a window of steps, counted
as the log counts them (from 1). torch.profiler records them (with the step before as its
warm-up, when this process runs that step), and the run folder's ``profile/`` gets:

    ops.txt          what the recorded steps ran, most time first: on a GPU by the time of
                     their kernels, on the CPU by their own time; above the table, the wall
                     time a step and, on a GPU, how much of it kernels kept the GPU busy (the
                     rest it waited for the host)
    trace.json.gz    the timeline, in Chrome's trace format (https://ui.perfetto.dev opens it)
    memory.pickle    with ``memory`` on CUDA: the allocator's history over the window
                     (https://pytorch.org/memory_viz); on any device ``memory`` adds memory
                     columns to ops.txt

Under several processes each writes its own (``ops-rank1.txt``, ``trace-rank1.json.gz``, ...).
A run resumed inside the window records the rest of it; a run stopped inside it writes what
it recorded. Recording changes no weight. Files are written whole (renamed into place): a
profile that is there is complete.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch

TRACE_VIEWER = "https://ui.perfetto.dev"
MEMORY_VIEWER = "https://pytorch.org/memory_viz"
TABLE_ROWS = 40


class Profile:
    """The window of steps to record, for the loop to call around each step."""

    def __init__(self, settings: dict | None, folder: Path, device: torch.device, rank: int, ranks: int, done: int,
                 max_steps: int):
        self.folder, self.device, self.max_steps = folder, device, max_steps
        self.suffix = f"-rank{rank}" if ranks > 1 else ""
        self.where = f"{device}" + (f" (rank {rank} of {ranks})" if ranks > 1 else "")
        self.prof = None
        self.current, self.mark = 0, 0.0  # the step under way while recording, and when it began
        self.recorded: list[int] = []  # the steps recorded so far
        self.walls: list[float] = []  # their wall times
        self.written: list[Path] = []
        window = range(settings["start"], settings["start"] + settings["steps"]) if settings else range(0)
        self.todo = [k for k in window if k > done]  # a resumed run records what is left
        self.memory = bool(settings and settings.get("memory"))
        # the step before the first recorded one warms the profiler up, when it runs here
        self.warmup = 1 if self.todo and self.todo[0] - 1 > done else 0
        self.begins = self.todo[0] - self.warmup if self.todo else None

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, kind, error, tb) -> None:
        # a stop, an error, or the end of the run inside the window: what was recorded is written
        self.finish(quiet=kind is not None)

    def before(self, step: int) -> float:
        """At the top of step `step` (from 1): the recording starts, moves on to this step or
        ends (a recorded step runs from its top to the next one's: its eval, samples and
        checkpoint with it). The seconds spent writing the profile (not training time)."""
        if self.prof is None:
            if step == self.begins:
                self._start()
                self.current, self.mark = step, time.perf_counter()
            return 0.0
        if step > self.todo[-1]:
            started = time.perf_counter()
            self.finish()
            return time.perf_counter() - started
        self._close_step()
        self.prof.step()
        self.current = step
        return 0.0

    def records(self, step: int) -> bool:
        """Whether step `step` is being recorded (its metrics line says so: it runs slower)."""
        return self.prof is not None and step in self.todo

    def finish(self, quiet: bool = False) -> None:
        """Stop recording and write the files (nothing when no step was recorded)."""
        if self.prof is None:
            return
        self._close_step()
        prof, self.prof = self.prof, None
        try:
            prof.stop()
            if self.recorded:
                self._write(prof)
        except Exception as e:  # noqa: BLE001 - a profile is never worth the run
            if not quiet:
                print(f"warning: the profile of {self._steps()} was not written: {e}", flush=True)
        finally:
            if self.memory and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with warnings.catch_warnings():
            # no warm-up step (a run resumed inside the window): torch's warning says what ops.txt does
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            when = schedule(wait=0, warmup=self.warmup, active=len(self.todo), repeat=1)
        self.prof = profile(activities=activities, schedule=when, record_shapes=True, profile_memory=self.memory)
        self._sync()
        self.prof.start()

    def _close_step(self) -> None:
        """The step under way is over: its wall time, when it is one of the window's."""
        self._sync()
        now = time.perf_counter()
        if self.current in self.todo and self.current not in self.recorded:
            self.recorded.append(self.current)
            self.walls.append(now - self.mark)
        self.mark = now

    # -- writing ------------------------------------------------------------------------

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.written = []
        self._atomic(f"trace{self.suffix}.json.gz", prof.export_chrome_trace)
        if self.memory and self.device.type == "cuda":
            self._atomic(f"memory{self.suffix}.pickle", torch.cuda.memory._dump_snapshot)
        self._atomic(f"ops{self.suffix}.txt", lambda path: Path(path).write_text(self._table(prof)))
        named = ", ".join(f"{self.folder.name}/{p.name}" for p in self.written)
        print(f"profiled {self._steps()} on {self.where}: {named} (timeline: {TRACE_VIEWER}"
              + (f"; memory: {MEMORY_VIEWER}" if self.memory and self.device.type == "cuda" else "") + ")", flush=True)

    def _atomic(self, name: str, write) -> None:
        path = self.folder / name
        tmp = self.folder / f".tmp-{name}"  # the trace's ".gz" ending kept: torch compresses by it
        write(str(tmp))
        os.replace(tmp, path)
        self.written.append(path)

    def _table(self, prof) -> str:
        events = prof.key_averages()
        n = len(self.recorded)
        wall = sum(self.walls) / n
        lines = [f"# {self._steps()} of {self.max_steps} on {self.where}, recorded "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC"
                 + ("" if self.warmup else " (no warm-up step before them: the first may look slower)"),
                 f"# {wall:.4f} s a step (wall)"]
        on_device = self.device.type == "cuda"
        if on_device:
            busy = sum(e.self_device_time_total for e in events) / 1e6 / n
            lines.append(f"# kernels {busy:.4f} s a step: the GPU busy {busy / wall:.0%} of the wall time "
                         "(the rest it waited for the host)")
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        lines.append(f"# the {TABLE_ROWS} operators with the most {'kernel' if on_device else 'own CPU'} time "
                     f"over the {n} step{'s' if n > 1 else ''}")
        return "\n".join(lines) + "\n" + events.table(sort_by=sort, row_limit=TABLE_ROWS, max_name_column_width=70) + "\n"

    def _steps(self) -> str:
        steps = self.recorded or self.todo
        return f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
