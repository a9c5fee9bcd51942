"""Training on several processes with torch.distributed: the built-in trainer under
``torchrun --nproc-per-node N`` (gloo on CPU, NCCL on GPU).

The ranks share each optimizer step: every rank knows the step's examples (the order is a
function of the seed and the step), rank r computes micro-batches r, r+N, ..., and the
gradients are summed across ranks before the optimizer step. The loss of a step is
normalized by all its loss tokens, so the math is that of one process; each rank keeps
its own RNG (dropout), saved in the checkpoint beside the others'.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as td


class World:
    """This process's place among the training processes (one process: a world of one)."""

    def __init__(self):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.size > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(self.local_rank)
            td.init_process_group(backend=backend)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, items: list) -> list:
        """This rank's share of a list (round robin)."""
        return items[self.rank :: self.size]

    def sum(self, value: float) -> float:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        td.all_reduce(t, op=td.ReduceOp.SUM)
        return t.item()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` across ranks, in one flat buffer."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        td.all_reduce(flat, op=td.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer, on every rank (a stop request, say)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        td.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            td.barrier()

    def close(self) -> None:
        if self.size > 1 and td.is_initialized():
            td.destroy_process_group()
