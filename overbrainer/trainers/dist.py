"""Training on several processes with torch.distributed: the built-in trainer under
``torchrun --nproc-per-node N`` (gloo on CPU, NCCL on GPU: one GPU a process), on one
machine or several (torchrun's rendezvous).

The ranks share each optimizer step: every rank knows the step's examples (the order is a
function of the seed and the step), rank r computes micro-batches r, r+N, ... (as many on
every rank: the plan checks that N divides them), and the gradients are all-reduced by
PyTorch's DistributedDataParallel, in buckets overlapped with the backward of the last
micro-batch (`wrap`, `accumulating`). The loss of a step is normalized by all its loss
tokens, so the math is that of one process; each rank keeps its own RNG (dropout), saved
in the checkpoint beside the others'.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as td


class World:
    """This process's place among the training processes (one process: a world of one)."""

    def __init__(self):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cpu")

    def connect(self, device: torch.device) -> None:
        """Join the other ranks: NCCL between GPUs (each rank's own, set by then), gloo
        between CPU processes."""
        self.device = device  # NCCL reduces tensors on the GPU only
        if self.size > 1:
            td.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, items: list) -> list:
        """This rank's share of a list (round robin)."""
        return items[self.rank :: self.size]

    def sum(self, value: float) -> float:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        td.all_reduce(t, op=td.ReduceOp.SUM)
        return t.item()

    @property
    def scale(self) -> int:
        """What each rank's loss is multiplied by: DDP averages the gradients over the
        ranks, and the step's gradient is their sum (a power of two scales exactly)."""
        return self.size

    def wrap(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """`module` under DDP (one process: as it is). DDP broadcasts rank 0's parameters
        at construction, so every rank starts from the same weights."""
        if self.size == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None,
            # the grads are views into the all-reduce buckets: one copy of them fewer
            gradient_as_bucket_view=True,
        )

    def accumulating(self, model: torch.nn.Module, last: bool):
        """Around a micro-batch's forward and backward: no all-reduce but after the
        step's last one (DDP's no_sync: the grads add up locally until then)."""
        if self.size == 1 or last:
            return nullcontext()
        return model.no_sync()

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer, on every rank (a stop request, say)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        td.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            td.barrier()

    def close(self) -> None:
        if self.size > 1 and td.is_initialized():
            td.destroy_process_group()
