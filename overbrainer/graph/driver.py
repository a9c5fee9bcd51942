"""Running a compiled bake: doit runs its graph in this process, one bake per run folder
at a time, keeping run.json; and telling what would run, without running it.

`run_bake` returns an `Outcome` (what ran, what was already done, the error); the steps it
runs are given the `steps.context.Bake` and never see the outcome.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import journal
from ..errors import OverbrainerError, RunStateError
from ..folder import RunFolder
from ..fsio import Busy, exclusive
from ..portable.common import now
from ..remembered import remember
from ..steps.context import Bake
from .compile import compile_bake
from .tasks import Outcome

__all__ = ["Outcome", "run_bake", "exit_code", "dry_run", "would_run", "doit_config", "memory_estimate", "outcome", "AlreadyRunning",
           "compile_bake", "claim_done", "check_owner", "owner_fields"]


def doit_config(bake: Bake, done: Outcome, tell_errors: bool = False, record: bool = False,
                backend: str | None = None) -> dict:
    """doit's settings for a bake: its database in the run folder, and a reporter that
    speaks in steps (`tell_errors`: it prints the error too, and `record`: it keeps
    run.json, as under ``doit`` alone)."""
    return {
        "dep_file": str(bake.folder.doit_db),
        "backend": backend or doit_backend(),
        "default_tasks": ["train"],
        "reporter": _reporter(bake, done, tell_errors, record),
        "verbosity": 2,
    }


def doit_backend() -> str:
    """The database backend for the ``doit`` command: overbrainer's (`doitdb.KeptSqlite`)
    where an installed overbrainer registers it (entry point ``doit.BACKEND``), doit's own
    sqlite3 where not (a checkout on PYTHONPATH). A bake registers it itself."""
    from importlib.metadata import entry_points

    from .doitdb import BACKEND

    return BACKEND if entry_points(group="doit.BACKEND", name=BACKEND) else "sqlite3"


def run_bake(bake: Bake, task: str | list[str] = "train", done: Outcome | None = None) -> Outcome:
    """Run the graph (or the parts of it up to `task`, e.g. ``train:split``) in this process,
    keeping run.json; what it did goes into `done` (a signal handler may mark it
    `signalled`). The attempt run.json records has the exit code `exit_code` gives.

    A part of the graph (``overbrainer split``) keeps no record: run.json is the whole
    bake's.

    The run folder's lock is taken before anything is written: a second bake of the same
    folder fails at once (`AlreadyRunning`) and never touches the first one's files.
    """
    from doit.cmd_base import ModuleTaskLoader
    from doit.doit_cmd import DoitMain

    from .doitdb import BACKEND, BACKEND_PLUGIN, set_aside_damaged_db
    from .tasks import doit_tasks

    folder = bake.folder
    check_owner(bake)
    folder.root.mkdir(parents=True, exist_ok=True)
    done = done if done is not None else Outcome()
    with _one_bake(folder):
        check_owner(bake)  # again under the lock: a bake of another plan may have begun since
        if bake.plan_bytes is not None:  # a folder new for this plan: remembered from now on
            remember(bake.plan_path, bake.plan_bytes, bake.plan, folder.root)
        folder.stop_request.unlink(missing_ok=True)  # a stop asked of an earlier bake
        bake.checked.clear()
        set_aside_damaged_db(folder)
        config = doit_config(bake, done, backend=BACKEND)
        doit = DoitMain(ModuleTaskLoader({"task_train": lambda: doit_tasks(bake, done), "DOIT_CONFIG": config}),
                        extra_config=BACKEND_PLUGIN)
        argv = ["run", *([task] if isinstance(task, str) else task)]
        if task != "train":
            done.code = doit.run(argv)
            return done
        attempt = _Attempt(bake, done)
        try:
            done.code = doit.run(argv)
            claim_done(bake, done)
        except BaseException as e:  # Ctrl-C twice, or a bug: the record must say so
            done.error = done.error or e
            raise
        finally:
            attempt.end()
    return done


def owner_fields(bake: Bake) -> dict:
    """What run.json records of the plan file that owns its folder: its resolved path, and
    the hash of its bytes (a plan file moved or copied with the same content is the same
    plan)."""
    from ..hashing import hash_bytes

    fields = {"plan_file": str(bake.plan_path.resolve())}
    if bake.plan_bytes is not None:
        fields["plan_hash"] = hash_bytes(bake.plan_bytes)
    return fields


def check_owner(bake: Bake) -> None:
    """Refuse to bake into a run folder that another plan file owns: two plans with one name
    would replace each other's outputs and retrain each time. The owner is the plan file
    run.json records (or, before any whole bake or when run.json is damaged, the one plan.json
    was resolved from). The same file, edited, is the same plan; so is a file with the
    owner's bytes (a plan moved, or a checkout elsewhere) or, without run.json, with the
    settings plan.json holds; and so is any file once the owner is gone. `bake.take_over`
    (``--force``) makes this plan the owner."""
    import json

    folder = bake.folder
    if bake.take_over or not folder.root.is_dir():
        return
    recorded = journal.read(folder)
    owner, owner_hash = recorded.get("plan_file"), recorded.get("plan_hash")
    if not isinstance(owner, str):  # no run.json, or a damaged one: plan.json says what it was resolved from
        try:
            resolved = json.loads(folder.plan_json.read_text())
            owner = resolved.pop("resolved")["plan_file"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if resolved == bake.plan.model_dump(mode="json"):
            return  # the same settings: the same plan, wherever its file is now
        owner_hash = None
    if not isinstance(owner, str):
        return
    mine = owner_fields(bake)
    if Path(owner).resolve() == Path(mine["plan_file"]) or (owner_hash and owner_hash == mine.get("plan_hash")):
        return
    if not Path(owner).is_file():
        return  # the plan that baked it is gone: nothing of another live plan is replaced
    raise RunStateError(
        f"{bake.shown(folder.root)} belongs to {bake.shown(Path(owner))}, a different plan file with the same name "
        f"({folder.name!r}) as {bake.shown(bake.plan_path)}; give one of them another \"name\", or bake with "
        f"--force (from Python: force=True) to take the folder over")


def claim_done(bake: Bake, done: Outcome) -> None:
    """The last word of a bake that is about to say "done": doit itself must have ended
    well, and every step's stamp must be there with its outputs as the stamp lists them.
    Anything else is an error on `done`, never a success over a missing target."""
    from ..errors import RunFailed
    from ..stamps import read_stamp, verify
    from .tasks import graph_of

    if done.error is not None or done.signalled is not None:
        return
    if done.code not in (0, None):
        done.error = RunFailed(f"{bake.folder.root}: doit ended with exit code {done.code} before every step was "
                               f"checked; see the lines above, then bake again")
        return
    for module in graph_of(bake)[0]:  # the plan's steps: with budgets, each branch's instead of merge and bake
        stamp = read_stamp(bake.folder.stamp(module.NAME))
        problem = "it has no stamp" if stamp is None else verify(stamp, bake.hashes, bake.folder.root)
        if problem:
            done.error = RunFailed(f"{bake.folder.root}: the bake ended but {module.NAME} is not done ({problem}); "
                                   f"bake again")
            return


class _Attempt:
    """One attempt of a whole bake, in run.json: "starting" (nothing of an earlier attempt's
    progress kept) and the bake's `tell` pointed at run.json, then its end state, reason,
    result and exit code. Both doors keep it the same way: `run_bake` (``overbrainer
    bake``) and, under ``doit train plan=...``, the reporter. The caller holds the lock."""

    def __init__(self, bake: Bake, done: Outcome):
        self.bake, self.done, folder = bake, done, bake.folder
        self.before = journal.read(folder).get("attempts", [])
        self.attempt = {"start": now(), "pid": os.getpid()}
        journal.update(folder, state="starting", where="here", **owner_fields(bake),
                       process=journal.this_process(), reason=None, result=None,
                       attempts=[*self.before, self.attempt], task=None, stages=[], step=None, steps=None)
        self.untold, bake.tell = bake.tell, _teller(folder)

    def end(self) -> None:
        done = self.done
        state, reason, kind = outcome(done.error)
        log_tail = getattr(done.error, "log_tail", "") or ""
        done.code = exit_code(state, kind, done.error, done.signalled)
        self.attempt.update(end=now(), exit=done.code, reason=reason or state)
        journal.update(self.bake.folder, state=state, reason=reason, attempts=[*self.before, self.attempt],
                       result={"ran": done.ran, "skipped": done.skipped, "error": reason if done.error else None,
                               "kind": kind, "log_tail": log_tail})
        self.bake.tell = self.untold


def _teller(folder: RunFolder):
    """A bake's `tell`: progress into run.json; a step that begins (``task`` with ``why``)
    is added to this attempt's ``stages`` too, for a follower that polls between two."""
    stages: list[list[str]] = []

    def tell(**fields) -> None:
        if "why" in fields:
            stages.append([fields["task"], fields.pop("why")])
            fields["stages"] = stages
        journal.update(folder, **fields)

    return tell


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
    if isinstance(error, OSError) and error.filename is not None:  # a folder that cannot be written, a full disk
        import errno

        from ..errors import FileProblem

        # a path the user must fix is bad input (2); a disk that filled up is a failed run (1)
        theirs = error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR)
        return "failed", str(FileProblem.from_os_error(error)), "input" if theirs else "run"
    return "failed", str(error) or type(error).__name__, "run"


