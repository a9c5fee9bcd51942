"""Sizing: will a training step fit in memory, and with what micro-batch?

The estimate, in bytes, for fp32 training (what the built-in trainer does)::

    weights       every parameter of the base, 4 bytes each
    trainable     the adapter (LoRA: r x (in + out) per target module and layer) or all
                  the weights; x4 again for its gradient and AdamW's two moments
    activations   what backward keeps of one micro-batch of micro_batch_size x sequence_len
                  tokens: per layer ~(6 h + 2 kv + 4 i) floats a token (attention inputs and
                  outputs, the MLP's three projections, norms), the attention scores
                  (heads x seq x seq a sequence) and the output layer on the loss positions
                  (vocab floats a token, three times: logits, softmax, gradient)
    runtime       torch and transformers themselves (~0.5 GiB), and a CUDA context on GPU

It is compared with what the device has: the machine's memory (psutil) on CPU, the GPU's
(``nvidia-smi``, no torch import) on GPU, less a margin. Reading the model's shape costs
two small reads (config.json and the safetensors headers), never the weights.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OverbrainerError

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


def device_memory() -> tuple[str, int]:
    """('cuda', bytes of the first GPU) when nvidia-smi sees one, else ('cpu', RAM)."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            )
            if out.returncode == 0 and out.stdout.strip():
                return "cuda", int(out.stdout.split()[0]) * 1024 * 1024
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    import psutil

    return "cpu", psutil.virtual_memory().total


def estimate(shape: Shape, *, lora: bool, lora_r: int, targets: list[str], micro_batch_size: int,
             gradient_accumulation_steps: int, sequence_len: int, device: str, total_memory: int) -> Estimate:
    f32 = 4
    weights = shape.params * f32
    if lora:
        per_layer = sum(lora_r * (i + o) for name, (i, o) in shape.modules.items() if name in targets)
        trainable_params = per_layer * shape.layers
    else:
        trainable_params = shape.params
    trainable = trainable_params * f32 * 3  # its gradient and AdamW's two moments
    tokens = micro_batch_size * sequence_len
    per_token = (6 * shape.hidden + 2 * shape.kv + 4 * shape.intermediate) * f32
    scores = micro_batch_size * shape.heads * sequence_len * sequence_len * f32
    activations = shape.layers * (tokens * per_token + scores) + tokens * shape.vocab * f32 * 3
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
        total_memory: int | None = None) -> Estimate:
    """The largest micro-batch (halving from the plan's) that fits, with gradient
    accumulation raised to keep the plan's examples per step. Refuses, in one line with
    the numbers, when even a micro-batch of one does not fit."""
    if device is None or total_memory is None:
        device, total_memory = device_memory()
    per_step = micro_batch_size * gradient_accumulation_steps
    mbs = micro_batch_size
    while True:
        gas = -(-per_step // mbs)
        est = estimate(shape, lora=lora, lora_r=lora_r, targets=targets, micro_batch_size=mbs,
                       gradient_accumulation_steps=gas, sequence_len=sequence_len, device=device,
                       total_memory=total_memory)
        if est.fits:
            return est
        if mbs == 1 or per_step % (mbs // 2 or 1):
            break
        mbs //= 2
    raise OverbrainerError(
        f"train: even a micro-batch of {mbs} x {sequence_len} tokens needs {est.total / GiB:.1f} GiB "
        f"(weights {est.weights / GiB:.1f}, activations {est.activations / GiB:.1f}) and {device} has "
        f"{est.budget / GiB:.1f} GiB usable; lower train.sequence_len, use adapter lora, or a bigger machine"
    )
