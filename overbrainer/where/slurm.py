"""The slurm target: the train step as a Slurm batch job, the run folder on a filesystem the
cluster shares (the job reads and writes it where it is: nothing is sent or brought back).

In the run folder::

    job.sh                   the batch script: ``#SBATCH`` lines from where.slurm, then this
                             module's `job_main` (``python -m overbrainer.where.slurm job RUN``)
    slurm/job.json           what the job runs: the trainer's commands (across nodes: ``srun
                             torchrun`` meeting on the first node of $SLURM_JOB_NODELIST), its
                             environment, stages, metrics file and stop marker
    slurm/submitted.json     the jobs submitted for this run: {"fingerprint", "jobs": [id, ...]}
    slurm/end-<id>.json      how a job's commands ended: {"job", "exit", "signal", "ended"}
    slurm/<id>.out           Slurm's own output of the job (the trainer's goes to log.txt)
    slurm/<step>.sh, slurm/job-<step>.json, slurm/submitted-<step>.json
                             the same for a step after training sent to the cluster
                             (where.slurm.steps: merge, bake), each a job on one node

The job is submitted with ``sbatch --parsable``; its id goes into run.json: ``slurm_job``
is the job this side follows now, ``slurm_jobs`` the last job of each step ({"train": id,
"merge": id, "bake": id}). This side follows it every `poll_s` seconds
(``$OVERBRAINER_SLURM_POLL``, default 5): its state from ``squeue``, then ``scontrol show
job`` once it has left the queue, else ``sacct``. A pending job is ``queued`` with
Slurm's reason; a job that ended FAILED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, CANCELLED,
PREEMPTED... fails its step with that state. A stop is the run's ``stop`` file, which the trainer sees on the shared
filesystem (a job still pending is cancelled instead). ``--signal=B:USR1@<grace>``: on the
warning before its time limit the job writes the stop file itself, the trainer saves a
checkpoint and ends, and this side submits the next job, which goes on from it. A
requeued job (``"requeue": true``: preemption, ``scontrol requeue``) gets SIGTERM, which
writes the stop file the same way; the trainer checkpoints and ends, and Slurm runs job.sh
again under the same job id, which goes on from that checkpoint (a stop file a signal
wrote is taken away first). A node that cannot see the run folder ends job.sh at once
with exit code 97, told here in one line.

With ``workdir`` (a folder the nodes see, for a run folder they do not), each job is staged
in ``<workdir>/<name>-<fp8>/`` as an export bundle's job folder (``bundle.stage_job``: the
config, the splits, the newest checkpoint, the base model and MANIFEST.json); job.sh runs
`staged_main` there, which is the job folder's own runner (``portable/runner.py``: every
file checked against the manifest, the base against its pin, then the commands, then
result.tar.gz), and the result comes back through ``receive`` (the import's checks).
Its ``run/slurm/`` holds the job's end record and Slurm's output; its metrics and log are
mirrored into the run folder as they grow.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OverbrainerError, RunFailed, RunStopped
from ..folder import RunFolder
from ..fsio import write_atomic
from ..portable.common import append_log, now, read_json, write_json
from ..portable.runner import RUN
from ..trainers.protocol import Trainer
from .bundle import FINGERPRINT_ENV

if TYPE_CHECKING:
    from ..plan import SlurmSettings

__all__ = ["Slurm", "JobState", "job_state", "job_main", "job_script"]

IN_QUEUE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
            "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD")
RENDEZVOUS_PORT = 29500
UNSEEN_EXIT = 97  # job.sh's exit code when the node cannot see the run folder
_SUBMITTED = "submitted.json"
_JOB = "job.json"


class JobState(tuple):
    """(state, reason) as Slurm says them: ("PENDING", "Resources"), ("COMPLETED", "None")."""

    state = property(lambda self: self[0])
    reason = property(lambda self: self[1])

    @property
    def in_queue(self) -> bool:
        return self.state in IN_QUEUE


def _slurm(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False)


def job_state(job: str) -> JobState | None:
    """A job's state: squeue while it is in the queue, then scontrol (which keeps a job for
    MinJobAge seconds), then sacct where accounting is on; None when none knows it."""
    try:
        out = _slurm(["squeue", "-h", "-j", job, "-o", "%T|%r"])
        line = out.stdout.strip().splitlines()
        if out.returncode == 0 and line and "|" in line[0]:
            return JobState(line[0].split("|", 1))
        out = _slurm(["scontrol", "-o", "show", "job", job])
        if out.returncode == 0 and "JobState=" in out.stdout:
            fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
            return JobState((fields["JobState"], fields.get("Reason", "None")))
        out = _slurm(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,Reason"])
        line = out.stdout.strip().splitlines()
        if out.returncode == 0 and line and "|" in line[0]:
            state, reason = line[0].split("|", 1)
            return JobState((state.split()[0], reason or "None"))  # "CANCELLED by 0"
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None


def exit_code(job: str) -> int | None:
    """The exit code of a job's batch script, as scontrol (or sacct) says it; None unknown."""
    try:
        out = _slurm(["scontrol", "-o", "show", "job", job])
        fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f) if out.returncode == 0 else {}
        code = fields.get("ExitCode")
        if code is None:
            out = _slurm(["sacct", "-n", "-X", "-P", "-j", job, "-o", "ExitCode"])
            code = (out.stdout.strip().splitlines() or [None])[0] if out.returncode == 0 else None
        return int(code.split(":")[0]) if code else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def slurm_made(stop: Path) -> bool:
    """Whether the run's stop file is one a signal to the job wrote (Slurm's warning, its
    SIGTERM at a requeue or preemption), not a stop the user asked for."""
    try:
        text = stop.read_text()
    except OSError:
        return False
    return text.startswith("slurm signal") or bool(re.match(r"signal [0-9]+\n", text))


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def spec_name(step: str) -> str:
    """The file of slurm/ that says what a step's job runs: job.json for training."""
    return _JOB if step == "train" else f"job-{step}.json"


