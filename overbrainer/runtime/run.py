"""A run: a folder, a process of its own, and a model at the end.

(The public names are ``overbrainer.Run``, ``overbrainer.run`` and ``overbrainer.runs``.)

``run.json``'s format and the rules of writing it are ``journal.py``'s.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import journal
from ..errors import RunFailed, RunStateError
from ..folder import RunFolder, runs_root
from ..journal import ACTIVE, FINAL, STATES
from ..portable.common import now

__all__ = ["Run", "runs", "launch", "start_unless_done", "Started", "STATES", "ACTIVE", "FINAL"]


class Run:
    """A run folder: its state, its process, its metrics and its models."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = RunFolder(Path(folder).absolute())

    def __repr__(self) -> str:
        return f"<Run {self.name} {self.state}>"

    @property
    def name(self) -> str:
        return self.folder.name

    # -- state ---------------------------------------------------------------------------

    def _read(self) -> dict:
        return journal.read(self.folder)

    @property
    def status(self) -> dict:
        """run.json, with a process that ended without saying so shown as such; a Slurm job
        that goes on without it is shown as what Slurm says it is."""
        data = journal.status(self.folder)
        job = data.get("slurm_job")
        if data.get("reason") == journal.DIED and job:
            from ..where.slurm import job_state

            there = job_state(job)
            if there is not None and there.in_queue:
                state = "queued" if there.state == "PENDING" else "running"
                data = {**data, "state": state,
                        "reason": f"Slurm job {job} is {there.state} ({there.reason}); nothing here follows it: "
                                  "bake again to follow it and take up its result"}
            elif there is not None:
                data = {**data, "reason": f"{journal.DIED}; its Slurm job {job} ended {there.state}: bake again "
                                          "to take up its result"}
        return data

    @property
    def state(self) -> str:
        return self.status["state"]

    @property
    def where(self) -> str:
        return self.status.get("where", "here")

    @property
    def plan(self) -> dict:
        """Every setting the run was decided with (its plan.json)."""
        try:
            return json.loads(self.folder.plan_json.read_text())
        except (OSError, ValueError):
            raise RunStateError(f"{self.folder.root}: no plan.json; bake a plan into this folder first") from None

    def repair(self) -> dict | None:
        """run.json rebuilt from what the folder holds, when it is damaged (None: it is
        not): done when every step has its stamp, else failed (bake again to go on from
        the last checkpoint); its plan file from plan.json. The attempts are lost."""
        from ..graph.tasks import STEPS
        from ..stamps import read_stamp

        try:
            journal.load(self.folder)
            return None
        except journal.Damaged:
            pass
        try:
            plan_file = self.plan.get("resolved", {}).get("plan_file")
        except RunStateError:
            plan_file = None
        done = all(read_stamp(self.folder.stamp(m.NAME)) is not None for m in STEPS)
        steps = self.checkpoints()
        data = {"state": "done" if done else "failed", "where": "here", "process": None, "task": None, "stages": [],
                "reason": None if done else "run.json was damaged and rebuilt; bake again to go on from the last checkpoint",
                "step": steps[-1] if steps else None, "attempts": [], "result": None}
        if isinstance(plan_file, str):
            data["plan_file"] = plan_file
        return journal.update(self.folder, **data)

    def update(self, _only_if: tuple[str, ...] | None = None, **fields) -> dict:
        """Change run.json (``journal.update``): what the supervisor does, and `stop`."""
        return journal.update(self.folder, _only_if, **fields)

    # -- the process ---------------------------------------------------------------------

    def _plan_file(self) -> str:
        plan_file = self._read().get("plan_file") or self.plan.get("resolved", {}).get("plan_file")
        if not plan_file or not Path(plan_file).is_file():
            raise RunStateError(f"{self.folder.root}: its plan file {plan_file!r} is gone; bake the plan again by its path")
        return plan_file

    def start(self, process: bool = True) -> Run:
        """Start (or resume) the run in its own process; `process=False` runs it in a
        thread of this one (which ends with it)."""
        if self.state in ACTIVE:
            return self
        from ..graph.driver import compile_bake, run_bake

        bake = compile_bake(self._plan_file(), runs=self.folder.root.parent)
        self.folder.stop_request.unlink(missing_ok=True)
        before = self.attempts()
        if process:
            child = launch(bake)
        else:
            child = None
            import threading

            threading.Thread(target=run_bake, args=(bake,), daemon=True, name=f"overbrainer-{self.name}").start()
        self.wait_started(before, child)
        return self

    def attempts(self) -> int:
        return len(self._read().get("attempts", []))

    def wait_started(self, before: int, child: subprocess.Popen | None = None, timeout: float = 120) -> None:
        """Wait until a new attempt has begun (or another process's one is under way)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.attempts() > before or self.state in ACTIVE:
                return
            if child is not None and child.poll() is not None:
                if self.attempts() > before or self.state in ACTIVE:
                    return
                raise RunStateError(
                    f"{self.folder.root}: the run's process ended at once (exit code {child.returncode}); "
                    f"see {self.folder.log}"
                )
            time.sleep(0.05)
        raise RunStateError(f"{self.folder.root}: the run did not start within {timeout:g} s; see {self.folder.log}")

    def resume(self) -> Run:
        """Continue a stopped or crashed run from its last checkpoint."""
        if self.state == "done":
            return self
        return self.start()

    def stop_requested(self) -> bool:
        """Whether stop() was asked (what the trainer checks at each step)."""
        return self.folder.stop_request.exists()

    def stop(self, wait: bool = True, timeout: float = 600) -> str:
        """Ask the run to stop at its next step (it saves a checkpoint first). Returns the
        state it ended in (or is in, without `wait`)."""
        state = self.state
        if state not in ACTIVE:
            return state
        self.folder.stop_request.write_text(now() + "\n")
        self.update(_only_if=ACTIVE, state="stopping")
        if not wait:
            return "stopping"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state
            if state in FINAL:
                return state
            time.sleep(0.1)
        raise RunStateError(f"{self.folder.root}: still {state} after {timeout:g} s; check `overbrainer log {self.folder.root}`")

    def wait(self, poll: float = 5.0, show: bool = True):
        """Wait for the end; show progress; return the model."""
        from .follow import follow

        error = journal.no_run(self.folder)
        if error is not None:
            raise error
        state = follow(self, poll=poll, show=show)
        if state == "done":
            return self.baked()
        status = self.status
        if state == "failed":
            raise RunFailed(status.get("reason") or "the run failed", self.log(15))
        raise RunStateError(f"{self.folder.root}: {state}" + (f" ({status['reason']})" if status.get("reason") else ""))

    # -- metrics and log -----------------------------------------------------------------

    def records(self) -> list[dict]:
        """The lines of metrics.jsonl so far, as dicts."""
        out = []
        try:
            text = self.folder.metrics.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return out
        for raw in text.splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue  # a line being written
        return out

    def metrics(self):
        """The logged steps as a pyarrow Table."""
        import pyarrow as pa

        rows = [r for r in self.records() if "step" in r]
        columns = ["step", "tokens", "loss", "lr", "eval_loss", "seconds", "phase"]
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
        return pa.table({c: [r.get(c) for r in rows] for c in columns})

    def metrics_csv(self) -> str:
        rows = [r for r in self.records() if "step" in r]
        columns = self.metrics().column_names
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def log_metric(self, **fields) -> None:
        """Append one line to metrics.jsonl (what trainers call)."""
        with open(self.folder.metrics, "a") as f:
            f.write(json.dumps(fields) + "\n")

    def log(self, lines: int = 40) -> str:
        """The last `lines` lines of the trainer's own output (log.txt)."""
        try:
            text = self.folder.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def progress(self) -> dict:
        """Where it is now: state, the step of the graph under way (`task`; `stages`: each
        step this attempt began, and why), step of steps, the last loss and eval loss,
        seconds so far and eta (seconds left, from the pace of the last steps)."""
        status = self.status
        records = [r for r in self.records() if "step" in r]
        steps = status.get("steps") or _steps_from_config(self.folder.config)
        out = {"state": status["state"], "task": status.get("task"), "stages": status.get("stages") or [],
               "step": 0, "steps": steps, "loss": None, "eval_loss": None,
               "seconds": 0.0, "eta": None, "tokens_per_second": None}
        if records:
            last = records[-1]
            evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
            out.update(step=last["step"], loss=last.get("loss"), seconds=last.get("seconds", 0.0),
                       eval_loss=evals[-1] if evals else None)
            recent = records[-11:]
            if len(recent) >= 2 and steps:
                dt = recent[-1]["seconds"] - recent[0]["seconds"]
                per_step = dt / (recent[-1]["step"] - recent[0]["step"]) if recent[-1]["step"] > recent[0]["step"] else None
                if per_step is not None:
                    out["eta"] = round(max(0, steps - last["step"]) * per_step, 1)
                    tokens = recent[-1]["tokens"] - recent[0]["tokens"]
                    out["tokens_per_second"] = round(tokens / dt, 1) if dt > 0 else None
        if out["state"] == "done":
            out["eta"] = 0.0
        return out

    # -- models --------------------------------------------------------------------------

    def checkpoints(self) -> list[int]:
        """Steps with a checkpoint, oldest first."""
        from ..trainers import checkpoint as ckpt

        return [step for step, _ in ckpt.complete(self.folder.checkpoints)]

    def checkpoint(self, step: int | None = None):
        """A checkpoint as a usable model (the last one by default). A checkpoint from the
        constant phase of the schedule is not decayed: compare such ones with each other,
        not with the final model."""
        from ..chat import Model

        return Model.checkpoint(self.folder.root, step)

    def baked(self):
        """The model this run made (when done)."""
        from ..chat import Model

        return Model.baked(self.folder.root)

    def branches(self) -> dict[str, dict]:
        """Its decay branches (``branches/``: a budget's ``"300"``, a decay's ``"at-400"``),
        each with the trunk checkpoint it decays from, its last step and whether it is baked."""
        from ..folder import BRANCHES
        from ..trainers import checkpoint as ckpt

        out = {}
        root = self.folder.root / BRANCHES
        for p in sorted(root.iterdir() if root.is_dir() else [], key=_branch_order):
            done = ckpt.complete(p / "checkpoints")
            if not p.is_dir() or not (done or (p / "branch.json").exists()):
                continue
            seed = min(done)[1].name if done else None
            out[p.name] = {"from": seed, "step": done[-1][0] if done else None, "baked": (p / "baked" / "config.json").is_file(),
                           "folder": str(p)}
        return out

    def branch(self, label: int | str):
        """A branch's baked model: ``run.branch(300)`` for budget 300, ``run.branch("at-400")``
        for ``overbrainer decay --at 400``."""
        from ..chat import Model
        from ..folder import BRANCHES

        folder = self.folder.root / BRANCHES / str(label)
        if not folder.is_dir():
            there = ", ".join(self.branches()) or "none"
            raise RunStateError(f"{self.folder.root}: no branch {label}; the branches are: {there}")
        return Model.baked(folder)


