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
MEMORY_ENTRIES = 100_000  # allocations kept in memory.pickle's history (the viewer's own example's number)


class Profile:
    """The window of steps to record, for the loop to call around each step. Nothing in it
    is worth the run: a profiler that cannot start or write says so and training goes on."""

    def __init__(self, settings: dict | None, folder: Path, device: torch.device, rank: int, ranks: int, done: int,
                 max_steps: int):
        self.folder, self.device, self.rank, self.max_steps = folder, device, rank, max_steps
        self.suffix = f"-rank{rank}" if ranks > 1 else ""
        self.where = f"{device}" + (f" (rank {rank} of {ranks})" if ranks > 1 else "")
        self.prof = None
        self.current, self.mark = 0, 0.0  # the step under way while recording, and when it began
        self.recorded: list[int] = []  # the steps recorded so far
        self.walls: list[float] = []  # their wall times
        window = range(settings["start"], settings["start"] + settings["steps"]) if settings else range(0)
        self.todo = [k for k in window if k > done]  # a resumed run records what is left
        self.memory = bool(settings and settings.get("memory"))
        self.cuda_memory = self.memory and device.type == "cuda"
        # the step before the first recorded one warms the profiler up, when it runs here
        self.warmup = 1 if self.todo and self.todo[0] - 1 > done else 0
        self.begins = self.todo[0] - self.warmup if self.todo else None

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, kind, error, tb) -> None:
        # a stop, an error, or the end of the run inside the window: what was recorded is
        # written (after an error, without the step it broke off)
        self.finish(failed=kind is not None)

    def before(self, step: int) -> float:
        """At the top of step `step` (from 1): the recording starts, moves on to this step or
        ends (a recorded step runs from its top to the next one's: its evaluation, samples
        and checkpoint with it, when it has them). The seconds the profiler took to start or
        to write its files: not training time."""
        began = time.perf_counter()
        if self.prof is None:
            if step == self.begins:
                self._start()
                self.current, self.mark = step, time.perf_counter()
                return self.mark - began
            return 0.0
        if step > self.todo[-1]:
            self.finish()
            return time.perf_counter() - began
        self._close_step()
        try:
            self.prof.step()
        except Exception as e:  # noqa: BLE001 - a profile is never worth the run
            self._give_up(e)
        self.current = step
        return 0.0

    def records(self, step: int) -> bool:
        """Whether the profiler runs through step `step`, its warm-up included (the step's
        metrics line says so: it runs slower)."""
        return self.prof is not None and step >= self.begins

    def finish(self, failed: bool = False) -> None:
        """Stop recording and write the files (nothing when no step was recorded)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        try:
            if not failed:  # a step an error broke off is not one of the recorded
                self._close_step()
            prof.stop()
            if self.recorded:
                self._write(prof)
        except Exception as e:  # noqa: BLE001
            if not failed:
                print(f"warning: the profile of {self._steps()} was not written: {e}", flush=True)
        finally:
            self._memory_history(False)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with warnings.catch_warnings():
            # no warm-up step (a run resumed inside the window): torch's warning says what ops.txt does
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            when = schedule(wait=0, warmup=self.warmup, active=len(self.todo), repeat=1)
        try:
            self._sync()
            if self.rank == 0:
                self._clear()
            self._memory_history(True)
            self.prof = profile(activities=activities, schedule=when, record_shapes=True, profile_memory=self.memory)
            self.prof.start()
        except Exception as e:  # noqa: BLE001 - another profiler already running, say
            self._give_up(e)

    def _give_up(self, error: Exception) -> None:
        print(f"warning: train.profile: the profiler failed ({error}); training goes on without it", flush=True)
        prof, self.prof, self.todo = self.prof, None, []
        try:
            if prof is not None:
                prof.stop()
        except Exception:  # noqa: BLE001
            pass
        self._memory_history(False)

    def _memory_history(self, on: bool) -> None:
        """The CUDA allocator's history (memory: true): every allocation with its Python stack."""
        if not self.cuda_memory:
            return
        try:
            if on:
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_ENTRIES)
            else:
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # noqa: BLE001 - after a CUDA error, say: the error is what the run reports
            pass

    def _close_step(self) -> None:
        """The step under way is over: its wall time, when it is one of the window's."""
        self._sync()
        now = time.perf_counter()
        if self.current in self.todo and self.current not in self.recorded:
            self.recorded.append(self.current)
            self.walls.append(now - self.mark)
        self.mark = now

    # -- writing ------------------------------------------------------------------------

    def _clear(self) -> None:
        """An earlier recording's files (another run's, or another number of processes'):
        not to be read as this one's."""
        if self.folder.is_dir():
            for f in self.folder.iterdir():
                if f.is_file():
                    f.unlink(missing_ok=True)

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        written, failures = [], []
        for name, write in ((f"ops{self.suffix}.txt", lambda path: Path(path).write_text(self._table(prof))),
                            (f"trace{self.suffix}.json.gz", prof.export_chrome_trace),
                            (f"memory{self.suffix}.pickle", torch.cuda.memory._dump_snapshot)):
            if name.startswith("memory") and not self.cuda_memory:
                continue
            try:
                written.append(self._atomic(name, write))
            except Exception as e:  # noqa: BLE001 - the other files still come
                failures.append(f"{name}: {e}")
        named = ", ".join(f"{self.folder.name}/{p.name}" for p in written)
        if named:
            print(f"profiled {self._steps()} on {self.where}: {named} (timeline: {TRACE_VIEWER}"
                  + (f"; memory: {MEMORY_VIEWER}" if self.cuda_memory else "") + ")", flush=True)
        for failure in failures:
            print(f"warning: the profile of {self._steps()}: {failure} was not written", flush=True)

    def _atomic(self, name: str, write) -> Path:
        path = self.folder / name
        tmp = self.folder / f".tmp-{name}"  # the trace's ".gz" ending kept: torch compresses by it
        try:
            write(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _table(self, prof) -> str:
        n = len(self.recorded)
        wall = sum(self.walls) / n
        lines = [f"# {self._steps()} of {self.max_steps} on {self.where}, recorded "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC"
                 + ("" if self.warmup else " (no warm-up step before them: the first may look slower)"),
                 f"# {wall:.4f} s a step (wall)"]
        on_device = self.device.type == "cuda"
        if on_device:
            busy = kernel_seconds(prof.events()) / n
            lines.append(f"# kernels ran {busy:.4f} s a step: the GPU busy {busy / wall:.0%} of the wall time "
                         "(the rest it waited for the host)")
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        lines.append(f"# the {TABLE_ROWS} operators with the most {'kernel' if on_device else 'own CPU'} time "
                     f"over the {n} step{'s' if n > 1 else ''}")
        table = prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS, max_name_column_width=70)
        return "\n".join(lines) + "\n" + table + "\n"

    def _steps(self) -> str:
        steps = self.recorded or self.todo
        return f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def kernel_seconds(events) -> float:
    """Seconds in which at least one kernel (or copy) ran on the GPU: the union of their
    intervals, so that kernels overlapping on several streams (NCCL's beside the compute)
    count once, and user annotations (``ProfilerStep#N``, which span the step) not at all."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    total, reached = 0.0, float("-inf")
    for start, end in spans:
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total / 1e6  # the profiler's times are in microseconds