def job_script(run_dir: Path, name: str, settings: SlurmSettings, python: str = sys.executable,
               staged: Path | None = None, step: str = "train") -> str:
    """job.sh for a run folder: the plan's settings as #SBATCH lines, then the job; with
    `staged` (workdir), the staged job folder's runner, `run_dir` being its run/; for a
    `step` after training, that step's job (slurm/<step>.sh)."""
    slurm = RunFolder(run_dir).slurm
    lines = ["#!/bin/bash", f"#SBATCH --job-name=overbrainer-{name}", f"#SBATCH --output={slurm}/%j.out",
             "#SBATCH --open-mode=append", f"#SBATCH --signal=B:USR1@{settings.grace}",
             f"#SBATCH --nodes={settings.nodes}", "#SBATCH --ntasks-per-node=1"]
    for option, value in (("partition", settings.partition), ("time", settings.time), ("account", settings.account),
                          ("qos", settings.qos), ("gpus-per-node", settings.gpus_per_node),
                          ("cpus-per-task", settings.cpus_per_task)):
        if value is not None:
            lines.append(f"#SBATCH --{option}={value}")
    lines.append("#SBATCH --requeue" if settings.requeue else "#SBATCH --no-requeue")
    lines += [f"#SBATCH {option}" for option in settings.sbatch]
    lines += [
        "# torchrun on every node meets on the first node of the job",
        'export OVERBRAINER_RDZV="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        f':{RENDEZVOUS_PORT}"',
        # a node that cannot see the run folder (not on a filesystem the cluster shares)
        # ends at once with its own exit code, which the side that follows it names
        f"if [ ! -e {shlex.quote(str(staged / 'job.json' if staged else slurm / spec_name(step)))} ]; then",
        f'  echo "overbrainer: $(hostname) cannot see the run folder {run_dir}" >&2; exit {UNSEEN_EXIT}',
        "fi",
        f"cd {shlex.quote(str(run_dir))}",
        f"exec {shlex.quote(python)} -m overbrainer.where.slurm {'staged' if staged else 'job'} "
        f"{shlex.quote(str(staged or run_dir))}" + ("" if step == "train" else f" {shlex.quote(step)}"),
        "",
    ]
    return "\n".join(lines)