def dry_run(bake: Bake) -> list[dict]:
    """Each step, whether it would run, and why: nothing is run, and nothing written but
    the hash cache (a file whose mtime changed is hashed here once, not on every check)."""
    from ..steps import check
    from .tasks import graph_of

    rows, will_run = [], set()
    steps, deps = graph_of(bake)
    for module in steps:
        after = [d for d in deps[module.NAME] if d in will_run]
        status = check(bake, module)
        if status.up_to_date and not after:
            rows.append({"step": module.NAME, "run": False, "why": "up to date"})
            continue
        will_run.add(module.NAME)
        # its own reason when it has one (its inputs or outputs changed); else it only
        # follows a step before it (waits for it, or is up to date until that one reruns)
        own = status.fingerprint is not None and not status.up_to_date
        why = status.reason if own or not after else f"after {', '.join(after)}"
        foresee = getattr(module, "foresee", None)
        if not own and after == ["config"] and foresee is not None and not set(deps["config"]) & will_run:
            # what it would go on from once config has rerun, config being the only step
            # before it that reruns (train: the checkpoints of the stable phase)
            note = foresee(bake)
            why = f"{why}; {note}" if note else why
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


@contextmanager
def _one_bake(folder: RunFolder) -> Iterator[None]:
    """One bake per run folder: its ``.lock``, held for the bake (``fsio.exclusive``)."""
    try:
        with exclusive(folder.lock):
            yield
    except Busy as e:
        holder = f" by process {e.holder}" if e.holder else ""
        raise AlreadyRunning(f"{folder.root}: already being baked{holder}; follow it with `overbrainer wait`, or stop it") from None


