"""The ssh target: the job on another machine, over the real OpenSSH client (the layout
there and the settings from the environment: ``where/__init__.py``)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OverbrainerError, RunFailed
from ..folder import LOG
from ..portable.common import append_log, log_line, write_atomic
from ..trainers.protocol import Trainer
from . import bundle, receive
from .bundle import FINGERPRINT_ENV
from .receive import taken_up

if TYPE_CHECKING:
    from ..hashing import HashCache
    from ..plan import SSHTarget
    from .bundle import Base

__all__ = ["SSH"]


class _Unreachable(Exception):
    """ssh itself failed (exit code 255): the connection, not the command."""


class SSH:
    """Run the job on another machine over OpenSSH (see the module docstring)."""

    name = "ssh"
    poll_s = 1.0  # seconds between two looks at the job
    patience = 5  # failed looks in a row before giving up following it

    def __init__(self, target: SSHTarget, base: Base, hashes: HashCache, plan_dir: Path,
                 say: Callable[[str], None] = print):
        if target.ssh.startswith("-"):
            raise OverbrainerError(f"where.ssh: {target.ssh!r} starts with '-'; give user@host, or a Host of ~/.ssh/config")
        self.dest, self.port, self.base, self.hashes, self.say = target.ssh, target.port, base, hashes, say
        identity = None
        if target.identity:
            identity = Path(target.identity).expanduser()
            identity = identity if identity.is_absolute() else Path(plan_dir) / identity
        self.identity = identity
        workdir = target.workdir
        if workdir == "~" or workdir.startswith("~/"):
            workdir = workdir[2:] or "."  # the session starts in the home folder
        self.workdir = workdir

    @property
    def where(self) -> str:
        port = f":{self.port}" if self.port else ""
        path = self.workdir if self.workdir.startswith("/") else f"/~/{self.workdir}"
        return f"ssh://{self.dest}{port}{path}"

    # -- the transport ---------------------------------------------------------------------

    def argv(self, command: str) -> list[str]:
        ssh = shlex.split(os.environ.get("OVERBRAINER_SSH_COMMAND") or "ssh")
        options = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                   "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
        if self.port:
            options += ["-p", str(self.port)]
        if self.identity:
            options += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        control = _control_dir()
        if control:  # one connection for the many short commands of a job, gone when idle
            options += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control}/%C", "-o", "ControlPersist=120"]
        return [*ssh, *options, self.dest, command]

    def close(self) -> None:
        """End the shared connection, if there is one."""
        if not _control_dir():
            return
        argv = self.argv("true")
        subprocess.run([*argv[:-2], "-O", "exit", argv[-2]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, start_new_session=True, check=False, timeout=30)

    def call(self, command: str, what: str, stdin: bytes | None = None, stdout=subprocess.PIPE,
             timeout: float | None = 120) -> bytes:
        """Run a shell command there; its stdout. ssh's own failures raise _Unreachable."""
        # never the terminal's stdin (ssh would forward it); its own session: a Ctrl-C meant
        # for the bake does not cut the connection
        proc = subprocess.Popen(self.argv(command), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=stdout, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise _Unreachable(f"no answer within {timeout:g} s") from None
        message = (err or b"").decode(errors="replace").strip().splitlines()
        if proc.returncode == 255:
            raise _Unreachable(message[-1] if message else "ssh failed")
        if proc.returncode != 0:
            tail = f": {message[-1]}" if message else ""
            raise OverbrainerError(f"{self.dest}: {what} failed there (exit code {proc.returncode}){tail}")
        return out or b""

    def must(self, command: str, what: str, **options) -> bytes:
        """`call`, with a connection failure said as what the user must check."""
        try:
            return self.call(command, what, **options)
        except _Unreachable as e:
            port = f" -p {self.port}" if self.port else ""
            raise OverbrainerError(
                f"cannot reach {self.dest} over ssh ({e}); check where.ssh, its port and identity: "
                f"`ssh{port} {self.dest} true` must work without a password prompt"
            ) from None

    def call_json(self, command: str, what: str, **options):
        out = self.must(command, what, **options)
        try:
            return json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise OverbrainerError(f"{self.dest}: {what}: unexpected answer {out[-200:]!r}") from None

    def send_tar(self, write: Callable, into: str, what: str) -> None:
        """Stream a tar (what `write(stream)` writes) into the folder `into` there."""
        with tempfile.TemporaryFile() as errors:  # a file, not a pipe: nothing waits on it
            proc = subprocess.Popen(self.argv(f"mkdir -p {q(into)} && tar -xf - -C {q(into)}"), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
            try:
                write(proc.stdin)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            code = proc.wait()
            errors.seek(0)
            err = errors.read().decode(errors="replace").strip()
        if code != 0:
            raise OverbrainerError(f"{self.dest}: sending {what} failed: {err.splitlines()[-1] if err else 'ssh failed'}")

    def note(self, log: Path, message: str) -> None:
        """Say it, and write it in the run's log (a detached bake says nothing)."""
        self.say(f"train: {message}")
        append_log(log, message)

    # -- the job -----------------------------------------------------------------------------

    def run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
            poll: Callable[[], None] = lambda: None) -> int:
        try:
            return self._run(trainer, Path(run_dir), env, log, poll)
        finally:
            self.close()

    def _run(self, trainer: Trainer, run_dir: Path, env: dict[str, str], log: Path,
             poll: Callable[[], None]) -> int:
        fp = env[FINGERPRINT_ENV]
        root = self.must(f"mkdir -p {q(self.workdir)} && cd {q(self.workdir)} && pwd", "making the work folder").decode().strip()
        python = self.tools(trainer, root, log)
        job_dir = f"{root}/runs/{run_dir.name}-{fp[:8]}"
        runner = f"cd {q(job_dir)} && {q(python)} run.py"
        status = self.call_json(f"if test -f {q(job_dir)}/run.py; then {runner} status; else echo null; fi", "reading the job's state")
        there: dict[str, str] = {}
        if status and status["running"]:
            self.note(log, f"following the job already running on {self.dest} ({job_dir})")
            log_from = status["log_start"]
        else:
            if status:  # an earlier attempt left a job folder: bring back what it has first
                earlier = self.fetch(trainer, run_dir, runner, fp)
                if earlier.state == "done" and (status.get("end") or {}).get("exit") == 0:
                    self.note(log, f"the job on {self.dest} had ended well: its artifacts are back")
                    return 0  # it ended after this side stopped following it (a bake killed here)
                there = earlier.listed
            base_dir = self.send_base(root, log)
            extra = {"OVERBRAINER_TOOLS": f"{root}/tools"} if trainer.caches_tools() else {}
            staging = run_dir / f".send-{os.getpid()}"
            try:
                staged = bundle.stage_job(trainer, run_dir, fp, self.base, f"{job_dir}/{_RUN}", staging, self.hashes,
                                            carry_base=False, env=extra)
                # what the job folder there already has, byte for byte, is not sent again
                staged.members = [(arc, p) for arc, p in staged.members if not _same(arc, staged.manifest, there)]
                self.note(log, f"sending the job to {self.dest}:{job_dir}")
                self.send_tar(lambda out: bundle.write_job_tar(staged, out), job_dir, "the job")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            started = self.call_json(f"{runner} start --base {q(base_dir)}", "starting the job")
            log_from = started["log_start"]
        end = self.follow(trainer, run_dir, job_dir, runner, log, log_from, poll)
        self.note(log, f"the job on {self.dest} ended ({_ended(end)}); bringing back its artifacts")
        received = self.fetch(trainer, run_dir, runner, fp)
        return taken_up({"state": received.state, "reason": received.reason}, log, f"on {self.dest}, {job_dir}")

    def tools(self, trainer: Trainer, root: str, log: Path) -> str:
        """The Python there that runs the job: $OVERBRAINER_REMOTE_PYTHON, else a venv made
        once under tools/ with the trainer's packages."""
        from ..hashing import hash_bytes

        given = os.environ.get("OVERBRAINER_REMOTE_PYTHON")
        if given:
            return given
        spec = shlex.split(os.environ.get("OVERBRAINER_REMOTE_INSTALL", "")) or bundle.requirements(trainer)
        venv = f"{root}/tools/{trainer.name}-{hash_bytes(json.dumps(spec).encode())[:12]}"
        python = f"{venv}/bin/python"
        if self.must(f"test -f {q(venv)}/.ready && echo yes || echo no", "looking for its tools").strip() == b"yes":
            return python
        self.say(f"train: installing {' '.join(spec)} on {self.dest} into {venv} (once)")
        with open(log, "ab") as out:
            out.write(log_line(f"installing {' '.join(spec)} on {self.dest} into {venv}").encode())
            out.flush()
            self.must(
                f"rm -rf {q(venv)} && python3 -m venv {q(venv)} && {q(python)} -m pip install --quiet "
                f"{' '.join(map(q, spec))} && touch {q(venv)}/.ready",
                f"installing {' '.join(spec)} (see {log})", stdout=out, timeout=None,
            )
        return python

    def send_base(self, root: str, log: Path) -> str:
        """The base model's folder there, sent once per pin."""
        from ..portable import runner as jobfile

        folder = f"{root}/bases/{self.base.pin[:16]}"
        if self.must(f"test -f {q(folder)}/.complete && echo yes || echo no", "looking for the base").strip() == b"yes":
            return folder
        self.note(log, f"sending the base model to {self.dest}:{folder} (once)")

        def write(out):
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for f in self.base.files:
                    jobfile.add_file(tar, f["path"], self.base.folder / f["path"])

        tmp = f"{folder}.tmp"
        self.must(f"rm -rf {q(tmp)}", "clearing a half-sent base")
        self.send_tar(write, tmp, "the base model")
        self.must(f"rm -rf {q(folder)} && mv {q(tmp)} {q(folder)} && touch {q(folder)}/.complete", "putting the base in place")
        return folder

    def follow(self, trainer: Trainer, run_dir: Path, job_dir: str, runner: str, log: Path, log_from: int,
               poll: Callable[[], None]) -> dict:
        """Mirror the job's metrics file and log here until it ends; pass a stop on. Returns
        its end record."""
        from ..folder import RunFolder

        metrics = run_dir / trainer.metrics_file()
        stop = RunFolder(run_dir).stop_request
        m_from, m_inode, l_from = 0, -1, log_from
        failures, stop_sent, gone = 0, 0.0, 0
        while True:
            try:
                now = json.loads(self.call(f"{runner} poll {m_from} {m_inode} {l_from}", "following the job").decode())
                failures = 0
            except (_Unreachable, ValueError) as e:
                failures += 1
                if failures >= self.patience:
                    raise RunFailed(f"lost {self.dest} while following the job ({e}); it goes on there: bake again to "
                                    "follow it") from None
                time.sleep(self.poll_s)
                continue
            m, lg = now["metrics"], now["log"]
            data = base64.b64decode(m["data"])
            if m["inode"] is not None:
                if m["from"] == 0 and (m_from != 0 or m_inode != m["inode"]):
                    write_atomic(metrics, data)  # a new file there (the trainer rewrote it on resume)
                elif data:
                    with open(metrics, "ab") as f:
                        f.write(data)
                m_from, m_inode = m["from"] + len(data), m["inode"]
            text = base64.b64decode(lg["data"])
            if text:
                with open(log, "ab") as f:
                    f.write(text)
                l_from += len(text)
            poll()
            more = len(data) >= 8 << 20 or len(text) >= 1 << 20
            if now["end"] is not None and not more:
                return now["end"]
            if not now["running"] and now["end"] is None:
                gone += 1
                if gone >= 2:
                    out = self.call(f"tail -n 15 {q(job_dir)}/runner.out", "reading its output")
                    raise RunFailed(f"the job on {self.dest} ended without saying how", log_tail=out.decode(errors="replace"))
            if stop.exists() and time.monotonic() - stop_sent > 10:
                self.must(f"{runner} stop", "passing the stop on")
                self.note(log, f"asked the job on {self.dest} to save a checkpoint and stop")
                stop_sent = time.monotonic()
            if not more:
                time.sleep(self.poll_s)

    def fetch(self, trainer: Trainer, run_dir: Path, runner: str, fp: str):
        """Bring the job's artifacts back (those this side lacks), verified against the
        manifest run.py computes there; a receive.Received."""

        art = trainer.artifacts()
        artifacts = {"entries": list(art.entries), "exclude": list(art.exclude), "required": art.required}
        have = receive.local_have(run_dir, artifacts, self.hashes)
        incoming = run_dir / f".incoming-{os.getpid()}.tar"
        try:
            with open(incoming, "wb") as out:
                # the log came already, as it was written
                self.must(f"{runner} pack --have - --skip {LOG}", "packing its artifacts",
                          stdin=json.dumps(have).encode(), stdout=out, timeout=None)
            return receive.receive(run_dir, incoming, artifacts, fp, self.hashes,
                                    shown=f"the job's artifacts from {self.dest}")
        finally:
            incoming.unlink(missing_ok=True)


_RUN = "run"


def q(value: str) -> str:
    return shlex.quote(value)


def _same(arc: str, manifest: list[dict], there: dict[str, str]) -> bool:
    """Whether the job folder there has the run file `arc` (run/...) with this content."""
    if not arc.startswith(f"{_RUN}/"):
        return False
    entry = next((f for f in manifest if f["path"] == arc), None)
    return entry is not None and there.get(arc[len(_RUN) + 1:]) == entry["hash"]


def _ended(end: dict) -> str:
    if end.get("error"):
        return f"could not run: {end['error']}"
    if end.get("exit"):
        return f"exit code {end['exit']}"
    return "stopped on request" if end.get("stopped") else "done"


def _control_dir() -> str | None:
    """A folder for ssh's connection sockets, this user's alone (else no sharing): short,
    for the socket path limit."""
    folder = Path(tempfile.gettempdir()) / f"overbrainer-ssh-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return str(folder)
