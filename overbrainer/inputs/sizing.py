"""Sizing: will a training step fit in memory, and with what micro-batch?

The estimate, in bytes, with the plan's settings counted::

    weights       every parameter of the base: 4 bytes each in float32; 2 in bf16 when
                  the base is frozen (LoRA under bf16); ~0.56 (4-bit NF4 with its
                  double-quantized scales: ~0.52) for the quantized linears under QLoRA, whose
                  norms, embeddings and output layer peft keeps in float32
    trainable     the adapter (LoRA: r x (in + out) per target module and layer) or all
                  the weights; x4 again for its gradient and AdamW's two moments
    activations   what backward keeps of one micro-batch of micro_batch_size x sequence_len
                  tokens: per layer ~(6 h + 2 kv + 4 i) values a token (attention inputs and
                  outputs, the MLP's three projections, norms), 2 bytes each under bf16,
                  the attention scores (heads x seq x seq a sequence; none on CUDA, where
                  sdpa's flash and memory-efficient kernels never hold them) and the output
                  layer on the loss positions (vocab floats a token, three times: logits,
                  softmax, gradient). With gradient checkpointing, only each layer's input
                  (h a token) is kept, plus one layer's worth recomputed in the backward.
    runtime       torch and transformers themselves (~0.5 GiB), and a CUDA context on GPU
    shards        under train.shard (FSDP2 over N processes), each holds 1/N of the weights
                  and of the training state, plus the whole of the largest layer twice (the
                  one computing and the next one being gathered)

It is compared with what the device has free: the machine's available memory (psutil) on
CPU, the chosen GPU's free memory (``nvidia-smi``, no torch import) on CUDA, less a
margin. Each process of several on one GPU box has its own GPU, so the budget is per GPU.
Reading the model's shape costs two small reads (config.json and the safetensors
headers), never the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OverbrainerError
from ..portable.common import cpu_has_amx

__all__ = ["Shape", "Estimate", "model_shape", "estimate", "device_memory", "fit", "GiB"]

GiB = 1024**3
RUNTIME = int(0.5 * GiB)
CUDA_CONTEXT = int(0.5 * GiB)
MARGIN = 0.85  # of the device's total memory: the rest is the system's and other programs'


@dataclass(frozen=True)
class Shape:
    params: int
    hidden: int
    layers: int
    heads: int
    kv: int  # key/value width: kv heads x head dim
    intermediate: int
    vocab: int
    modules: dict  # name -> (in, out) of each linear a LoRA target may name, per layer


@dataclass
class Estimate:
    weights: int
    trainable: int
    activations: int
    runtime: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    device: str
    budget: int

    @property
    def total(self) -> int:
        return self.weights + self.trainable + self.activations + self.runtime

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        return (
            f"memory: {self.total / GiB:.2f} GiB estimated (weights {self.weights / GiB:.2f}, "
            f"training state {self.trainable / GiB:.2f}, activations {self.activations / GiB:.2f}, "
            f"runtime {self.runtime / GiB:.2f}) of {self.budget / GiB:.1f} GiB usable on {self.device}, "
            f"micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps}"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}


def _safetensors_params(folder: Path) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total


def model_shape(folder: str | Path) -> Shape:
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    i = cfg["intermediate_size"]
    modules = {
        "q_proj": (h, heads * head_dim),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return Shape(
        params=_safetensors_params(folder),
        hidden=h,
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv=kv,
        intermediate=i,
        vocab=cfg["vocab_size"],
        modules=modules,
    )


def _nvidia_gpus() -> list[dict] | None:
    """The GPUs nvidia-smi sees, in its order (PCI bus): index, uuid, free bytes, compute
    capability (None from a driver too old to say). None when there is no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    for fields in ("index,uuid,memory.free,compute_cap", "index,uuid,memory.free"):
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0 or not out.stdout.strip():
            continue
        gpus = []
        try:
            for line in out.stdout.strip().splitlines():
                cells = [c.strip() for c in line.split(",")]
                cap = float(cells[3]) if len(cells) > 3 else None
                gpus.append({"index": cells[0], "uuid": cells[1], "free": int(cells[2]) * 1024 * 1024, "cap": cap})
        except (ValueError, IndexError):
            continue
        return gpus
    return None


