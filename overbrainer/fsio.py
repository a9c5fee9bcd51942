"""Writing files and folders so that a reader, or a process killed half-way, never takes a
half-written one for whole. One copy of each way, imported wherever a file is written:

- `write_atomic`, `write_json`: a file, through a temp file and ``os.replace``;
- `replace_folder`: a folder put in the place of another, the destination at every moment
  absent or complete;
- `fsync_dir`, `fsync_tree`: make what was written durable before it is named done;
- `exclusive`: one process at a time on a folder (an OS lock that a dead process cannot
  hold), taken without waiting;
- `build_once`: a folder in a shared cache, built by one process at a time under a file
  lock, in a temp folder renamed into place when whole (the base models, Axolotl's
  environment).

The file-level helpers are those of ``portable/common.py`` (what runs without overbrainer
installed needs them too): named here so that the package has one place to take them from.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .portable import faults
from .portable.common import fsync_dir, fsync_tree, read_json, write_atomic, write_json

__all__ = [
    "write_atomic", "write_json", "read_json", "fsync_dir", "fsync_tree", "replace_folder", "exclusive", "Busy",
    "build_once",
]


def replace_folder(new: Path, dest: Path, fault: str | None = None) -> None:
    """Put folder `new` at `dest`: its files are fsynced, the old folder is renamed away
    first, then removed, so that `dest` is at every moment absent or complete."""
    for p in new.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if fault:
        faults.point(fault)
    old = dest.with_name(f".old-{dest.name}")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)


class Busy(Exception):
    """Another process holds the lock: `holder` is its pid as it wrote it ("" if unknown)."""

    def __init__(self, holder: str):
        self.holder = holder
        super().__init__(f"held by process {holder}" if holder else "held by another process")


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold the OS lock on the file `lock` (made if need be) for the ``with`` block, or
    raise `Busy` at once. The lock goes with the process, however it ends; the holder's
    pid is written into the file, for the message of the next one."""
    import fcntl

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            holder = Path(lock).read_text().strip()
        except OSError:
            holder = ""
        raise Busy(holder) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)


def build_once(target: Path, done: str, build: Callable[[Path], None], waiting: Callable[[], None] = lambda: None) -> Path:
    """The folder `target`, built first unless it holds the file `done` (written last by
    `build`, the mark of a whole one).

    One process builds it at a time, under ``<target>.lock``; the others wait (`waiting`
    is called once, to say so) and find it done. `build(folder)` makes `folder` (a path
    that does not exist yet, beside `target`), which is renamed to `target` when it
    returns; what a killed build left (``.<name>.tmp-*``, or a `target` without `done`)
    is removed first."""
    if (target / done).is_file():
        return target
    import tempfile

    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waiting()
        lock.acquire()
    try:
        if (target / done).is_file():  # the other process finished it
            return target
        # under the lock nobody else builds it: what is here was left by a killed build
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp / target.name)
            os.replace(tmp / target.name, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target
    finally:
        lock.release()
