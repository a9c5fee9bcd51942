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

Under ``train.shard`` the model is PyTorch's FSDP2 instead (`fully_shard` on each decoder
layer, then on the whole): each rank holds 1/N of every weight, gradient and optimizer
moment, a layer is all-gathered for its forward and backward and freed after, and the
gradients are reduce-scattered after each micro-batch (no unsharded gradient is ever
kept: memory before communication). With bf16, the layers are gathered and computed in
bf16 and the gradients reduced in float32 (`MixedPrecisionPolicy`), as PyTorch documents it.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as td


class World:
    """This process's place among the training processes (one process: a world of one)."""

    def __init__(self, shard: bool = False):
        self.shard = shard
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cpu")

    def connect(self, device: torch.device) -> None:
        """Join the other ranks: NCCL between GPUs (each rank's own, set by then), gloo
        between CPU processes."""
        self.device = device  # NCCL reduces tensors on the GPU only
        backend = "nccl" if device.type == "cuda" else "gloo"
        if self.size > 1:
            # NCCL bound to this rank's GPU (its barriers and collectives use no other)
            td.init_process_group(backend=backend, **({"device_id": device} if device.type == "cuda" else {}))
        elif self.shard:  # FSDP2 works in a process group, be it of one (no torchrun needed)
            td.init_process_group(backend=backend, store=td.HashStore(), rank=0, world_size=1)

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

    def wrap(self, module: torch.nn.Module, device: torch.device, layers: list[torch.nn.Module] = (),
             bf16: bool = False) -> torch.nn.Module:
        """`module` under DDP, or sharded by FSDP2 (one process: as it is). DDP broadcasts
        rank 0's parameters at construction; FSDP2 keeps each rank's slice of the weights
        every rank loaded alike, moved to `device` (`layers` are sharded one by one first,
        so no more than one of them is ever whole on the device while sharding)."""
        if self.shard:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (self.size,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            for layer in layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            # the root holds the rest (embeddings, final norm, output layer); FSDP2 keeps a
            # root gathered from its forward to its backward, where it is needed again
            return fully_shard(module, mesh=mesh, mp_policy=policy)
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
        step's last one (DDP's no_sync: the grads add up locally until then). Sharded,
        every micro-batch's gradients are reduce-scattered into the shards at once."""
        if self.size == 1 or last or self.shard:
            return nullcontext()
        return model.no_sync()

    def even(self, items: list) -> tuple[list, int]:
        """This rank's share of `items` with as many entries on every rank (FSDP2's
        gathers are collectives: every rank runs each forward), and how many of them
        count: a rank short of one repeats its first, whose result it drops."""
        mine = self.mine(items)
        if not self.shard or self.size == 1:
            return mine, len(mine)
        rounds = -(-len(items) // self.size)
        return (mine + [items[0]] * (rounds - len(mine))), len(mine)

    def full_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   trainable_only: bool) -> tuple[dict, dict]:
        """A sharded model's weights and optimizer state, gathered whole into rank 0's
        host memory (every rank must call it; the others get empty dicts): keyed by the
        parameters' names, so they fit any world size. `trainable_only`: not the frozen
        base of a LoRA, which the base model's files already hold."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return (get_model_state_dict(module, options=options),
                get_optimizer_state_dict(module, optimizer, options=options))

    def load_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A whole optimizer state (`full_state`'s, read by every rank) into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

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
        if td.is_initialized():
            td.destroy_process_group()