def across_nodes(commands: list[list[str]], nodes: int, per_node: int) -> list[list[str]]:
    """The built-in trainer's training command as ``srun torchrun`` on `nodes` nodes,
    `per_node` processes each, meeting at $OVERBRAINER_RDZV (job.sh sets it); one node:
    the commands as they are (torchrun --standalone when several processes)."""
    if nodes == 1:
        return commands
    out = []
    for command in commands:
        at = next((i for i in range(len(command) - 1) if command[i:i + 2] == ["-m", "overbrainer.trainers.builtin"]), None)
        if at is not None:  # the loop and its arguments (config.yaml, --device...)
            command = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable, "-m",
                       "torch.distributed.run", "--nnodes=${SLURM_NNODES}", f"--nproc-per-node={per_node}",
                       "--rdzv-backend=c10d", "--rdzv-endpoint=${OVERBRAINER_RDZV}", "--rdzv-id=${SLURM_JOB_ID}",
                       *command[at:]]
        out.append(command)
    return out


class Slurm:
    """Run the job as a Slurm batch job (see the module docstring)."""

    name = "slurm"

    def __init__(self, settings: SlurmSettings, processes: int = 1, say: Callable[[str], None] = print,
                 tell: Callable[..., None] = lambda **fields: None, base=None, hashes=None, plan_dir: Path | None = None):
        self.settings, self.processes, self.say, self.tell = settings, processes, say, tell
        self.base, self.hashes = base, hashes
        self.poll_s = float(os.environ.get("OVERBRAINER_SLURM_POLL") or 5)
        self.staged: Path | None = None  # the job folder under workdir, when the plan names one
        if settings.workdir:
            self.workdir = (Path(plan_dir or ".") / Path(settings.workdir).expanduser()).absolute()
        else:
            self.workdir = None

    @property
    def where(self) -> str:
        return f"slurm:{self.settings.partition}" if self.settings.partition else "slurm"

    def note(self, log: Path, message: str, step: str = "train") -> None:
        self.say(f"{step}: {message}")
        append_log(log, message if step == "train" else f"{step}: {message}")

    def record(self, folder: RunFolder, step: str, job: str) -> None:
        """The job in run.json: the one followed now (slurm_job), and the step's (slurm_jobs)."""
        from .. import journal

        jobs = journal.read(folder).get("slurm_jobs") or {}
        self.tell(slurm_job=job, slurm_jobs={**jobs, step: job})

    @staticmethod
    def require_sbatch(step: str) -> None:
        if shutil.which("sbatch") is None:
            raise OverbrainerError(f"{step}: the plan asks for Slurm (where.slurm) but there is no sbatch on the PATH; "
                                   "bake on a machine of the cluster (a login node), or change where")

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        self.require_sbatch("train")
        run_dir = Path(run_dir)
        folder = RunFolder(run_dir)
        fp = env[FINGERPRINT_ENV]
        if self.workdir is not None:
            self.staged = self.workdir / f"{folder.name}-{fp[:8]}"
        else:
            trainer.prepare(run_dir, str(run_dir))
        submitted = read_json(folder.slurm / _submitted("train")) or {}
        jobs = submitted.get("jobs", []) if submitted.get("fingerprint") == fp else []
        job = jobs[-1] if jobs else None
        state = job_state(job) if job else None
        end = read_json(self.end_file(folder, job)) if job else None
        if state is not None and state.in_queue:
            self.note(log, f"following Slurm job {job}, {state.state.lower()}")
        elif (state is not None and state.state == "COMPLETED" and end and end["exit"] == 0 and not end["signal"]
              and not folder.stopped_marker.exists()):  # a job that stopped early is gone on by a new one
            self.note(log, f"Slurm job {job} had ended well while nothing here followed it: taking it up")
        else:
            job = self.submit(trainer, folder, fp, env, jobs)
        while True:
            self.record(folder, "train", job)
            outcome = self.follow(job, folder, log, poll)
            if self.staged is not None:
                self.bring_back(trainer, folder, fp, job, log)
            if outcome != "again":
                return outcome
            jobs = read_json(folder.slurm / _submitted("train"))["jobs"]
            job = self.submit(trainer, folder, fp, env, jobs)

    def end_file(self, folder: RunFolder, job: str) -> Path:
        """Where the job says how it ended: slurm/end-<id>.json of the run folder, or of the
        staged job folder."""
        return (self.staged / RUN if self.staged is not None else folder.root) / "slurm" / f"end-{job}.json"

    # -- workdir: the job staged as an export bundle's job folder ---------------------------

    def stage(self, trainer: Trainer, folder: RunFolder, fp: str) -> None:
        """The job folder under workdir, made afresh from the run folder (what the export
        bundle holds: config, splits, the newest checkpoint, the base model, MANIFEST.json)."""
        from . import bundle

        home = self.staged
        home.parent.mkdir(parents=True, exist_ok=True)
        tmp = home.with_name(f".{home.name}.staging")
        staged = bundle.stage_job(trainer, folder.root, fp, self.base, str(home / RUN), tmp, self.hashes,
                                  carry_base=True)
        for arc, path in staged.members:
            dest = tmp / arc
            if not path.is_relative_to(tmp):  # the base, a checkpoint: copied in, checked by the manifest
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
        for arc in ("run.py", "run.sh"):
            (tmp / arc).chmod(0o755)
        shutil.rmtree(home, ignore_errors=True)
        os.replace(tmp, home)
        self._log_from = 0  # its log.txt starts again

    def bring_back(self, trainer: Trainer, folder: RunFolder, fp: str, job: str, log: Path) -> None:
        """The staged job's result (result.tar.gz, which its runner packs), into the run
        folder with receive's checks: its fingerprint, every file against its result.json."""
        from ..portable import runner as jobfile
        from .receive import ImportRefused, receive

        end = read_json(self.staged / jobfile.END) or {}
        if end.get("error"):
            raise RunFailed(f"the Slurm job {job} could not run its staged job: {end['error']}",
                            log_tail=_tail(self.staged / RUN / "log.txt"))
        result = self.staged / jobfile.RESULT
        if not result.is_file():
            raise RunFailed(f"the Slurm job {job} ended without its result ({result})",
                            log_tail=_tail(self.staged / RUN / "slurm" / f"{job}.out"))
        art = trainer.artifacts()
        # the log came already, as it was written (mirror)
        artifacts = {"entries": list(art.entries), "exclude": [*art.exclude, "log.txt"], "required": art.required}
        try:
            got = receive(folder.root, result, artifacts, fp, self.hashes, shown=f"the Slurm job {job}'s result")
        except ImportRefused as e:
            raise RunFailed(str(e)) from None
        self.note(log, f"the Slurm job {job}'s result is back from {self.staged} ({got.files} files)")

    def submit(self, trainer: Trainer, folder: RunFolder, fp: str, env: dict[str, str], jobs: list[str]) -> str:
        """Write job.sh and slurm/job.json, sbatch it; the job id. Slurm's refusal is one
        line, with nothing of it left behind."""
        folder.slurm.mkdir(exist_ok=True)
        name = folder.name
        if self.staged is not None:
            self.stage(trainer, folder, fp)  # the trainer's prepare() runs on the staged copy
            (self.staged / RUN / "slurm").mkdir(exist_ok=True)
            script = job_script(self.staged / RUN, name, self.settings, staged=self.staged)
        else:
            spec = {
                "commands": across_nodes(trainer.commands(), self.settings.nodes, self.processes),
                "env": {**trainer.env(str(folder.root)), **env},
                "metrics_file": trainer.metrics_file(), "stages": trainer.stages(), "stop_marker": trainer.stop_marker(),
                "metrics_required": trainer.metrics_required(),
            }
            write_json(folder.slurm / _JOB, spec)
            script = job_script(folder.root, name, self.settings)
        return self.sbatch(folder, "train", script, fp, jobs)

    def sbatch(self, folder: RunFolder, step: str, script: str, fp: str, jobs: list[str]) -> str:
        """Write a step's batch script (job.sh for training, else slurm/<step>.sh) and
        submit it; the job id, recorded. Slurm's refusal is one line, with nothing of it
        left behind."""
        path = folder.job_sh if step == "train" else folder.slurm / f"{step}.sh"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(script)
        os.replace(tmp, path)
        try:
            out = _slurm(["sbatch", "--parsable", str(path)])
        except (OSError, subprocess.TimeoutExpired) as e:
            raise OverbrainerError(f"{step}: sbatch did not answer ({e}); check the cluster (`sinfo`)") from None
        if out.returncode != 0 or not out.stdout.strip():
            path.unlink(missing_ok=True)
            (folder.slurm / spec_name(step)).unlink(missing_ok=True)
            raise OverbrainerError(f"{step}: Slurm refused the job: {_one_line(out.stderr or out.stdout)} "
                                   "(check where.slurm in the plan)")
        job = out.stdout.strip().split(";")[0]  # "id;cluster" on a federation
        write_json(folder.slurm / _submitted(step), {"fingerprint": fp, "jobs": [*jobs, job]})
        self.record(folder, step, job)
        return job

    def run_step(self, step: str, command: list[str], run_dir: Path, fp: str, log: Path,
                 poll: Callable[[], None] = lambda: None) -> tuple[str, int]:
        """A step after training (merge, bake) as a Slurm job of its own on one node:
        `command` run in the run folder, its output into `log`, followed like the train
        job (a job of this fingerprint still in the queue is followed again, not sent
        twice); the job id and its exit code. A job that ended badly raises RunFailed."""
        self.require_sbatch(step)
        folder = RunFolder(Path(run_dir))
        folder.slurm.mkdir(exist_ok=True)
        submitted = read_json(folder.slurm / _submitted(step)) or {}
        jobs = submitted.get("jobs", []) if submitted.get("fingerprint") == fp else []
        job = jobs[-1] if jobs else None
        state = job_state(job) if job else None
        if state is not None and state.in_queue:
            self.note(log, f"following Slurm job {job}, {state.state.lower()}", step)
            self.record(folder, step, job)
        else:
            write_json(folder.slurm / spec_name(step), {
                "commands": [command], "env": {FINGERPRINT_ENV: fp}, "metrics_file": folder.metrics.name,
                "stages": [], "stop_marker": None, "metrics_required": False,
            })
            one_node = self.settings.model_copy(update={"nodes": 1})
            job = self.sbatch(folder, step, job_script(folder.root, folder.name, one_node, step=step), fp, jobs)
            self.note(log, f"submitted as Slurm job {job}", step)
        outcome = self.follow(job, folder, log, poll, step)
        return job, 0 if outcome == "again" else outcome  # "again": it ended well all the same

    def follow(self, job: str, folder: RunFolder, log: Path, poll: Callable[[], None],
               step: str = "train") -> int | str:
        """Follow the job until it leaves the queue: its exit code, or "again" when it ended
        on Slurm's warning signal (its time limit) and the next job must go on."""
        told = None
        missing = 0
        while True:
            if self.staged is not None:
                self.mirror(folder, log)
            poll()
            state = job_state(job)
            if state is None:
                missing += 1
                if missing >= 3:
                    break
            elif state.in_queue:
                missing = 0
                if self.staged is not None and folder.stop_request.exists() and not (self.staged / RUN / "stop").exists():
                    shutil.copyfile(folder.stop_request, self.staged / RUN / "stop")  # the user's stop, passed on
                if folder.stop_request.exists() and state.state == "PENDING" and not slurm_made(folder.stop_request):
                    _slurm(["scancel", job])
                    self.note(log, f"cancelled Slurm job {job}, still pending, on request", step)
                    if step != "train":
                        raise RunStopped(f"stopped before {step}, on request (its Slurm job {job} had not started); "
                                         "bake again to go on")
                    return self.stopped_before_start(folder)
                shown = ("queued", f"Slurm: {state.reason}") if state.state == "PENDING" else ("running", None)
                if shown != told:
                    self.tell(state=shown[0], reason=shown[1])
                    if shown[0] == "queued":
                        self.note(log, f"Slurm job {job} is pending ({state.reason})", step)
                    told = shown
            else:
                break
            time.sleep(self.poll_s)
        if self.staged is not None:
            self.mirror(folder, log)
        end = read_json(self.end_file(folder, job))
        out = self.end_file(folder, job).parent / f"{job}.out"  # Slurm's own output of the job
        if self.staged is not None and end is not None:
            from ..portable import runner as jobfile

            said = (read_json(self.staged / jobfile.END) or {}).get("error")
            if said:  # its runner refused it: a file that differs from the manifest, the base's pin
                raise RunFailed(f"the Slurm job {job} could not run its staged job in {self.staged}: {said}",
                                log_tail="")
        ended = state.state if state else "gone"
        if end is None and exit_code(job) == UNSEEN_EXIT:
            raise RunFailed(f"the Slurm job {job} cannot see the run folder {folder.root}: it is not on a filesystem "
                            "the cluster's nodes share; bake with --runs on the shared filesystem, or set where.slurm.workdir "
                            "to a folder they see", log_tail="")
        if ended != "COMPLETED" and not (ended == "gone" and end is not None):
            raise RunFailed(ended_line(job, step, state), log_tail=_tail(out))
        if end is None:
            raise RunFailed(f"the Slurm job {job} ended without running its commands; see {out}",
                            log_tail=_tail(out))
        if end.get("signal") and end["exit"] == 0 and not folder.stop_request.exists():
            if step != "train":
                return end["exit"]  # its work is done: nothing goes on from a checkpoint
            folder.stopped_marker.unlink(missing_ok=True)  # not a stop on request: the next job goes on
            self.note(log, f"Slurm job {job} saved a checkpoint before its time limit; submitting the next")
            return "again"
        return end["exit"]

    def mirror(self, folder: RunFolder, log: Path) -> None:
        """The staged job's metrics and log, shown in the run folder as they grow (the
        result brings back the metrics file itself, checked)."""
        there = self.staged / RUN
        try:
            metrics = (there / "metrics.jsonl").read_bytes()
            if not folder.metrics.exists() or folder.metrics.read_bytes() != metrics:
                write_atomic(folder.metrics, metrics)
        except OSError:
            pass
        try:
            with open(there / "log.txt", "rb") as f:
                f.seek(self._log_from)
                more = f.read()
        except OSError:
            return
        if more:
            with open(log, "ab") as out:
                out.write(more)
            self._log_from += len(more)

    _log_from = 0

    def stopped_before_start(self, folder: RunFolder) -> int:
        """A stop while the job was still pending: stopped where its checkpoints are."""
        from ..trainers import checkpoint as ckpt

        done = ckpt.complete(folder.checkpoints)
        write_json(folder.stopped_marker, {"step": done[-1][0] if done else 0, "steps": None})
        return 0


