"""The C++ kernels for bf16 training on the CPU, one library (`torch.ops.overbrainer_cpu`):
the attention's forward and backward (`cpu_attention_forward.cpp`,
`cpu_attention_backward.cpp`, used by `cpu_attention`) and the output layer's loss
(`cpu_token_loss.cpp`, used by `cpu_token_loss`), with what they share (`cpu_kernels.h`).
Built with torch's C++ extension loader on first use, once a machine, and kept under the
cache's ``kernels/`` (``$OVERBRAINER_KERNELS``).

They are built where they can run: Linux on x86-64, a CPU with AMX (oneDNN's bf16 brgemm
with packed operands: ATen's `could_pack` asks for AMX, not AVX-512 BF16), a C++ compiler
(``$CXX``, else ``c++``) and ninja (the PyPI package's, or the system's). A build that fails
is one line on stderr, and the plain paths are used (sdpa's forward, the Python attention
backward, the compiled or eager loss). ``OVERBRAINER_CPU_KERNEL=0`` turns them off.
"""

from __future__ import annotations

import torch

ENV = "OVERBRAINER_CPU_KERNEL"  # "0": never build or use them
KERNELS_ENV = "OVERBRAINER_KERNELS"  # where builds are kept (default: the cache's kernels/)
# the CPU flag of the instructions ATen's packed bf16 brgemm needs (`could_pack`: oneDNN's
# avx512_core_amx; AVX-512 BF16 alone is not enough): a CPU without it gets no build (the
# kernel asks oneDNN too)
BF16_BRGEMM_FLAGS = {"amx_bf16"}
# -march=native: this machine's vector instructions (a build is kept per kind of CPU);
# -fno-trapping-math: lets the compiler vectorize the probabilities' loop (selects, floor);
# -fopenmp: at::parallel_for is inline and runs on one thread without it (the OpenMP runtime
# is then the one torch loaded, by its soname); -DCPU_CAPABILITY_AVX512: ATen's vector helpers
# (the transposes' transpose_mxn) in their AVX-512 form, as inductor builds its kernels (every
# CPU that gets a build has AVX-512); -mprefer-vector-width=512: the loops the compiler
# vectorizes (the backward's probabilities) in 16 lanes rather than its default 8 on these CPUs
# (the attention's backward 10-25 % faster, bench/attention.py; the same arithmetic a lane)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp",
         "-DCPU_CAPABILITY_AVX512"]

SOURCES = ("cpu_attention_forward.cpp", "cpu_attention_backward.cpp", "cpu_token_loss.cpp")
HEADERS = ("cpu_kernels.h",)

_OPS: object = False  # not tried yet


def ops():
    """`torch.ops.overbrainer_cpu` where the kernels are built (here and now, the first time)
    and this CPU runs them; None elsewhere."""
    global _OPS
    if _OPS is False:
        _OPS = _build()
    return _OPS


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
    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    # one build for each kind of CPU (-march=native), in a cache several machines may share
    texts = [(here / name).read_text() for name in (*SOURCES, *HEADERS)]
    key = "\n".join([*texts, *FLAGS, torch.__version__, sys.version, *sorted(cpu_flags() or ())])
    name = "overbrainer_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:12]
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
                print("building the CPU kernels (once on this machine: a few seconds to a minute)",
                      file=sys.stderr, flush=True)
            load(name=name, sources=[str(x) for x in sources], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=str(folder), is_python_module=False, verbose=False)
        if not torch.ops.overbrainer_cpu.can_run():
            return None
    except Exception as e:  # no compiler that works, a torch without its headers, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"the CPU kernels were not built ({first}): the slower plain paths are used",
              file=sys.stderr, flush=True)
        return None
    return torch.ops.overbrainer_cpu
