"""A job, as it runs on any machine: the ``run.py`` of every bundle and remote job folder.

overbrainer ships this folder (``portable/``) into each job folder it sends away, as
``overbrainer_portable/``, with a ``run.py`` that runs `main` (``where/bundle.py`` writes
the rest). It needs Python 3.8+ and, to hash what it brings back, the ``blake3`` package
(overbrainer depends on it; elsewhere ``pip install blake3``). It imports nothing of
overbrainer, so that a machine with only the trainer's own packages can run it.

A job folder::

    run.py          runs `main` of overbrainer_portable/runner.py (this file)
    overbrainer_portable/   this folder: the runner and the helpers it shares
    run.sh          ``sh run.sh [--base PATH]``: run.py with $PYTHON (default python3)
    job.json        what to run: the trainer's commands and environment (no secrets), its
                    stages, metrics file, stop marker and artifacts; the job's fingerprint;
                    the base model's pinned files (path, size, blake3)
    MANIFEST.json   every file of the job as sent (path, size, blake3): checked first
    README.txt      how to run it and bring the result back
    run/            the run folder as the trainer sees it, where its commands run:
                    config.yaml (its base_model is ``../base``), train.parquet and
                    validation.parquet, what the trainer's prepare() wrote, metrics.jsonl
                    and the newest checkpoint so far
    base/           the base model: carried in the bundle, or a link to ``--base PATH``, or
                    downloaded from the hub at its pinned commit; verified before training

and once it has run::

    run/log.txt     the commands' output, appended
    end.json        how it ended: exit code, stopped early or not, seconds
    job.pid         while it runs: its process (pid and start time)
    result.tar.gz   what overbrainer brings back: result.json (how it ended, and every
                    file's path, size and blake3) and the trainer's artifacts, excluded
                    patterns left out, the files the bundle carried listed but not repeated

Commands::

    python run.py [--base PATH] [--result FILE]   run the job here, then pack its result
    python run.py stop                            ask the running job to save and stop
    python run.py start|status|poll|pack          what overbrainer uses over ssh

Run it again after a stop or a crash: the trainer continues from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import common
from .common import LOG, STOP, now, proc_start, read_json, write_json

FORMAT = 1
RUN = "run"  # the run folder, inside the job folder
END = "end.json"
PID = "job.pid"
RESULT = "result.tar.gz"
RESULT_JSON = "result.json"
CHUNK = 1 << 20


class JobError(Exception):
    """Something about the job folder or its base model: one line, exit code 2."""


# -- hashing ------------------------------------------------------------------------------


def blake3_of(path: Path) -> str:
    try:
        import blake3
    except ImportError:
        raise JobError("this job hashes files with blake3: `pip install blake3`, then run it again") from None
    hasher = blake3.blake3()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 * CHUNK), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


class Hashes:
    """Hashes of files that have not changed since they were hashed (inode, size, mtime),
    kept beside the job: packing a result does not reread checkpoints already hashed."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_json(path) or {}

    def __call__(self, file: Path) -> str:
        st = file.stat()
        key = [st.st_ino, st.st_size, st.st_mtime_ns]
        entry = self.entries.get(str(file))
        if entry and entry[0] == key:
            return entry[1]
        digest = blake3_of(file)
        self.entries[str(file)] = [key, digest]
        return digest

    def save(self) -> None:
        try:
            write_json(self.path, self.entries)
        except OSError:
            pass  # a cache: losing it costs a rehash


def check_files(root: Path, files: list, what: str) -> None:
    """Every listed file (path, size, hash) is under `root` with that content."""
    for f in files:
        p = root / f["path"]
        if not p.is_file():
            raise JobError(f"{what}: {f['path']} is missing")
        if p.stat().st_size != f["size"] or blake3_of(p) != f["hash"]:
            raise JobError(f"{what}: {f['path']} differs from the one this job was made with")


# -- what to bring back -------------------------------------------------------------------


def excluded(rel: str, patterns: list) -> bool:
    """Whether any part of the relative path matches a pattern (``tar --exclude``)."""
    return any(fnmatch.fnmatchcase(part, pat) for part in rel.split("/") for pat in patterns)