def cuda_gpu(index: int, env: dict | None = None, gpus: list[dict] | None = None) -> dict | None:
    """The GPU torch numbers `index` (``cuda:N``), as nvidia-smi describes it. CUDA numbers
    the GPUs fastest first unless CUDA_DEVICE_ORDER is PCI_BUS_ID (nvidia-smi's order), and
    only those CUDA_VISIBLE_DEVICES names (by number in that order, or by UUID), from 0.
    None where that cannot be told (no nvidia-smi, a MIG slice, an index past the end)."""
    env = os.environ if env is None else env
    gpus = _nvidia_gpus() if gpus is None else gpus
    if not gpus:
        return None
    if env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        # FASTEST_FIRST, CUDA's default: by compute capability, ties in bus order (sorted is stable)
        gpus = sorted(gpus, key=lambda g: -(g["cap"] or 0))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = []
        for entry in (e.strip() for e in visible.split(",")):
            if entry.isdecimal() and int(entry) < len(gpus):
                chosen.append(gpus[int(entry)])
            elif entry.startswith("GPU-"):
                found = [g for g in gpus if g["uuid"].startswith(entry)]
                if len(found) != 1:
                    break
                chosen.append(found[0])
            else:
                break  # a MIG slice (not in nvidia-smi's list), or an entry CUDA stops at
        gpus = chosen
    return gpus[index] if index < len(gpus) else None


def _visible_gpu(device: str) -> dict | None:
    """nvidia-smi's entry for the GPU the plan's train.device names ("auto" and "cuda" are
    cuda:0), with one nvidia-smi call; None when it names none or nvidia-smi sees none."""
    if not (device == "auto" or device.startswith("cuda")):
        return None
    index = int(device.split(":")[1]) if ":" in device else 0
    gpus = _nvidia_gpus()
    if not gpus:
        return None
    gpu = cuda_gpu(index, gpus=gpus)
    if gpu is None and "MIG-" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
        # a MIG slice: nvidia-smi lists no free memory of slices; its GPU's N-th, at least
        # a GPU's (host memory would size a GPU run against RAM)
        gpu = gpus[index] if index < len(gpus) else None
    return gpu


def device_memory(device: str = "auto") -> tuple[str, int]:
    """(the device the plan's train.device names, the bytes free there): a GPU's free
    memory when it is CUDA ("auto" and nvidia-smi sees one, or "cuda", "cuda:N"), else
    the machine's available RAM (CPU, and Apple mps, whose memory is the machine's)."""
    gpu = _visible_gpu(device)
    return ("cuda", gpu["free"]) if gpu is not None else _host_memory(device)


def _host_memory(device: str) -> tuple[str, int]:
    import psutil

    return ("mps" if device == "mps" else "cpu"), psutil.virtual_memory().available


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits a weight; an 8-bit scale per 64, an fp32 per 256 of those


