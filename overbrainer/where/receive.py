"""A job's result brought back into its run folder, verified (what ``bundle.py`` says
``receive`` does), and the record a bake takes up.

A result (``result.tar.gz``, or a tar streamed back over ssh) holds ``result.json``, how
the job ended and every artifact file's path, size and blake3, then the files. `receive`
brings one back into the run folder:

- the archive is bounded before anything is read in full: at most `MAX_MEMBERS` members, a
  result.json of at most `MAX_RESULT_JSON` bytes, each member's declared size equal to the one
  result.json lists, and their sum within the disk's free space;
- every member is checked before anything is written: ``..``, absolute paths, symbolic
  and hard links, devices, FIFOs, sparse files and anything but plain files and folders,
  and a file where the job brings back a folder (or the other way round) are refused,
  in one line, and nothing is extracted;
- members outside the trainer's artifacts, or absent from result.json, are refused; names
  matching its exclude patterns are left out;
- each file is hashed as it is written into a hidden folder of the run and compared with
  result.json; files result.json lists but the tar leaves out (the checkpoint the job was
  sent with) must be here already, with that hash;
- only then is anything moved into place: a checkpoint folder appears whole, a file
  replaces the older one, a file the job no longer has (its stop marker) is removed, and
  the job's log.txt is appended to the run's;
- a job that succeeded with nothing in the trainer's `required` entry is recorded failed,
  once what it had is brought back and verified.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .. import journal
from ..errors import OverbrainerError, RunFailed, RunStateError
from ..folder import EXPORT, IMPORTED, IMPORTED_USED, METRICS, RunFolder
from ..fsio import Busy, exclusive, write_atomic
from ..hashing import HashCache
from ..portable import runner as jobfile
from ..portable.common import log_line, now

__all__ = ["Received", "ImportRefused", "Imported", "receive", "import_result", "take_import", "local_have", "taken_up"]


class ImportRefused(OverbrainerError):
    """A result that cannot be brought back as it is: nothing of it was written."""


@dataclass
class Received:
    """A result brought back: how the job ended, and what came with it."""

    state: str  # done, stopped, failed
    reason: str | None
    exit: int | None
    files: int  # files written into the run folder
    bytes: int
    listed: dict[str, str]  # every file the job has (path → hash), some here already
    step: int | None  # the last logged step


# what a job's result may hold: more members, or a bigger manifest, is not a result
MAX_MEMBERS = 20_000
MAX_RESULT_JSON = 16 << 20


def _members(tar: tarfile.TarFile, refuse: Callable) -> list[tarfile.TarInfo]:
    """The archive's members, read one header at a time and no more than `MAX_MEMBERS`."""
    members = []
    try:
        while (member := tar.next()) is not None:
            members.append(member)
            if len(members) > MAX_MEMBERS:
                raise refuse(f"it holds more than {MAX_MEMBERS:,} members; a job's result has far fewer")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise refuse(f"the archive is damaged ({e}); copy it again") from None
    return members


def _folders(names: list[str], listed: dict, artifacts: dict, run_dir: Path) -> set[str]:
    """The names that must be folders: every parent of a member or a listed file, the
    `required` entry (it holds the trained model's files), and entries that are folders in
    the run folder already."""
    out = {artifacts["required"]} if artifacts.get("required") else set()
    for path in [*names, *listed]:
        parts = path.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    out.update(e for e in artifacts["entries"] if (run_dir / e).is_dir() and not (run_dir / e).is_symlink())
    return out


def _refusal(member: tarfile.TarInfo) -> str | None:
    """Why a tar member may not be extracted, or None."""
    name = member.name
    if not name or "\x00" in name:
        return "has an empty or invalid name"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "would land outside the run folder (..)"
    if member.issym():
        return f"is a symbolic link (to {member.linkname!r})"
    if member.islnk():
        return f"is a hard link (to {member.linkname!r})"
    if member.ischr() or member.isblk():
        return "is a device file"
    if member.isfifo():
        return "is a FIFO"
    if member.issparse():
        return "is a sparse file (a job writes plain files only)"
    if not (member.isreg() or member.isdir()):
        return "is not a plain file or folder"
    return None


def _clean(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts)


def _inside(path: str, entry: str) -> bool:
    return path == entry or path.startswith(entry.rstrip("/") + "/")