def artifact_files(run_dir: Path, entries: list, exclude: list) -> list:
    """The regular files under the artifacts' entries, relative to the run folder, sorted;
    excluded names and links are left out, missing entries skipped."""
    out = []
    for entry in entries:
        top = run_dir / entry
        if top.is_symlink() or excluded(entry, exclude):
            continue
        if top.is_file():
            out.append(entry)
        elif top.is_dir():
            for folder, dirs, names in os.walk(top):
                rel_dir = Path(folder).relative_to(run_dir).as_posix()
                dirs[:] = sorted(d for d in dirs if not excluded(d, exclude) and not os.path.islink(os.path.join(folder, d)))
                for name in sorted(names):
                    p = Path(folder) / name
                    if not excluded(name, exclude) and p.is_file() and not p.is_symlink():
                        out.append(f"{rel_dir}/{name}")
    return sorted(set(out))


def add_file(tar: tarfile.TarFile, arcname: str, path: Path, size: int | None = None, mode: int = 0o644) -> None:
    """A regular file as a plain tar member: no owner, no link, nothing but its bytes."""
    st = path.stat()
    info = tarfile.TarInfo(arcname)
    info.size = st.st_size if size is None else size
    info.mtime = int(st.st_mtime)
    info.mode = mode
    with open(path, "rb") as f:
        tar.addfile(info, f)


def add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes, mode: int = 0o644) -> None:
    import io

    info = tarfile.TarInfo(arcname)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def pack(home: Path, job: dict, out, have: dict) -> dict:
    """Write the result as a tar to the binary stream `out`: result.json first, then every
    artifact file, except those `have` (path → hash) already names with this content."""
    art = job["artifacts"]
    run_dir = home / RUN
    hashes = Hashes(home / ".hashes.json")
    skip = set(art.get("skip", []))
    files = []
    for rel in artifact_files(run_dir, [e for e in art["entries"] if e not in skip], art.get("exclude", [])):
        p = run_dir / rel
        files.append({"path": rel, "size": p.stat().st_size, "hash": hashes(p)})
    hashes.save()
    result = {
        "format": FORMAT,
        "name": job["name"],
        "fingerprint": job["fingerprint"],
        "end": read_json(home / END),
        "files": files,
    }
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        add_bytes(tar, RESULT_JSON, (json.dumps(result, indent=1) + "\n").encode())
        for f in files:
            if have.get(f["path"]) != f["hash"]:
                add_file(tar, f["path"], run_dir / f["path"], size=f["size"])
    return result


# -- the base model -----------------------------------------------------------------------