def _submitted(step: str) -> str:
    return _SUBMITTED if step == "train" else f"submitted-{step}.json"


def ended_line(job: str, step: str, state: JobState | None) -> str:
    """A job that did not complete, in one line: Slurm's state and reason, what the next
    bake does, and for OUT_OF_MEMORY (the job went over the memory Slurm gave it) what to
    ask for or lower."""
    ended = state.state if state else "gone"
    reason = "" if state is None or state.reason in ("None", "") else f" ({state.reason})"
    if ended == "gone":
        ended = "without a trace (squeue, scontrol and sacct do not know it)"
    again = "go on from its last checkpoint" if step == "train" else f"run {step} again"
    line = f"the Slurm job {job}{_of(step)} ended {ended}{reason}; bake again to {again}"
    if ended == "OUT_OF_MEMORY":
        line += '; it went over the memory Slurm gave it: ask for more (where.slurm.sbatch: ["--mem=..."])'
        if step == "train":
            line += ", or need less: train.gradient_checkpointing if it is off, a lower train.micro_batch_size"
    return line


def _of(step: str) -> str:
    return "" if step == "train" else f" ({step})"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- the job's side -----------------------------------------------------------------------


def job_main(run_dir: Path, step: str = "train") -> int:
    """What job.sh runs in the job: the commands of slurm/job.json (``${VAR}`` in them
    expanded from the job's environment), like every target runs them. On SIGUSR1 (Slurm's
    warning before the time limit) or SIGTERM (scancel, preemption) it writes the run's
    stop file: the trainer saves a checkpoint at its next step and ends. A `step` after
    training (slurm/<step>.sh) runs slurm/job-<step>.json the same way."""
    from ..portable.common import run_commands

    folder = RunFolder(Path(run_dir))
    job = read_json(folder.slurm / spec_name(step))
    job_id = os.environ.get("SLURM_JOB_ID", "unknown")
    got: list[int] = []

    def warned(signum, frame):
        got.append(signum)
        if not folder.stop_request.exists():
            folder.stop_request.write_text(f"slurm signal {signal.Signals(signum).name}\n")

    signal.signal(signal.SIGUSR1, warned)
    signal.signal(signal.SIGTERM, warned)
    if slurm_made(folder.stop_request):
        # left by this job's run before a requeue (preemption, scontrol requeue) that was
        # killed before it could take it away: the run goes on from its checkpoint
        folder.stop_request.unlink(missing_ok=True)
    (folder.slurm / f"end-{job_id}.json").unlink(missing_ok=True)
    commands = [[os.path.expandvars(arg) for arg in command] for command in job["commands"]]
    code = run_commands(commands, folder.root, {**os.environ, **job["env"]}, folder.log,
                        metrics_file=job["metrics_file"], stages=job["stages"], stop_marker=job["stop_marker"],
                        metrics_required=job["metrics_required"])
    if got and slurm_made(folder.stop_request):
        folder.stop_request.unlink(missing_ok=True)  # the stop was Slurm's, not the user's
    write_json(folder.slurm / f"end-{job_id}.json",
               {"job": job_id, "exit": code, "signal": signal.Signals(got[0]).name if got else None, "ended": now()})
    return code


