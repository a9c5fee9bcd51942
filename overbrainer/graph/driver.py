"""A bake: a plan compiled for its run folder, and doit running its graph.

`compile_bake` validates everything that can be checked without work (the plan, that its
data files and base exist) so that a bad input fails before a run folder is even made.
`run_bake` runs the graph with doit, one bake per run folder at a time, and returns what
ran and what was already done.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..errors import OverbrainerError, RunStateError
from ..folder import RunFolder, runs_root
from ..hashing import HashCache
from ..inputs.base_model import BaseSpec, parse_base
from ..portable.common import now
from ..remembered import load as load_plan
from ..remembered import remember, validated

if TYPE_CHECKING:
    from ..plan import Plan
    from ..remembered import Remembered

__all__ = ["Bake", "compile_bake", "run_bake", "exit_code", "dry_run", "would_run", "doit_config"]


@dataclass
class Bake:
    """Everything the steps read: the validated plan, where things are, and what happened."""

    plan: Plan | Remembered  # Remembered on paths that only check; `validate` makes it the models
    plan_path: Path
    folder: RunFolder
    base: BaseSpec
    data_paths: list[Path]
    hashes: HashCache
    out: TextIO = field(default_factory=lambda: sys.stdout)
    quiet: bool = False
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error: BaseException | None = None
    tell_errors: bool = False  # the doit reporter prints the error (under `doit`, no CLI)
    record: object | None = None  # the Run whose run.json this bake keeps, while it runs
    stages: list[list[str]] = field(default_factory=list)  # [step, why] of each step begun, in order
    signalled: int | None = None  # SIGINT or SIGTERM asked this process to stop (the exit code says so)
    plan_bytes: bytes | None = None  # what the plan file held when it was read

    @property
    def plan_dir(self) -> Path:
        return self.plan_path.parent

    def shown(self, path: Path) -> str:
        """A path as the user wrote it: relative to where the command runs, when inside it."""
        try:
            return os.path.relpath(path)
        except ValueError:
            return str(path)

    def validate(self) -> None:
        """The plan as its models, for a step about to run work (see ``remembered``)."""
        if not hasattr(self.plan, "model_copy"):
            # from the bytes the checks were made on, not the file as it may be now
            self.plan = validated(self.plan_path, self.plan_bytes)

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, file=self.out, flush=True)

    def tell(self, **fields) -> None:
        """Record progress in run.json (state, step, steps), when a run record is kept."""
        if self.record is not None:
            self.record.update(**fields)


def compile_bake(plan_path: str | os.PathLike, runs: str | os.PathLike | None = None, **options) -> Bake:
    plan_path = Path(plan_path).absolute()
    root = runs_root(runs)
    plan, raw = load_plan(plan_path, root)
    shown_plan = os.path.relpath(plan_path) if not str(plan_path).startswith("..") else str(plan_path)
    data_paths = []
    for i, rel in enumerate(plan.data_files):
        path = (plan_path.parent / rel).expanduser().absolute()
        field_name = "data" if isinstance(plan.data, str) else f"data[{i}]"
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "no such file"
            raise OverbrainerError(
                f"{shown_plan}: {field_name}: {rel!r} {what} (paths are relative to the plan file); fix the path"
            )
        data_paths.append(path)
    base = parse_base(plan.base, plan_path.parent)
    folder = RunFolder(root / plan.name)
    return Bake(
        plan=plan,
        plan_path=plan_path,
        folder=folder,
        base=base,
        data_paths=data_paths,
        hashes=HashCache(folder.hash_cache),
        plan_bytes=raw,
        **options,
    )


def doit_config(bake: Bake) -> dict:
    return {
        "dep_file": str(bake.folder.doit_db),
        "backend": "sqlite3",
        "default_tasks": ["train"],
        "reporter": _reporter(bake),
        "verbosity": 2,
    }


def run_bake(bake: Bake, task: str | list[str] = "train") -> int:
    """Run the graph (or the parts of it up to `task`, e.g. ``train:split``) in this process,
    keeping run.json. Returns the exit code that the attempt in run.json records (see
    `exit_code`); what went wrong is on ``bake.error``.

    The run folder's lock is taken before anything is written: a second bake of the same
    folder fails at once (`AlreadyRunning`) and never touches the first one's files.
    """
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from ..runtime.run import Run

    bake.folder.root.mkdir(parents=True, exist_ok=True)
    if bake.plan_bytes is not None and hasattr(bake.plan, "model_copy"):
        remember(bake.plan_path, bake.plan_bytes, bake.plan, bake.folder.root)  # a folder new for this plan
    with _exclusive(bake.folder):
        bake.folder.stop_request.unlink(missing_ok=True)  # a stop asked of an earlier bake
        if task != "train":  # a part of the graph (`overbrainer split`): run.json is the whole bake's
            return DoitMain(ModuleTaskLoader(_namespace(bake))).run(["run", *([task] if isinstance(task, str) else task)])
        record = Run(bake.folder.root)
        attempts = record._read().get("attempts", [])
        attempt = {"start": now(), "pid": os.getpid()}
        from ..runtime.run import this_process

        record.update(
            state="starting", where="here", plan_file=str(bake.plan_path), process=this_process(),
            reason=None, result=None, attempts=[*attempts, attempt],
            task=None, why=None, stages=[], step=None, steps=None,  # nothing of the last attempt's progress
        )
        bake.record = record
        try:
            code = DoitMain(ModuleTaskLoader(_namespace(bake))).run(["run", task])
        except BaseException as e:  # Ctrl-C twice, or a bug: the record must say so
            bake.error = bake.error or e
            code = 1
            raise
        finally:
            state, reason, kind = outcome(bake.error)
            log_tail = getattr(bake.error, "log_tail", "") or ""
            code = exit_code(state, kind, bake.error, bake.signalled)
            attempt.update(end=now(), exit=code, reason=reason or state)
            record.update(
                state=state, reason=reason, attempts=[*attempts, attempt],
                result={"ran": bake.ran, "skipped": bake.skipped, "error": reason if bake.error else None,
                        "kind": kind, "log_tail": log_tail},
            )
            bake.record = None
        return code


def _namespace(bake: Bake) -> dict:
    """What doit loads: the bake's tasks and its configuration (dodo.py's, for `run_bake`)."""
    from .tasks import doit_tasks

    return {"task_train": lambda: doit_tasks(bake), "DOIT_CONFIG": doit_config(bake)}


def outcome(error: BaseException | None) -> tuple[str, str | None, str | None]:
    """The run state an error ends a bake in, its reason, and its kind (input or run)."""
    from ..errors import RunStopped

    if error is None:
        return "done", None, None
    if isinstance(error, RunStopped):
        return "stopped", str(error), None
    if isinstance(error, OverbrainerError):
        return "failed", str(error), "input"
    if isinstance(error, KeyboardInterrupt):
        return "failed", "interrupted", "run"
    return "failed", str(error) or type(error).__name__, "run"


def exit_code(state: str, kind: str | None, error: BaseException | None, signalled: int | None) -> int:
    """The exit code of a bake that ended in `state`: 0 done or stopped on request, 1 the
    run failed, 2 its input is wrong; 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) when a signal
    stopped it, as a shell expects (128 + the signal's number)."""
    import signal

    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if signalled is not None and state != "done":
        return 128 + signalled
    if state in ("done", "stopped"):
        return 0
    return 2 if kind == "input" else 1


def dry_run(bake: Bake) -> list[dict]:
    """Each step, whether it would run, and why: nothing is run, and nothing written but
    the hash cache (a file whose mtime changed is hashed here once, not on every check)."""
    from ..steps import check
    from .tasks import DEPS, STEPS

    rows, will_run = [], set()
    for module in STEPS:
        after = [d for d in DEPS[module.NAME] if d in will_run]
        status = check(bake, module)
        if status.up_to_date and not after:
            rows.append({"step": module.NAME, "run": False, "why": "up to date"})
            continue
        will_run.add(module.NAME)
        # its own reason when it has one (its inputs or outputs changed); else it only
        # follows a step before it (waits for it, or is up to date until that one reruns)
        own = status.fingerprint is not None and not status.up_to_date
        why = status.reason if own or not after else f"after {', '.join(after)}"
        rows.append({"step": module.NAME, "run": True, "why": why})
    if bake.folder.root.is_dir():  # a plan never baked gets no folder from a dry run
        bake.hashes.save()
    return rows


def would_run(bake: Bake) -> list[dict]:
    """What ``bake --check`` tells: the steps that would run, with why; empty when
    everything is up to date. Reads stamps only (no torch), like `dry_run`."""
    return [row for row in dry_run(bake) if row["run"]]


def memory_estimate(bake: Bake):
    """The sizing estimate (sizing.Estimate) when the base model is already local, else None."""
    from ..stamps import read_stamp
    from ..steps.config import size

    stamp = read_stamp(bake.folder.stamp("base"))
    folder = Path(stamp.summary["folder"]) if stamp else (Path(bake.base.location) if bake.base.kind == "folder" else None)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        return size(bake.plan.train, folder)
    except OverbrainerError as e:
        return str(e)


class AlreadyRunning(RunStateError):
    """Another process bakes this run folder."""


class _exclusive:
    """One bake per run folder: an OS lock on ``.lock``, released when the process ends,
    however it ends (a dead process cannot hold it)."""

    def __init__(self, folder: RunFolder):
        self.folder = folder

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.folder.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            holder = _lock_holder(self.folder.lock)
            raise AlreadyRunning(
                f"{self.folder.root}: already being baked{holder}; follow it with `overbrainer wait`, or stop it"
            ) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _lock_holder(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
        return f" by process {pid}" if pid else ""
    except OSError:
        return ""


def _reporter(bake: Bake):
    """A doit reporter that speaks in steps and leaves error messages to the caller."""
    from doit.reporter import ConsoleReporter

    class BakeReporter(ConsoleReporter):
        def execute_task(self, task):
            # run.json names the step under way: what `overbrainer graph` shows as running
            if ":" in task.name:
                bake.tell(task=task.name.split(":", 1)[1])

        def skip_uptodate(self, task):
            if ":" in task.name:
                bake.skipped.append(task.name.split(":", 1)[1])

        def skip_ignore(self, task):
            pass

        def add_failure(self, task, fail):
            if bake.error is None:  # a failure doit found itself, not one of a step's
                bake.error = OverbrainerError(f"{task.name}: {fail.get_msg().strip().splitlines()[-1]}")

        def complete_run(self):
            # a step's error is told once, as one line: by the CLI, or here under `doit`
            if bake.error is not None and bake.tell_errors:
                self.write(f"error: {bake.error}\n")
                tail = getattr(bake.error, "log_tail", "")
                if tail:
                    self.write(tail + "\n")
            if self.runtime_errors:
                self.write("\n".join(self.runtime_errors) + "\n")

    return BakeReporter
