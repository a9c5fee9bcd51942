"""The trainer process's host memory allocator on the CPU: tcmalloc where it is installed.

A CPU training step allocates and frees the same large tensors every step, from two
threads. glibc's malloc, even with its freed memory kept (`device.keep_freed_memory`),
spends ~5 % of a compiled bf16 LoRA step of SmolLM2-135M on 2 cores searching its free
lists while the other core waits (`perf`: `_int_malloc`, `unlink_chunk`,
`malloc_consolidate`). tcmalloc, which PyTorch's CPU tuning guide and its own launcher
(`torch.backends.xeon.run_cpu`) preload, took +10.6 and +11.3 % useful tokens/s over
steps 11-40 in paired runs there, 17 % less peak memory, the same bits (bench/README
section 4). It has to be in place before the process starts, so the trainer's process
starts itself again with it preloaded (`os.execv`: the same process id, which the run's
supervisor and torchrun watch), before torch is imported.

Linux, a CPU run (the plan's device "cpu", or "auto" on a machine without NVIDIA's device
files), and the library installed (Debian and Ubuntu: `libtcmalloc-minimal4`). Nothing is
done where the user chose: an `LD_PRELOAD`, glibc's `MALLOC_*` variables or malloc tunables,
or ``OVERBRAINER_MALLOC=glibc``, which keeps glibc. This module imports no torch.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ENV = "OVERBRAINER_MALLOC"  # "glibc": leave the allocator alone; "tcmalloc": set by the restart
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # gperftools' (the minimal one: no profiler)
# tcmalloc writes a line to stderr for every allocation past 1 GiB unless told otherwise
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**62)}


def chosen_by_the_user(environ=os.environ) -> bool:
    """Whether the allocator is the user's to say: a preload, glibc's knobs, or ours set."""
    return bool(environ.get("LD_PRELOAD") or environ.get(ENV)
                or any(k.startswith("MALLOC_") for k in environ) or "malloc" in environ.get("GLIBC_TUNABLES", ""))


def computes_on_the_cpu(device: str) -> bool:
    """The plan's train.device, read before torch is: "auto" is the CPU where no NVIDIA GPU
    shows (its device files) and no Apple one can (not macOS)."""
    if device == "cpu":
        return True
    return device == "auto" and platform.system() == "Linux" and not Path("/dev/nvidiactl").exists()


def tcmalloc() -> str | None:
    """The path of an installed tcmalloc: this environment's lib/ (conda's gperftools), then
    the system's library directories."""
    folders = [Path(sys.prefix) / "lib", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"),
               Path("/usr/lib64"), Path("/usr/lib"), Path("/usr/local/lib")]
    for folder in folders:
        for name in LIBRARIES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def restart_with_tcmalloc(device: str) -> None:
    """Start this process again with tcmalloc preloaded, where it applies (above); returns
    only where it does not."""
    if platform.system() != "Linux" or chosen_by_the_user() or not computes_on_the_cpu(device):
        return
    library = tcmalloc()
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    environ = {**os.environ, **QUIET, "LD_PRELOAD": library, ENV: "tcmalloc"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def in_use() -> str | None:
    """The allocator this process was restarted with ("tcmalloc"), where it was."""
    if os.environ.get(ENV) == "tcmalloc" and "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return "tcmalloc"
    return None


def device_argument(argv: list[str]) -> str:
    """The trainer's --device (default "auto"), read from its command line without argparse."""
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "auto"