def _reporter(bake: Bake, done: Outcome, tell_errors: bool, record: bool):
    """A doit reporter that speaks in steps and leaves error messages to the caller. With
    `record` (``doit train plan=...``, no `run_bake` around it), a run of the whole graph
    takes the run folder's lock and keeps run.json as `run_bake` does."""
    import sys
    from contextlib import ExitStack

    from doit.reporter import ConsoleReporter

    from .tasks import GROUP, graph_of

    class BakeReporter(ConsoleReporter):
        attempt: _Attempt | None = None

        def initialize(self, tasks, selected_tasks):
            super().initialize(tasks, selected_tasks)
            if not record or list(selected_tasks or [GROUP]) != [GROUP]:
                return  # a part of the graph: run.json is the whole bake's
            self.held = ExitStack()
            self.held.enter_context(_one_bake(bake.folder))  # AlreadyRunning: nothing touched
            try:
                check_owner(bake)
            except RunStateError as e:  # doit would show it as its own traceback: one line, exit 2
                self.held.close()
                sys.stderr.write(f"error: {e}\n")
                sys.exit(e.exit_code)
            bake.folder.stop_request.unlink(missing_ok=True)  # a stop asked of an earlier bake
            self.attempt = _Attempt(bake, done)


        def execute_task(self, task):
            # run.json names the step under way: what `overbrainer graph` shows as running
            if ":" in task.name:
                bake.tell(task=task.name.split(":", 1)[1])

        def skip_uptodate(self, task):
            if ":" in task.name:
                done.skipped.append(task.name.split(":", 1)[1])

        def skip_ignore(self, task):
            pass

        def add_failure(self, task, fail):
            if done.error is None:  # a failure doit found itself, not one of a step's
                done.error = OverbrainerError(f"{task.name}: {fail.get_msg().strip().splitlines()[-1]}")

        def complete_run(self):
            # a step's error is told once, as one line: by the CLI, or here under `doit`
            if done.error is not None and tell_errors:
                self.write(f"error: {done.error}\n")
                tail = getattr(done.error, "log_tail", "")
                if tail:
                    self.write(tail + "\n")
            if self.runtime_errors:
                self.write("\n".join(self.runtime_errors) + "\n")
            if self.attempt is not None:
                if done.error is None and len(done.ran) + len(done.skipped) < len(graph_of(bake)[0]):
                    done.error = KeyboardInterrupt()  # doit was stopped between its steps
                claim_done(bake, done)
                self.attempt.end()
                self.attempt = None
                self.held.close()

    return BakeReporter
