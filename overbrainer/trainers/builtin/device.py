"""Where the built-in trainer computes: the device, its number formats, and its memory.

``train.device`` (config.yaml ``device``) is resolved here, in the trainer's own process:
"auto" is CUDA when torch sees a GPU, then Apple mps, else the CPU; under torchrun each
process takes GPU ``LOCAL_RANK``. What cannot run says so in one line (`Unavailable`):
the config step asks the same questions first (`problems`), so a plan that names a GPU
the machine lacks is refused before anything trains.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from ...portable.common import cpu_flags, cpu_has_amx

# cuBLAS's deterministic mode needs a fixed workspace, set before its first call (the
# trainer's environment carries it; `setup` sets it too, before touching CUDA)
CUBLAS_WORKSPACE = ":4096:8"


class Unavailable(Exception):
    """The plan asks for hardware or a library this machine lacks: one line, exit 2."""


def problems(device: str, processes: int = 1, adapter: str = "lora", liger: bool = False) -> list[str]:
    """What this machine cannot do of what the plan asks, one line each (empty: all can)."""
    out = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.startswith("cuda") and not gpus:
        out.append(f'train.device: "{device}", but torch sees no CUDA GPU here '
                   f"(torch {torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); "
                   'set train.device to "auto" or "cpu", or install a CUDA build of torch')
    elif device.startswith("cuda:") and int(device.split(":")[1]) >= gpus:
        out.append(f'train.device: "{device}", but this machine has {gpus} GPU(s) (cuda:0 to cuda:{gpus - 1}); '
                   "name one of those")
    elif device == "mps" and not torch.backends.mps.is_available():
        out.append('train.device: "mps", but torch sees no Apple GPU here; set train.device to "auto" or "cpu"')
    on_cuda = gpus > 0 and (device in ("auto", "cuda") or device.startswith("cuda:"))
    if on_cuda and processes > gpus:
        out.append(f"train.processes: {processes}, but this machine has {gpus} GPU(s) and each process takes "
                   f'one; set train.processes to at most {gpus}, or train.device "cpu" for CPU processes')
    if adapter == "qlora":
        why = bitsandbytes_problem("cuda" if on_cuda else "cpu")
        if why:
            out.append(f'train.adapter: "qlora" cannot run here: {why}; use adapter "lora" '
                       "(or install bitsandbytes>=0.46: pip install 'overbrainer[gpu]')")
    if liger:
        if not on_cuda:
            out.append("train.liger: Liger Kernel runs on a CUDA GPU only (Triton kernels), and this run trains "
                       "on the CPU; set train.liger to false")
        else:
            try:
                import liger_kernel.transformers  # noqa: F401
            except ImportError as e:
                out.append(f"train.liger: liger_kernel cannot be imported ({e}); pip install liger-kernel, "
                           "or set train.liger to false")
    return out


def bitsandbytes_problem(device_type: str) -> str | None:
    """Why bitsandbytes' NF4 cannot run on `device_type`, or None: it quantizes and
    multiplies a small matrix there, in a child process (a broken native library can
    crash its importer)."""
    import subprocess
    import sys

    probe = (
        "import torch, bitsandbytes as bnb, bitsandbytes.functional as F\n"
        f"d = {device_type!r}\n"
        "w = torch.randn(64, 64, device=d, dtype=torch.bfloat16)\n"
        "q, s = F.quantize_4bit(w, quant_type='nf4')\n"
        "bnb.matmul_4bit(torch.randn(2, 64, device=d, dtype=torch.bfloat16), q.t(), quant_state=s)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "bitsandbytes' probe did not finish in 2 minutes"
    if out.returncode == 0:
        return None
    lines = [x for x in out.stderr.strip().splitlines() if x.strip()]
    last = lines[-1] if lines else f"exit code {out.returncode}"
    if "No module named 'bitsandbytes'" in last:
        return "bitsandbytes is not installed"
    return f"bitsandbytes fails on {device_type} ({last[:200]})"


def pick(setting: str, local_rank: int = 0) -> torch.device:
    """The torch device for train.device `setting` (one process of several: its own GPU)."""
    if setting == "auto":
        if torch.cuda.is_available():
            setting = "cuda"
        elif torch.backends.mps.is_available():
            setting = "mps"
        else:
            setting = "cpu"
    if setting == "cuda":
        setting = f"cuda:{local_rank}"
    found = problems(setting)
    if found:
        raise Unavailable(found[0])
    device = torch.device(setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def use_bf16(setting, device: torch.device) -> bool:
    """Whether to compute in bfloat16: the plan's true or false, or "auto": on a CUDA GPU
    that computes it natively, and on a CPU with AMX (1.6-2.2x float32's speed there; TRL's
    SFTConfig computes in bf16 by default too). Elsewhere "auto" stays float32: set true
    to use a CPU's AVX512-BF16 alone (not measured; its results differ from float32's, as
    a GPU's do; on a CPU without it the trainer says it will be slow, `cpu_has_bf16`)."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cpu":
        return cpu_has_amx()
    return device.type == "cuda" and cuda_has_bf16()