def estimate(shape: Shape, *, lora: bool, lora_r: int, targets: list[str], micro_batch_size: int,
             gradient_accumulation_steps: int, sequence_len: int, device: str, total_memory: int,
             qlora: bool = False, bf16: bool | str = False, gradient_checkpointing: bool = False,
             shards: int = 1) -> Estimate:
    f32 = 4
    # "auto" on a GPU is resolved by `fit` (its compute capability); on the CPU it is AMX
    half = (bf16 is True) or (bf16 == "auto" and (device == "cuda" or (device == "cpu" and cpu_has_amx())))
    act = 2 if half else f32
    per_layer_linear = sum(i * o for i, o in shape.modules.values())
    linear = per_layer_linear * shape.layers
    if qlora:
        # the linears of the layers in NF4; the rest (embeddings, norms, output layer) in float32
        weights = int(linear * NF4_BYTES) + (shape.params - linear) * f32
    elif lora and half:
        weights = shape.params * 2
    else:
        weights = shape.params * f32
    if lora:
        per_layer = sum(lora_r * (i + o) for name, (i, o) in shape.modules.items() if name in targets)
        trainable_params = per_layer * shape.layers
    else:
        trainable_params = shape.params
    trainable = trainable_params * f32 * 3  # its gradient and AdamW's two moments
    if shards > 1:
        # FSDP2: a shard of everything, and two layers (or the embeddings) gathered whole
        width = 2 if half and lora else f32
        gathered = 2 * max(per_layer_linear, shape.vocab * shape.hidden) * width
        weights = -(-weights // shards) + gathered
        trainable = -(-trainable // shards)
    tokens = micro_batch_size * sequence_len
    per_token = (6 * shape.hidden + 2 * shape.kv + 4 * shape.intermediate) * act
    scores = 0 if device == "cuda" else micro_batch_size * shape.heads * sequence_len * sequence_len * act
    if gradient_checkpointing:
        layers = shape.layers * tokens * shape.hidden * act + tokens * per_token + scores
    else:
        layers = shape.layers * (tokens * per_token + scores)
    activations = layers + tokens * shape.vocab * f32 * 3
    runtime = RUNTIME + (CUDA_CONTEXT if device == "cuda" else 0)
    return Estimate(
        weights=weights,
        trainable=trainable,
        activations=activations,
        runtime=runtime,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        device=device,
        budget=int(total_memory * MARGIN),
    )


def fit(shape: Shape, *, lora: bool, lora_r: int, targets: list[str], micro_batch_size: int,
        gradient_accumulation_steps: int, sequence_len: int, device: str | None = None,
        total_memory: int | None = None, qlora: bool = False, bf16: bool | str = False,
        gradient_checkpointing: bool = False, device_setting: str = "auto", processes: int = 1,
        shards: int = 1, auto_on_cpu: bool = True) -> Estimate:
    """The largest micro-batch (halving from the plan's) that fits, with gradient
    accumulation raised to keep the plan's examples per step. Refuses, in one line with
    the numbers, when even a micro-batch of one does not fit.

    Several processes on CPU share the machine's memory (each holds the model); on CUDA
    each has its own GPU. `auto_on_cpu`: whether bf16 "auto" computes in bf16 on a CPU with
    AMX (the built-in trainer's rule; Axolotl's "auto" is bf16 on a GPU only)."""
    if device is None or total_memory is None:
        gpu = _visible_gpu(device_setting)
        if gpu is not None:
            device, total_memory = "cuda", gpu["free"]
            if bf16 == "auto":
                # "auto" is bf16 where the GPU has it natively: compute capability 8.0 and newer
                bf16 = gpu["cap"] is None or gpu["cap"] >= 8.0
        else:
            device, total_memory = _host_memory(device_setting)
            if processes > 1:
                total_memory //= processes
    if bf16 == "auto" and device != "cuda" and not auto_on_cpu:
        bf16 = False
    per_step = micro_batch_size * gradient_accumulation_steps
    mbs = micro_batch_size
    while True:
        gas = -(-per_step // mbs)
        est = estimate(shape, lora=lora, lora_r=lora_r, targets=targets, micro_batch_size=mbs,
                       gradient_accumulation_steps=gas, sequence_len=sequence_len, device=device,
                       total_memory=total_memory, qlora=qlora, bf16=bf16,
                       gradient_checkpointing=gradient_checkpointing, shards=shards)
        if est.fits:
            return est
        # halve while the examples of a step still split evenly (and, with several
        # processes, into a number of micro-batches they share equally)
        half = mbs // 2
        if mbs == 1 or per_step % (half or 1) or (per_step // max(half, 1)) % processes:
            break
        mbs = half
    lower = "lower train.sequence_len"
    if not gradient_checkpointing:
        lower += ", set train.gradient_checkpointing"
    if shards == 1 and processes > 1 and not qlora:
        lower += ", set train.shard"
    if not lora:
        lower += ", use adapter lora"
    elif not qlora:
        lower += ", use adapter qlora"
    raise OverbrainerError(
        f"train: even a micro-batch of {mbs} x {sequence_len} tokens needs {est.total / GiB:.1f} GiB "
        f"(weights {est.weights / GiB:.1f}, activations {est.activations / GiB:.1f}) and {device} has "
        f"{est.budget / GiB:.1f} GiB usable; {lower}, or a bigger machine"
    )