def receive(run_dir: Path, archive: Path, artifacts: dict, fingerprint: str, hashes: HashCache,
            shown: str | None = None, log_header: str | None = None) -> Received:
    """Bring the result in `archive` (a tar, compressed or not) into the run folder, checked
    as the module docstring says. Raises ImportRefused (nothing written) when it cannot."""
    run_dir = Path(run_dir)
    shown = shown or str(archive)

    def refuse(why: str):
        return ImportRefused(f"{shown}: refused, nothing imported: {why}")

    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise refuse(f"not a readable tar archive ({e})") from None
    with tar:
        members = _members(tar, refuse)
        bad = [(m.name, why) for m in members if (why := _refusal(m))]
        if bad:
            more = f" (and {len(bad) - 1} more members refused)" if len(bad) > 1 else ""
            raise refuse(f"member {bad[0][0]!r} {bad[0][1]}{more}")
        names = [_clean(m.name) for m in members]
        twice = sorted(n for n, count in Counter(names).items() if count > 1 and n)
        if twice:
            raise refuse(f"member {twice[0]!r} appears twice")
        files = {n: m for n, m in zip(names, members) if m.isreg()}
        if jobfile.RESULT_JSON not in files:
            raise refuse(f"it has no {jobfile.RESULT_JSON}: it is not the result of an overbrainer job")
        result_member = files.pop(jobfile.RESULT_JSON)
        if result_member.size > MAX_RESULT_JSON:
            raise refuse(f"its {jobfile.RESULT_JSON} is {result_member.size:,} bytes, more than the "
                         f"{MAX_RESULT_JSON:,} a job's manifest can be")
        try:
            result = json.loads(tar.extractfile(result_member).read())
            listed = {f["path"]: f for f in result["files"]}
            if not all(isinstance(p, str) and isinstance(f["size"], int) and isinstance(f["hash"], str)
                       for p, f in listed.items()):
                raise TypeError("a file without a path, size or hash")
        except (ValueError, KeyError, TypeError, AttributeError, tarfile.TarError) as e:
            raise refuse(f"its {jobfile.RESULT_JSON} is unreadable ({e})") from None
        if result.get("fingerprint") != fingerprint:
            raise refuse(
                f"it is the result of another job (fingerprint {str(result.get('fingerprint'))[:12]}), not of this run's "
                f"({fingerprint[:12]}); bake again to export the job as it is now, and run that one"
            )
        entries, exclude = artifacts["entries"], artifacts.get("exclude", [])
        folders = _folders(names, listed, artifacts, run_dir)
        take = {}
        for name, member in files.items():
            if jobfile.excluded(name, exclude):
                continue  # left out, as the job itself does
            if not any(_inside(name, e) for e in entries):
                raise refuse(f"member {name!r} is not among what the job brings back ({', '.join(entries)})")
            if name in folders:
                raise refuse(f"member {name!r} is a file where the job brings back a folder")
            f = listed.get(name)
            if f is None or f["size"] != member.size:  # checked before a byte is written
                raise refuse(f"member {name!r} is not in its {jobfile.RESULT_JSON} (or not with that size)")
            take[name] = member
        for name, member in zip(names, members):
            if member.isdir() and name in listed:
                raise refuse(f"member {name!r} is a folder where its {jobfile.RESULT_JSON} lists a file")
        listed = {p: f for p, f in listed.items() if not jobfile.excluded(p, exclude)}
        for path, f in listed.items():
            if path in take:
                continue
            here = run_dir / path
            if not (here.is_file() and here.stat().st_size == f["size"] and hashes.hash(here) == f["hash"]):
                raise refuse(f"{path} is listed but neither in the archive nor here with its content")
        needed = sum(m.size for m in take.values())
        free = shutil.disk_usage(run_dir).free
        if needed > free:
            raise refuse(f"its files take {needed:,} bytes and {run_dir} has {free:,} free; make room, then import again")

        tmp = run_dir / f".import-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            size = _extract(tar, take, listed, tmp, refuse)
            _put_in_place(tmp, run_dir, entries, listed, log_header)
        except OSError as e:  # a full disk, a folder that cannot be written
            raise refuse(f"could not write it into {run_dir} ({e.strerror or e}); make room or fix the folder's "
                         f"permissions, then import again") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        hashes.save()
    return Received(
        *_outcome(result.get("end"), listed, artifacts.get("required")),
        files=len(take), bytes=size, listed={p: f["hash"] for p, f in listed.items()}, step=_last_step(run_dir / METRICS),
    )


def _extract(tar: tarfile.TarFile, take: dict, listed: dict, tmp: Path, refuse: Callable) -> int:
    import blake3

    total = 0
    for name, member in take.items():
        dest = tmp / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        hasher = blake3.blake3()
        source = tar.extractfile(member)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as out:
            for chunk in iter(partial(source.read, jobfile.CHUNK), b""):
                hasher.update(chunk)
                out.write(chunk)
        if hasher.hexdigest() != listed[name]["hash"]:
            raise refuse(f"{name} is not what the job's manifest says (blake3 differs): the result was damaged; copy it again")
        os.utime(dest, (member.mtime, member.mtime))
        total += member.size
    return total


