"""What the benchmarks share: running a command as a measured child process, the
machine's description, and printing a table.

A measured child is waited for with ``waitid(WNOWAIT)`` first, so that its
``/proc/<pid>/io`` can still be read while it is a zombie (the counters then include
the children it reaped itself), then reaped with ``wait4`` for its resource usage.

- ``rchar``: bytes the process got from read()-like syscalls (page-cache hits or not);
  bytes it read through mmap are *not* in it (see `strace_bytes`).
- ``read_bytes``: bytes fetched from the storage layer: 0 means every read was a
  page-cache hit.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VENV = BENCH / ".venv"
PY = str(VENV / "bin" / "python") if (VENV / "bin" / "python").exists() else sys.executable
MB = 1_000_000
GB = 1_000_000_000


def best_ms(f, rounds: int = 3, calls: int = 20, warmup: int = 3) -> float:
    """Milliseconds a call of `f`: the best of `rounds` rounds of `calls` calls, after `warmup`
    calls (for kernels timed in-process; whole commands go through `measure`)."""
    for _ in range(warmup):
        f()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def work_dir(name: str) -> Path:
    """A scratch folder for one benchmark, outside the repository (big files)."""
    root = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "overbrainer-bench")
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def venv_bin(name: str) -> str:
    path = VENV / "bin" / name
    return str(path) if path.exists() else name


@dataclass
class Measured:
    argv: list[str]
    code: int
    wall: float
    rchar: int
    read_bytes: int
    maxrss_kb: int
    user: float
    system: float
    stdout: str = ""
    stderr: str = ""
    extra: dict = field(default_factory=dict)

    def check(self, *codes: int) -> Measured:
        if self.code not in (codes or (0,)):
            raise SystemExit(
                f"{shlex.join(self.argv)} exited {self.code}\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}"
            )
        return self


def _io(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def _hwm_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM), in kB; 0 once it has no memory."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(argv: list[str], cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: float = 3600) -> Measured:
    """Run `argv` to its end: wall time, bytes read, peak RSS, CPU time, output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = start + timeout
        peak_kb = 0
        while True:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if info is not None:
                break
            peak_kb = max(peak_kb, _hwm_kb(proc.pid))
            if time.perf_counter() > deadline:
                proc.kill()
            time.sleep(0.002)
        wall = time.perf_counter() - start
        io = _io(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            argv=list(argv),
            code=proc.returncode,
            wall=wall,
            rchar=io.get("rchar", -1),
            read_bytes=io.get("read_bytes", -1),
            # wait4's ru_maxrss would count the RSS of this process at fork (Linux keeps
            # it across exec): the child's own high-water mark is read while it runs
            maxrss_kb=peak_kb or usage.ru_maxrss,
            user=usage.ru_utime,
            system=usage.ru_stime,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


_SYSCALL = re.compile(
    r"^(?:\[pid\s+)?\d*\]?\s*(?P<call>read|pread64|readv|preadv|mmap)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\w+)"
)
_FD_PATH = re.compile(r"^\d+<(?P<path>[^>]*)>")


def strace_bytes(argv: list[str], under: list[Path], cwd=None, env=None, timeout: float = 3600) -> tuple[int, dict[str, int]]:
    """Run `argv` under strace: bytes of files below any of `under` that it read with
    read()/pread() or mapped with mmap() (a mapped file is read by whoever maps it; the
    counting cannot tell how much of a mapping was touched, so it counts all of it).
    Returns (exit code, {path: bytes})."""
    roots = [str(Path(u).resolve()) for u in under]
    with tempfile.NamedTemporaryFile(suffix=".strace", delete=False) as trace:
        pass
    try:
        cmd = ["strace", "-f", "-qq", "-y", "-s", "0", "-e", "trace=read,pread64,readv,preadv,mmap",
               "-o", trace.name, *argv]
        code = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout).returncode
        per_file: dict[str, int] = {}
        with open(trace.name, errors="replace") as f:
            for line in f:
                line = re.sub(r"^\d+\s+", "", line)
                m = _SYSCALL.match(line)
                if not m or m["ret"].startswith("-"):
                    continue
                args = m["args"]
                if m["call"] == "mmap":
                    parts = [p.strip() for p in args.split(",")]
                    if len(parts) < 5:
                        continue
                    fdm = _FD_PATH.match(parts[4])
                    if not fdm:
                        continue
                    path, nbytes = fdm["path"], int(parts[1])
                else:
                    fdm = _FD_PATH.match(args)
                    if not fdm:
                        continue
                    path, nbytes = fdm["path"], int(m["ret"], 0)
                if any(path == r or path.startswith(r + "/") for r in roots):
                    per_file[path] = per_file.get(path, 0) + nbytes
        return code, per_file
    finally:
        os.unlink(trace.name)


def machine() -> dict:
    """The machine and its load, for the README's table."""
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    dirty = bool(git("status", "--porcelain", "--", "overbrainer"))
    return {
        "commit": git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in overbrainer/" if dirty else ""),
        "cores": os.cpu_count(),
        "memory": mem,
        "cpu": cpu,
        "python": platform.python_version(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }


def print_machine() -> dict:
    m = machine()
    print(f"# machine: {m['cores']} cores ({m['cpu']}), {m['memory']}, Python {m['python']}")
    print(f"# load: {m['uptime']}")
    print(f"# overbrainer at {m['commit']}")
    return m


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of `rows` (dicts) with the given columns."""
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _cell(value) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def human_bytes(n: int | float) -> str:
    if n < 0:
        return "?"
    for unit, size in (("GB", GB), ("MB", MB), ("kB", 1000)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def save_json(name: str, data) -> Path:
    """Results as JSON beside the printed table, in the work folder."""
    path = work_dir("results") / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