def cuda_has_bf16() -> bool:
    """Whether the current GPU computes bf16 natively (Ampere, compute capability 8.0, and
    newer). torch's `is_bf16_supported()` says yes to a Turing or Volta GPU too, where bf16
    is emulated (slower than float32) and Triton's bf16 kernels do not compile."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch before 2.3 had no emulation to leave out
        return torch.cuda.is_bf16_supported()


def sum_dtype(device: torch.device) -> torch.dtype:
    """A step's running loss sums in float64, but on Apple's mps, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes bf16 in its own instructions: AVX512-BF16 or AMX on x86,
    the BF16 extension on Arm (Linux's /proc/cpuinfo flags). Without them PyTorch's bf16
    matmuls are emulated, many times slower than float32's (25x, AVX2-only AMD EPYC, bench
    section 4). None where it cannot tell (no /proc/cpuinfo: macOS, Windows)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# the fewest steps a run has for "auto" to compile: the compiler takes about 30 s before
# the first step (2 cores, a cold cache; ~6 s from inductor's cache) and saves about 0.4 s
# of a 1.7 s step (SmolLM2-135M, LoRA in bf16, 4 x 256 tokens: bench/README section 4)
COMPILE_FROM_STEPS = 100


def use_compile(device: torch.device, cfg: dict, bf16: bool, processes: int = 1, deterministic: bool = False) -> bool:
    """train.compile "auto": torch.compile the decoder layers where it was measured to pay
    off: a LoRA in bf16 on the CPU (AMX), in one process, for at least `COMPILE_FROM_STEPS`
    steps, where a C++ compiler is at hand (inductor builds its CPU kernels with one). There
    eager bf16 spends a third of a step casting and in elementwise passes that the compiled
    layers fuse: 1.31-1.40x the useful tokens/s. Off in float32 (1.10x for the same wait), on a
    GPU, for a full fine-tune or QLoRA, several processes and deterministic kernels, where
    nobody has measured it; `true` turns it on there."""
    if device.type != "cpu" or not bf16 or cfg.get("adapter") != "lora" or processes > 1 or deterministic:
        return False
    if int(cfg.get("max_steps") or 0) < COMPILE_FROM_STEPS:
        return False
    return cpp_compiler() is not None


# train.pad_to_multiple_of "auto" where bf16 matmuls run on a CPU
CPU_BF16_PAD_MULTIPLE = 8


