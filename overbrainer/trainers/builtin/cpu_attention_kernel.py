"""The C++ attention backward for bf16 training on the CPU (`cpu_attention_backward.cpp`):
built with torch's C++ extension loader on first use, once a machine, and kept under the
cache's ``kernels/`` (``$OVERBRAINER_KERNELS``); used by `cpu_attention` where it runs.

It is built where it can run: Linux on x86-64, a CPU with AMX (oneDNN's bf16 brgemm with
packed operands: ATen's `could_pack` asks for AMX, not AVX-512 BF16), a C++ compiler (``$CXX``, else ``c++``) and ninja (the PyPI package's, or the
system's). A build that fails is one line on stderr, and the Python backward is used.
``OVERBRAINER_CPU_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import torch

ENV = "OVERBRAINER_CPU_KERNEL"  # "0": never build or use it
KERNELS_ENV = "OVERBRAINER_KERNELS"  # where builds are kept (default: the cache's kernels/)
# the CPU flag of the instructions ATen's packed bf16 brgemm needs (`could_pack`: oneDNN's
# avx512_core_amx; AVX-512 BF16 alone is not enough): a CPU without it gets no build (the
# kernel asks oneDNN too)
BF16_BRGEMM_FLAGS = {"amx_bf16"}
# -march=native: this machine's vector instructions (a build is kept per kind of CPU);
# -fno-trapping-math: lets the compiler vectorize the probabilities' loop (selects, floor);
# -fopenmp: at::parallel_for is inline and runs on one thread without it (the OpenMP runtime
# is then the one torch loaded, by its soname)
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]

_OP: object = False  # not tried yet


def takes(head_size: int) -> bool:
    """The head sizes it computes: multiples of 16 up to 512 (64, 80, 96, 128, 256: the
    families' heads)."""
    return head_size % 16 == 0 and head_size <= 512


def op():
    """`torch.ops.overbrainer_cpu.causal_attention_backward` where it is built (here and now,
    the first time) and this CPU runs it; None elsewhere."""
    global _OP
    if _OP is False:
        _OP = _build()
    return _OP


def _build():
    import hashlib
    import os
    import platform
    import shutil
    import sys
    from pathlib import Path

    from ...folder import cache_root
    from ...portable.common import cpu_flags

    if os.environ.get(ENV) == "0" or sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not BF16_BRGEMM_FLAGS & (cpu_flags() or set()):
        return None
    if not shutil.which(os.environ.get("CXX") or "c++"):
        return None
    try:
        import ninja  # the PyPI package: its binary, where the system has none

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        if not shutil.which("ninja"):
            return None
    source = Path(__file__).with_name("cpu_attention_backward.cpp")
    # one build for each kind of CPU (-march=native), in a cache several machines may share
    key = "\n".join([source.read_text(), *FLAGS, torch.__version__, sys.version, *sorted(cpu_flags() or ())])
    name = "overbrainer_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = Path(os.environ.get(KERNELS_ENV) or cache_root() / "kernels") / name
    try:
        from filelock import FileLock
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        # one build at a time (the processes of a run): a lock the system drops with its holder,
        # so a build killed half-way leaves no lock behind, unlike torch's own, which is removed
        # here while this one is held
        with FileLock(folder / ".build.lock"):
            (folder / "lock").unlink(missing_ok=True)
            if not any(folder.glob("*.so")):
                print("building the CPU attention kernel (once on this machine: a few seconds to a minute)",
                      file=sys.stderr, flush=True)
            load(name=name, sources=[str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=str(folder), is_python_module=False, verbose=False)
        if not torch.ops.overbrainer_cpu.can_run():
            return None
    except Exception as e:  # no compiler that works, a torch without its headers, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"the CPU attention kernel was not built ({first}): the slower Python backward is used",
              file=sys.stderr, flush=True)
        return None
    return torch.ops.overbrainer_cpu.causal_attention_backward