def _branch_order(path: Path) -> tuple[int, int]:
    """Budgets by size, then decays by step."""
    name = path.name
    return (0, int(name)) if name.isdecimal() else (1, int(name[3:]) if name[3:].isdecimal() else 0)


def _steps_from_config(config: Path) -> int | None:
    try:
        import yaml

        return yaml.safe_load(config.read_text()).get("max_steps")
    except (OSError, ValueError, AttributeError):
        return None


@dataclass
class Started:
    """What `start_unless_done` did: ``how`` is "started" (a new process, `pid`),
    "running" (one was under way: followed, not doubled) or "done" (nothing to run;
    `rows` are the dry run's)."""

    run: Run
    how: str
    pid: int | None = None
    rows: list[dict] = field(default_factory=list)


def start_unless_done(bake) -> Started:
    """A compiled bake's run, started in a process of its own unless one is running already
    or every step is up to date: what ``overbrainer bake`` and ``overbrainer.bake()`` do."""
    from ..graph.driver import check_owner, dry_run, owner_fields

    check_owner(bake)  # another plan file's folder: refused before anything is followed or started
    run = Run(bake.folder.root)
    if run.state in ACTIVE:
        return Started(run, "running")
    rows = dry_run(bake)
    if not any(row["run"] for row in rows):
        if bake.take_over:  # taken over with nothing to redo: it is this plan's from now on all the same
            journal.update(bake.folder, **owner_fields(bake))
        return Started(run, "done", rows=rows)
    before = run.attempts()
    child = launch(bake)
    run.wait_started(before, child)
    return Started(run, "started", child.pid, rows)


def launch(bake) -> subprocess.Popen:
    """Start `overbrainer bake --foreground` on the compiled `bake` in a new session: it
    outlives the terminal (a hang-up does not reach it) and the process that started it.
    It takes the bake as this process compiled it (``--compiled -``, on its stdin), not the
    plan file as it may be by then. What it says goes to the run's log.txt, after the
    trainer's."""
    folder = bake.folder
    folder.root.mkdir(parents=True, exist_ok=True)
    with open(folder.log, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "overbrainer.cli", "bake", str(bake.plan_path), "--foreground", "--quiet",
             "--runs", str(folder.root.parent), "--compiled", "-"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    try:
        child.stdin.write(json.dumps(bake.handoff()).encode())
        child.stdin.close()
    except BrokenPipeError:
        pass  # it ended at once: wait_started tells why
    return child


def runs(root: str | os.PathLike | None = None) -> list[Run]:
    """Every run under the runs folder, by name."""
    root = runs_root(root)
    if not root.is_dir():
        return []
    return [Run(p) for p in sorted(root.iterdir()) if RunFolder(p).plan_json.is_file() or RunFolder(p).run_json.is_file()]