def staged_main(home: Path) -> int:
    """What job.sh runs for a staged job (workdir): the job folder's own runner (its files
    checked against MANIFEST.json, the base against its pin, then the commands, then
    result.tar.gz), with Slurm's warning (SIGUSR1) asking the trainer to save and stop."""
    from ..portable import runner as jobfile

    run_dir = home / jobfile.RUN
    job_id = os.environ.get("SLURM_JOB_ID", "unknown")
    end = run_dir / "slurm" / f"end-{job_id}.json"
    end.unlink(missing_ok=True)
    got: list[int] = []

    def warned(signum, frame):
        got.append(signum)
        (run_dir / "stop").write_text(f"slurm signal {signal.Signals(signum).name}\n")

    signal.signal(signal.SIGUSR1, warned)
    code = jobfile.run_job(home, None, str(home / jobfile.RESULT), detached=False)
    if got and slurm_made(run_dir / "stop"):
        (run_dir / "stop").unlink(missing_ok=True)
    write_json(end, {"job": job_id, "exit": code, "signal": signal.Signals(got[0]).name if got else None,
                     "ended": now()})
    return code


if __name__ == "__main__":
    if not (sys.argv[1:2] == ["job"] and len(sys.argv) in (3, 4) or sys.argv[1:2] == ["staged"] and len(sys.argv) == 3):
        print("usage: python -m overbrainer.where.slurm job RUN_DIR [STEP] | staged JOB_DIR (what job.sh runs)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(job_main(Path(sys.argv[2]), *sys.argv[3:]) if sys.argv[1] == "job" else staged_main(Path(sys.argv[2])))