def _put_in_place(tmp: Path, run_dir: Path, entries: list[str], listed: dict, log_header: str | None) -> None:
    for entry in entries:
        src, dst = tmp / entry, run_dir / entry
        if entry == jobfile.LOG:
            if src.is_file():  # the job's output: after the run's own, never instead of it
                with open(dst, "ab") as out, open(src, "rb") as f:
                    if log_header:
                        out.write(log_line(log_header).encode())
                    shutil.copyfileobj(f, out)
            continue
        if src.is_dir():
            _merge(src, dst)
        elif src.is_file():
            os.replace(src, dst)
        elif entry not in listed and not any(_inside(p, entry) for p in listed) and dst.is_file():
            dst.unlink()  # the job no longer has it (a stop marker of an earlier attempt)


def _merge(src: Path, dst: Path) -> None:
    """Move `src` into `dst`: a folder `dst` lacks appears whole (a checkpoint is never
    seen half there); files replace theirs."""
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        return
    for child in src.iterdir():
        if child.is_dir():
            _merge(child, dst / child.name)
        else:
            os.replace(child, dst / child.name)


def _outcome(end: dict | None, listed: dict, required: str | None) -> tuple[str, str | None, int | None]:
    if not isinstance(end, dict):
        return "failed", "the job ended without saying how (no end record); run it to its end, then bring it back", None
    code = end.get("exit")
    if end.get("error"):
        return "failed", f"the job could not run: {end['error']}", code
    if code != 0:
        return "failed", f"the job failed (exit code {code})", code
    if end.get("stopped"):
        return "stopped", None, 0
    if required and not any(_inside(p, required) for p in listed):
        return "failed", f"the job ended well but brought nothing back in {required}/", 0
    return "done", None, 0


def _last_step(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if "step" in record:
            return record["step"]
    return None


def local_have(run_dir: Path, artifacts: dict, hashes: HashCache) -> list[dict]:
    """The artifact files already here (path, hash): what a result need not bring again."""
    run_dir = Path(run_dir)
    out = []
    for rel in jobfile.artifact_files(run_dir, artifacts["entries"], artifacts.get("exclude", [])):
        out.append({"path": rel, "hash": hashes.hash(run_dir / rel)})
    hashes.save()
    return out


# -- `overbrainer import` -------------------------------------------------------------------


@dataclass
class Imported:
    received: Received
    record: dict
    plan_file: str | None


def import_result(run_root: Path, archive: Path, shown: Callable[[Path], str] = str) -> Imported:
    """`overbrainer import RUN RESULT`: bring an exported job's result into its run folder,
    and leave a record the next bake takes up (train goes on from what came back)."""

    folder = RunFolder(Path(run_root).absolute())
    archive = Path(archive)
    exported = folder.root / EXPORT / "job.json"
    try:
        job = json.loads(exported.read_text())
    except (OSError, ValueError):
        raise RunStateError(
            f"{shown(folder.root)}: nothing was exported from this run; bake a plan with \"where\": \"export\" first"
        ) from None
    if not archive.is_file():
        raise OverbrainerError(f"{shown(archive)}: no such file; give the result.tar.gz the job wrote")
    with _not_being_baked(folder):
        received = receive(folder.root, archive, job["artifacts"], job["fingerprint"], HashCache(folder.hash_cache),
                           shown=shown(archive), log_header=f"imported from {archive.name}")
        record = {
            "fingerprint": job["fingerprint"], "state": received.state, "reason": received.reason,
            "exit": received.exit, "step": received.step, "files": received.files, "bytes": received.bytes,
            "result": str(archive.absolute()), "at": now(),
        }
        write_atomic(folder.root / EXPORT / IMPORTED, (json.dumps(record, indent=1) + "\n").encode())
        if received.state == "failed":
            journal.update(folder, where="export", state="failed", reason=received.reason)
        else:
            journal.update(folder, where="export", reason=f"imported from {archive.name}; bake again to go on")
        plan_file = journal.read(folder).get("plan_file")
    return Imported(received=received, record=record, plan_file=plan_file)


@contextmanager
def _not_being_baked(folder: RunFolder) -> Iterator[None]:
    """The run folder's bake lock (``graph/driver.py`` takes it to bake), held while a
    result goes in; a bake under way refuses the import."""
    folder.root.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive(folder.lock, record=False):
            yield
    except Busy:
        raise RunStateError(f"{folder.root}: being baked right now; import when that bake has ended") from None


def take_import(run_dir: Path, fingerprint: str) -> dict | None:
    """The imported result waiting for this fingerprint's bake, taken up (once)."""
    pending = Path(run_dir) / EXPORT / IMPORTED
    try:
        record = json.loads(pending.read_text())
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != fingerprint:
        return None
    os.replace(pending, pending.with_name(IMPORTED_USED))
    return record


def taken_up(record: dict, log: Path, where: str) -> int:
    """A result that came back (imported, or fetched over ssh): 0 when the train step is to
    look at what it brought (done, or stopped with its marker); RunFailed otherwise."""
    if record["state"] == "failed":
        raise RunFailed(f"{record['reason']} ({where})", log_tail=_log_tail(log))
    return 0


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