def pad_multiple(cfg: dict, device: torch.device, bf16: bool) -> int:
    """What a micro-batch's length is rounded up to (train.pad_to_multiple_of). "auto" (no key
    in config.yaml): 8 where bf16 matmuls run on the CPU, 1 elsewhere. There oneDNN prepares
    a matmul for each new number of rows, about 2-4 ms a shape (a float32 matmul has no such
    cost); with every length its own shape, a step of SmolLM2-135M spent ~37 ms of ~1.1 s
    preparing the ~17 shapes it had not seen (ONEDNN_VERBOSE, bench/README section 4). In
    multiples of 8 the lengths come back and the shapes stay prepared, for ~1.4 % more rows
    (3.5 pad tokens a conversation on ~240)."""
    value = cfg.get("pad_to_multiple_of", "auto")
    if value != "auto":
        return int(value)
    return CPU_BF16_PAD_MULTIPLE if device.type == "cpu" and bf16 else 1


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call (its `CXX`, else g++), if it is installed."""
    import shutil

    return shutil.which(os.environ.get("CXX") or "g++")


# config.yaml's keys for Liger Kernel (Axolotl's names; the built-in trainer reads them too)
LIGER_KEYS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")


def use_liger(device: torch.device, cfg: dict, processes: int = 1, deterministic: bool = False) -> bool:
    """train.liger "auto": Liger's kernels where they were measured to help: LoRA in one
    process on a CUDA GPU, where liger_kernel imports (on one H200, LoRA of a 1.7B Llama:
    +20% useful tokens/s and -26% peak memory at the same loss, bench/README section 7).
    Off on a CPU or mps (Triton kernels), and where nobody has measured them yet: a full
    fine-tune, QLoRA's 4-bit base, several processes or shards, compiled layers, and
    deterministic kernels (torch's deterministic mode does not reach Triton's). `true`
    in the plan turns them on in those cases too."""
    if device.type != "cuda" or cfg.get("adapter") != "lora" or processes > 1 or cfg.get("shard"):
        return False
    if cfg.get("torch_compile") is True or deterministic:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):  # Liger's bf16 kernels need sm_80
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # not installed, or a Triton that does not load: the plain kernels
        return False
    return True


def configure(device: torch.device, deterministic: bool, tf32: bool) -> None:
    """Process-wide numerics: deterministic kernels when asked (their cost: cuBLAS's fixed
    workspace and no split-K reductions, typically 5-20% on a GPU), TF32 for fp32 matmuls;
    on the CPU, host memory that is kept once freed (`keep_freed_memory`)."""
    if device.type == "cpu":
        keep_freed_memory()
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if device.type == "cuda" and tf32:
        # the one spelling that works on torch 2.4 to 2.13 (the old and new flags must not mix)
        torch.set_float32_matmul_precision("high")


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Training on the CPU allocates the same large tensors every step (activations, and
    the logits at loss positions: 150 MB for 750 of them over a 49,152-word vocabulary).
    glibc gives every block over its mmap threshold (at most 32 MB) to the kernel when it is
    freed, so each step faults all of that memory in again, page by page, zeroed. Served
    from the heap and never trimmed, a step reuses the pages of the step before: what
    PyTorch's CPU tuning guide gets from jemalloc or tcmalloc, with glibc's own knobs, for
    where tcmalloc is not installed (where it is, the process runs on it: `allocator`).
    The cost: the process keeps its peak memory (which the next step needs anyway).

    Linux with glibc only, and not where the user chose (glibc's MALLOC_* variables or
    malloc tunables, or another allocator in LD_PRELOAD). True when it was set."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    from .allocator import glibc_tuned

    if glibc_tuned() or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # large blocks from the heap rather than mmap (the main arena's; a side thread's arena
    # may still map one past its 64 MB heaps), and the freed top kept up to 2 GiB (an int)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def compute(bf16: bool, device: torch.device):
    """Where the forward pass runs: autocast to bf16 on the training device (matmuls in
    bf16, sums and softmax in float32), or plain float32."""
    if not bf16:
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def to_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch onto the device: on CUDA from pinned memory, without waiting (the copy
    overlaps what the GPU still has queued; nothing reads the host tensors after)."""
    if device.type != "cuda":
        return inputs if device.type == "cpu" else {k: v.to(device) for k, v in inputs.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in inputs.items()}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Bytes: the most this process has held (allocated on a GPU, RSS on the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    # ru_maxrss is in kilobytes on Linux, in bytes on macOS (where mps runs)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def memory_size(device: torch.device) -> int | None:
    """Bytes: the device's memory (a GPU's; the machine's RAM for the CPU; what Metal
    recommends at most on mps), or None where torch does not say."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        told = getattr(torch.mps, "recommended_max_memory", None)
        return int(told()) if told else None
    import psutil

    return int(psutil.virtual_memory().total)


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation the device (or, for the CPU, the process's address space) refused:
    CUDA's OutOfMemoryError, mps's "MPS backend out of memory", the CPU allocator's
    "can't allocate memory", Python's own MemoryError (unpickling a checkpoint, say)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error) if isinstance(error, RuntimeError) else ""
    return ("out of memory" in text and ("CUDA" in text or "MPS" in text)) or is_host_memory(error)


def is_host_memory(error: BaseException) -> bool:
    """The CPU allocator's or Python's refusal (host memory, not a GPU's)."""
    return isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)