def resolve_base(home: Path, job: dict, given: str | None) -> Path:
    """Make ``base/`` the base model this job was made with, verified file by file."""
    base, link = job["base"], home / "base"
    files = base["files"]
    if given:
        path = Path(given).expanduser().resolve()
        if link.is_dir() and not link.is_symlink():
            raise JobError("this job carries its base model (base/); run it without --base")
        check_files(path, files, f"--base {given}")
        if link.is_symlink():
            link.unlink()
        link.symlink_to(path, target_is_directory=True)
        return link
    if link.is_symlink() and not link.exists():
        link.unlink()  # a --base given before, since moved
    if link.exists():
        check_files(link, files, "base/")
        return link
    hub = base.get("hub")
    if hub:
        print(f"downloading the base model {hub['repo']} at {hub['commit'][:12]} from the hub", flush=True)
        tmp = home / ".base-download"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            try:
                from huggingface_hub import snapshot_download

                snapshot_download(hub["repo"], revision=hub["commit"], local_dir=tmp,
                                  allow_patterns=[f["path"] for f in files])
            except Exception as e:  # no package, no network, a gated repo without HF_TOKEN...
                raise JobError(
                    f"cannot download the base model {hub['repo']} from the hub ({type(e).__name__}: {e}); "
                    "download it elsewhere and give it with `python run.py --base PATH`"
                ) from None
            check_files(tmp, files, f"the hub's {hub['repo']}@{hub['commit'][:12]}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.replace(tmp, link)
        return link
    what = "base/ is not here" if base.get("carried") else "this job does not carry its base model"
    raise JobError(
        f"{what}: give the one it was made with, `python run.py --base PATH` "
        f"(a folder with {', '.join(f['path'] for f in files[:4])}...)"
    )


# -- running ------------------------------------------------------------------------------


def alive(info) -> bool:
    """Whether the process a job.pid names still runs (and is that process)."""
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return False
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    state, start = proc_start(info["pid"])
    if state == "Z":
        return False
    return start is None or info.get("start") is None or start == info["start"]


def run_commands(job: dict, run_dir: Path) -> int:
    """Every command of the job, as every target runs them (``common.run_commands``)."""
    env = {**os.environ, **job["env"]}
    try:
        return common.run_commands(job["commands"], run_dir, env, run_dir / LOG, metrics_file=job["metrics_file"],
                             stages=job.get("stages"), stop_marker=job.get("stop_marker"),
                             metrics_required=bool(job.get("metrics_required")))
    except OSError as e:
        raise JobError(f"cannot run {e.filename or job['commands'][0][0]} ({e.strerror}): install the trainer's "
                       f"packages here, `pip install {' '.join(job.get('install') or [])}`") from None


def run_job(home: Path, base: str | None, result: str | None, detached: bool) -> int:
    job = json.loads((home / "job.json").read_text())
    run_dir = home / RUN
    (home / END).unlink(missing_ok=True)
    if not detached:
        write_json(home / PID, {"pid": os.getpid(), "start": proc_start(os.getpid())[1]})
    started = time.monotonic()
    stop = run_dir / STOP

    def ask_stop(signum, frame):  # Ctrl-C, SIGTERM: the trainer saves and stops
        stop.write_text(f"signal {signum}\n")

    try:
        blake3_of(home / "job.json")  # fail now, not after hours of training
        manifest = json.loads((home / "MANIFEST.json").read_text())
        # the files the job appends to change; the base is checked against its pin below
        mutable = {f"{RUN}/{LOG}", f"{RUN}/{job['metrics_file']}"}
        sent = [f for f in manifest["files"] if f["path"] not in mutable and not f["path"].startswith("base/")]
        check_files(home, sent, "the job folder (copy it again)")
        resolve_base(home, job, base)
        stop.unlink(missing_ok=True)  # a new start: an old stop request is answered
        signal.signal(signal.SIGINT, ask_stop)
        signal.signal(signal.SIGTERM, ask_stop)
        code, error = run_commands(job, run_dir), None
    except JobError as e:
        code, error = 2, str(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
    marker = job.get("stop_marker")
    write_json(home / END, {
        "exit": code,
        "stopped": code == 0 and bool(marker) and (run_dir / marker).exists(),
        "error": error,
        "fingerprint": job["fingerprint"],
        "seconds": round(time.monotonic() - started, 1),
        "ended": now(),
    })
    (home / PID).unlink(missing_ok=True)
    if result is not None and error is None:
        carried = {f["path"][len(RUN) + 1:]: f["hash"] for f in manifest["files"] if f["path"].startswith(f"{RUN}/")}
        carried = {k: v for k, v in carried.items() if k not in (LOG, job["metrics_file"])}
        out = Path(result) if result else home / RESULT
        tmp = out.with_name(f".{out.name}.tmp")
        with open(tmp, "wb") as raw:
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as gz:
                pack(home, job, gz, carried)
        os.replace(tmp, out)
        state = "stopped on request" if (marker and (run_dir / marker).exists()) else ("done" if code == 0 else f"failed (exit code {code})")
        print(f"{state}; the result is {out}: bring it back with `overbrainer import {job['name']} {out}`, "
              "then bake again", flush=True)
    return code


def start(home: Path, base: str | None) -> dict:
    """Run the job in a process of its own, detached from the caller (an ssh session):
    return at once with its pid and where its log starts."""
    status_now = status(home)
    if status_now["running"]:
        return status_now
    (home / RUN).mkdir(exist_ok=True)
    log = home / RUN / LOG
    log_start = log.stat().st_size if log.exists() else 0
    (home / END).unlink(missing_ok=True)
    argv = [sys.executable, str(home / "run.py"), "run", "--no-result", "--detached"] + (["--base", base] if base else [])
    with open(home / "runner.out", "ab") as out:
        child = subprocess.Popen(argv, cwd=home, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
    write_json(home / PID, {"pid": child.pid, "start": proc_start(child.pid)[1], "log_start": log_start})
    return {**status(home), "log_start": log_start}


def status(home: Path) -> dict:
    job = read_json(home / "job.json") or {}
    end = read_json(home / END)  # read first: whatever is written before it is there
    pid = read_json(home / PID)
    return {
        "fingerprint": job.get("fingerprint"),
        "running": end is None and alive(pid),
        "end": end,
        "log_start": (pid or {}).get("log_start", 0),
    }


def _tail(path: Path, start: int, inode: int | None, limit: int) -> dict:
    """Bytes of `path` from `start`, or from 0 when it is another file than the one read so
    far (a trainer rewrote it) or shorter than that."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if (inode is not None and st.st_ino != inode) or st.st_size < start:
                start = 0
            f.seek(start)
            data = f.read(limit)
    except OSError:
        return {"inode": None, "from": 0, "data": ""}
    return {"inode": st.st_ino, "from": start, "data": base64.b64encode(data).decode()}


def poll(home: Path, metrics_from: int, metrics_inode: int | None, log_from: int) -> dict:
    job = json.loads((home / "job.json").read_text())
    now = status(home)  # first: what follows was written before an end it reports
    now["metrics"] = _tail(home / RUN / job["metrics_file"], metrics_from, metrics_inode, 8 * CHUNK)
    now["log"] = _tail(home / RUN / LOG, log_from, None, CHUNK)
    return now


def main(argv: list | None = None, home: Path | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.py", description="Run an overbrainer job on this machine.")
    sub = parser.add_subparsers(dest="command")
    for name in ("run", "start"):
        p = sub.add_parser(name)
        p.add_argument("--base", help="the base model's folder (verified against the job's pin)")
        if name == "run":
            p.add_argument("--result", help=f"where to write the result (default: {RESULT} here)")
            p.add_argument("--no-result", action="store_true", help=argparse.SUPPRESS)
            p.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)
    sub.add_parser("stop", help="ask the running job to save a checkpoint and stop")
    sub.add_parser("status")
    p = sub.add_parser("poll")
    p.add_argument("metrics_from", type=int)
    p.add_argument("metrics_inode", type=int)
    p.add_argument("log_from", type=int)
    p = sub.add_parser("pack")
    p.add_argument("--have", help="a JSON list of {path, hash} already brought back ('-': stdin)")
    p.add_argument("--skip", action="append", default=[], help="an artifact entry to leave out")
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    home = Path(home or Path.cwd()).resolve()
    try:
        if args.command == "run":
            result = None if args.no_result else (args.result or "")
            return run_job(home, args.base, result, args.detached)
        if args.command == "start":
            print(json.dumps(start(home, args.base)))
        elif args.command == "stop":
            (home / RUN / STOP).write_text(f"{now()}\n")
            print(f"asked the job in {home} to save a checkpoint and stop")
        elif args.command == "status":
            print(json.dumps(status(home)))
        elif args.command == "poll":
            inode = args.metrics_inode if args.metrics_inode >= 0 else None
            print(json.dumps(poll(home, args.metrics_from, inode, args.log_from)))
        elif args.command == "pack":
            job = json.loads((home / "job.json").read_text())
            job["artifacts"]["skip"] = args.skip
            listed = json.load(sys.stdin) if args.have == "-" else (read_json(Path(args.have)) if args.have else [])
            have = {f["path"]: f["hash"] for f in listed or []}
            pack(home, job, sys.stdout.buffer, have)
            sys.stdout.buffer.flush()
        return 0
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


