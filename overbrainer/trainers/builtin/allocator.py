"""The trainer process's host memory allocator on the CPU: tcmalloc where it is installed.

A CPU training step allocates and frees the same large tensors every step, from two
threads. glibc's malloc, even with its freed memory kept (`device.keep_freed_memory`),
spends ~5 % of a compiled bf16 LoRA step of SmolLM2-135M on 2 cores searching its free
lists while the other core waits (`perf`: `_int_malloc`, `unlink_chunk`,
`malloc_consolidate`). tcmalloc, which PyTorch's CPU tuning guide and its own launcher
(`torch.backends.xeon.run_cpu`) preload, took +10.6 and +11.3 % useful tokens/s over
steps 11-40 in paired runs there, 17 % less peak memory, the same bits (bench/README
section 4). It has to be in place before the process starts, so the trainer's process
starts itself again with it preloaded (`os.execve`: the same process id, which the run's
supervisor and torchrun watch), before torch is imported.

Linux, a CPU run (the plan's device "cpu", or "auto" where no GPU's device files show or
CUDA_VISIBLE_DEVICES hides them all), and the library installed (Debian and Ubuntu:
`libtcmalloc-minimal4`; where it is not, log.txt says how to get it). Nothing is
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


def glibc_tuned(environ=os.environ) -> bool:
    """Whether the user set glibc's malloc knobs (its MALLOC_* variables or malloc tunables)."""
    return any(k.startswith("MALLOC_") for k in environ) or "malloc" in environ.get("GLIBC_TUNABLES", "")


def chosen_by_the_user(environ=os.environ) -> bool:
    """Whether the allocator is the user's to say: a preload, glibc's knobs, or ours set."""
    return bool(environ.get("LD_PRELOAD") or environ.get(ENV) or glibc_tuned(environ))


def ours_to_choose() -> bool:
    """Whether the trainer picks the allocator: on Linux, where the user did not."""
    return platform.system() == "Linux" and not chosen_by_the_user()


# a GPU torch may compute on: NVIDIA's driver, WSL2's GPU, ROCm's (torch.cuda there too)
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def computes_on_the_cpu(device: str, environ=os.environ) -> bool:
    """The plan's train.device, read before torch is: "auto" is the CPU on Linux where no GPU
    shows (its device files), or where CUDA_VISIBLE_DEVICES hides them all. Where in doubt,
    a GPU (the allocator is then left alone)."""
    if device == "cpu":
        return True
    if device != "auto" or platform.system() != "Linux":
        return False
    return environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not any(map(os.path.exists, GPU_DEVICE_FILES))


def tcmalloc() -> str | None:
    """The path of an installed tcmalloc for this machine's architecture: this environment's
    lib/ (conda's gperftools), then the system's library directories."""
    folders = [Path(sys.prefix) / "lib", Path(f"/usr/lib/{platform.machine()}-linux-gnu"), Path("/usr/lib64"),
               Path("/usr/lib"), Path("/usr/local/lib")]
    for folder in folders:
        for name in LIBRARIES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def to_preload(device: str) -> str | None:
    """The tcmalloc the trainer's process restarts with for this --device, here and now;
    None where it does not (not Linux, not the CPU, the user's choice, none installed)."""
    if not ours_to_choose() or not computes_on_the_cpu(device):
        return None
    return tcmalloc()


def preloaded(library: str) -> dict[str, str]:
    """The environment a process starts with to run on this tcmalloc (the restart's; the
    benchmark gives TRL's process the same)."""
    return {**QUIET, "LD_PRELOAD": library, ENV: "tcmalloc"}


def restart_with_tcmalloc(device: str) -> None:
    """Start this process again with tcmalloc preloaded where `to_preload` says so; returns
    where it does not, or where the restart cannot be made (the process goes on as it is)."""
    library = to_preload(device)
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    environ = {**os.environ, **preloaded(library)}
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:
        return


def described(installed: str | None) -> str:
    """What log.txt says of a CPU run's host memory: tcmalloc where this process runs on it;
    where the restart would have taken one had it been `installed` (`tcmalloc()`), where to
    get it, as PyTorch's CPU launcher warns when it finds none."""
    if in_use():
        return ", host memory from tcmalloc"
    if installed is None and ours_to_choose():
        return (", host memory from glibc's malloc (training on the CPU is ~10 % faster on tcmalloc: "
                "install it, as Debian's and Ubuntu's libtcmalloc-minimal4 or conda's gperftools)")
    return ""


def in_use() -> str | None:
    """"tcmalloc" where this process runs on it (mapped: a preload the loader could not
    take leaves glibc's)."""
    try:
        with open("/proc/self/maps") as maps:
            return "tcmalloc" if "libtcmalloc" in maps.read() else None
    except OSError:
        return None


def device_argument(argv: list[str]) -> str:
    """The trainer's --device (default "auto"), read from its command line without argparse:
    the last one given, as argparse takes (which is told to take no abbreviation)."""
    device = "auto"
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device
