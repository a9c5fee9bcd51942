"""Hashing throughput on content not seen before: overbrainer's hash_file vs md5 and sha256.

    bench/.venv/bin/python bench/hashing.py [--gb 1.5] [--reps 3]

One file of random bytes (page-cached: it is read once before timing, and fincore says how
much of it is resident), hashed by each contender in turn, `--reps` rounds, best and median
reported as GB/s (1 GB = 10^9 bytes):

- ``overbrainer.hashing.hash_file``: blake3, memory-mapped, all cores (what a rerun pays
  for a file whose mtime changed, and a step for each output it stamps);
- blake3 on one thread, fed by read() in 16 MiB chunks (what blake3 alone gives per core);
- ``hashlib.md5`` and ``hashlib.sha256`` through ``hashlib.file_digest`` (md5 is what doit
  and DVC compute).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GB, print_machine, save_json, table, work_dir  # noqa: E402


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = 64 * 1024 * 1024
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n


def blake3_one_thread(path: Path) -> str:
    import blake3

    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def file_digest(name: str):
    def run(path: Path) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, name).hexdigest()

    return run


def resident(path: Path) -> float:
    out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES,SIZE", str(path)], capture_output=True, text=True)
    try:
        res, size = map(int, out.stdout.split())
        return res / size
    except ValueError:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from overbrainer.hashing import hash_file

    machine = print_machine()
    path = work_dir("hashing") / "random.bin"
    size = int(args.gb * GB)
    make_file(path, size)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 * 1024 * 1024):
            pass
    print(f"# file: {size / GB:.2f} GB of random bytes, {resident(path):.0%} in the page cache", flush=True)

    contenders = {
        "overbrainer hash_file (blake3, mmap, all cores)": hash_file,
        "blake3, 1 thread, read()": blake3_one_thread,
        "hashlib md5": file_digest("md5"),
        "hashlib sha256": file_digest("sha256"),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    digests: dict[str, str] = {}
    for _ in range(args.reps):
        for name, fn in contenders.items():
            t, c = time.perf_counter(), time.process_time()
            digests[name] = fn(path)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)  # every thread of this process
    assert digests["blake3, 1 thread, read()"] == digests["overbrainer hash_file (blake3, mmap, all cores)"]

    ours = min(times["overbrainer hash_file (blake3, mmap, all cores)"])
    rows = []
    for name, ts in times.items():
        rows.append({
            "hasher": name,
            "best GB/s": size / GB / min(ts),
            "median GB/s": size / GB / statistics.median(ts),
            "best s": min(ts),
            "GB per CPU-s": size / GB / statistics.median(cpu[name]),
            "overbrainer speed-up": min(ts) / ours,
        })
    print()
    print(table(rows, ["hasher", "best GB/s", "median GB/s", "best s", "GB per CPU-s", "overbrainer speed-up"]))
    best = size / GB / ours
    per_cpu = size / GB / statistics.median(cpu["overbrainer hash_file (blake3, mmap, all cores)"])
    print(f"\ngoal: >= 3 GB/s on {machine['cores']} cores: {best:.2f} GB/s, {'met' if best >= 3 else 'MISSED'} "
          f"(with both cores to itself, {per_cpu:.2f} GB per CPU-second x {machine['cores']} cores "
          f"= {per_cpu * machine['cores']:.1f} GB/s at most)")
    print(f"# results: {save_json('hashing', {'machine': machine, 'size': size, 'times': times, 'cpu': cpu})}")


if __name__ == "__main__":
    main()
