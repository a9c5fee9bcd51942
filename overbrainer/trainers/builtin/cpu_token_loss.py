"""The output layer's loss in bf16 on the CPU, the logits never held: `cpu_token_loss.cpp`.

A plain loss writes the logits (rows x the vocabulary) and goes over them four times more
(their cast, log-softmax, its backward, the gradient's matmul): on 2 cores, SmolLM2-135M's
output layer and loss took 110-116 ms for 600 loss positions compiled, 220-240 ms eager. The kernel
goes over the vocabulary by tiles that stay in cache and takes 70 ms (bench/token_loss.py).
It computes the gradient for the hidden states only, so it serves a frozen output layer
(LoRA without an adapter on it); the loop's `TokenLoss` uses it where `applies` says so, and
its plain path everywhere else.
"""

from __future__ import annotations

import torch

from . import cpu_kernels

_PACKED: dict = {}  # the output layer last packed: (its storage, version, shape) -> brgemm's operands


def applies(hidden: torch.Tensor, head: torch.nn.Module, softcap: float | None) -> bool:
    """Whether the kernel computes the loss of these hidden states (L, D): bf16 on the CPU,
    of the output layer's hidden size, and `serves` the output layer."""
    return (hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16 and hidden.dim() == 2
            and serves(head, softcap) and hidden.shape[1] == head.weight.shape[1])


def serves(head: torch.nn.Module, softcap: float | None) -> bool:
    """Whether the kernel takes this output layer: a plain linear layer (not one with an
    adapter, whose `weight` is its frozen base's), a frozen bf16 weight on the CPU without a
    bias, logits that are only scaled (no soft cap), a hidden size that is a multiple of 16,
    and the kernels built (here and now, where they are not yet)."""
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(weight, torch.Tensor) or hasattr(weight, "device_mesh"):
        return False  # a LoRA layer (PEFT's are not nn.Linear), a sharded one (DTensor)
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2 and weight.shape[1] % 16 == 0
        and not weight.requires_grad
        and getattr(head, "bias", None) is None
        and softcap is None
        and cpu_kernels.ops() is not None
    )


def token_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """Σ over rows of cross_entropy(scale · hidden·weightᵀ, targets), float32: hidden (L, D)
    bf16, weight (V, D) bf16 and frozen, targets (L) in [0, V)."""
    return _token_loss(hidden, weight, targets.long(), float(scale))[0].sum()


def packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as the kernel reads it, packed once while it does not change (a frozen
    layer: once a run; ~50 ms for a 49,152 x 576 layer on 2 cores)."""
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), weight._version, tuple(weight.shape))
    operands = _PACKED.get(key)
    if operands is None:
        _PACKED.clear()  # one output layer at a time: the packed copy is as large as the weight, twice
        operands = _PACKED[key] = cpu_kernels.ops().pack_output_layer(weight.detach())
    return operands


# operators of their own, opaque to torch.compile (the schemas spelled out: postponed annotations)
@torch.library.custom_op("overbrainer::token_loss", mutates_args=(),
                         schema="(Tensor hidden, Tensor weight, Tensor targets, float scale) -> (Tensor, Tensor)")
def _token_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss, each row's log-sum-exp), float32."""
    scores, _ = packed(weight)
    return cpu_kernels.ops().token_loss_forward(hidden, scores, weight.shape[0], targets, scale)


@_token_loss.register_fake
def _(hidden, weight, targets, scale):
    rows = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows)


@torch.library.custom_op("overbrainer::token_loss_backward", mutates_args=(),
                         schema="(Tensor hidden, Tensor weight, Tensor targets, Tensor lse, Tensor grad, float scale) "
                                "-> Tensor")
def _token_loss_backward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                         grad: torch.Tensor, scale: float) -> torch.Tensor:
    """The hidden states' gradient (L, D) bf16, for the rows' losses' gradient `grad` (L)."""
    scores, rows = packed(weight)
    return cpu_kernels.ops().token_loss_backward(hidden, scores, rows, weight.shape[0], targets, lse, grad, scale)


@_token_loss_backward.register_fake
def _(hidden, weight, targets, lse, grad, scale):
    return torch.empty_like(hidden)


def _save(ctx, inputs, output):
    hidden, weight, targets, scale = inputs
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.scale = scale


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    return _token_loss_backward(hidden, weight, targets, lse, grad_loss, ctx.scale), None, None, None


_token_loss.register_autograd(_backward, setup_context=_save)
