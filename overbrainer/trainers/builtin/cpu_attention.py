"""Causal attention for training in bf16 on the CPU: C++ kernels where they run, a faster
backward everywhere.

PyTorch's flash attention for the CPU runs its bf16 forward fast, but its bf16 backward
takes 6 to 19 times as long as that forward (2 cores, SmolLM2's 9 heads over 3 KV heads,
4 sequences of 128 to 512 tokens), where a backward should take two to three: about 30 %
of a LoRA step of SmolLM2-135M. Here the forward returns each row's log-sum-exp with its
output, and the backward recomputes the attention from that log-sum-exp, as a flash
kernel's does, with the key and value heads shared by their query heads without copying
them, and skips what lies above the diagonal. Where a C++ compiler and AMX are at hand
(`cpu_kernels`: oneDNN's brgemm through ATen, bf16 operands, float32 scores), both are C++
kernels built on first use:

- the forward (`cpu_attention_forward.cpp`): sdpa's CPU flash kernel's speed alone
  (1.1-1.3x since 2026-12-08, bench/attention.py), 1.6x in a compiled training step, where its inputs come
  cold from the projections (train.profile: 64 ms a step against 103);
- the backward (`cpu_attention_backward.cpp`): 2.7 to 6 times sdpa's backward
  (bench/attention.py), any length.

Elsewhere the forward is sdpa's own CPU flash kernel, and the backward is Python's
(`blocked_backward`): blocks of queries, memory linear in the length, up to `LONGEST`
tokens, past which sdpa's backward is as fast.

The built-in trainer uses it where it was measured faster: training on the CPU in bf16
(`train.bf16`), causal attention without a mask (the loop drops it: right padding), no
dropout. Anything else (evaluation, chat, a longer batch without the kernel) goes to
transformers' sdpa, unchanged.
"""

from __future__ import annotations

import torch

from . import cpu_kernels

NAME = "overbrainer_cpu"
BLOCK = 64  # queries a block; 128 and 256 were slower on 2 cores (bench/README section 4)
# the longest sequence the Python backward takes: past ~600 tokens sdpa's was as fast (2 cores);
# the kernel takes any length (1.6-2.1x sdpa's at 768 to 2048 tokens, bench/attention.py)
LONGEST = 512
# sdpa's CPU flash kernel reads fewer key heads than query heads (GQA) only since pytorch
# PR 157893 (July 2025, in 2.10 at the latest); an older one reads past the key heads, so its
# forward gets the key and value heads repeated for every query head (the backward never)
KEY_HEADS_SHARED = torch.__version__ >= "2.10"  # TorchVersion: compared as a version, not text


# the schemas spelled out, not inferred from the annotations (strings here: postponed evaluation)
@torch.library.custom_op("overbrainer::causal_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, T, H, D), the rows' log-sum-exp (B, H, T) in float32): the C++ forward where
    it runs, else sdpa's CPU flash kernel. An operator of its own, opaque to torch.compile, so
    that compiled decoder layers call it as it is, for any length (traced, the backward's loop
    over blocks would tie a compiled layer to one length); its outputs' layouts are fixed for
    the same reason (sdpa's follow the query's)."""
    forward = kernel_forward(q.shape[-1]) if q.dtype == torch.bfloat16 else None
    if forward is not None:
        return forward(q, k, v, scale)
    kq, vq = k, v
    if k.shape[1] != q.shape[1] and not KEY_HEADS_SHARED:
        kq, vq = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kq, vq, 0.0, True, attn_mask=None,
                                                                          scale=scale)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


@_attend.register_fake
def _(q, k, v, scale):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("overbrainer::causal_attention_backward", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, float scale) "
                                "-> (Tensor, Tensor, Tensor)")
def _attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     grad_out: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), `attention_backward`'s; `out` and `grad_out` as `_attend` returns them."""
    return attention_backward(q, k, v, out.transpose(1, 2), lse, grad_out.transpose(1, 2), scale)


@_attend_backward.register_fake
def _(q, k, v, out, lse, grad_out, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_attend_backward(q, k, v, out, lse, grad_out.contiguous(), ctx.scale), None)


_attend.register_autograd(_backward, setup_context=_save)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """out = softmax(q kᵀ · scale + causal) v, for q (B, H, T, D) and k, v (B, H/G, T, D):
    (B, T, H, D), the layout transformers' attention interface returns."""
    return _attend(q, k, v, scale)[0]


def attention_backward(q, k, v, out, lse, grad_out, scale: float):
    """(dq, dk, dv) of causal attention: the C++ kernel's where it runs (`kernel_backward`),
    else `blocked_backward`'s."""
    op = kernel_for(q.shape[-1]) if q.dtype == torch.bfloat16 else None
    if op is not None:
        return kernel_backward(op, q, k, v, out, lse, grad_out, scale)
    return blocked_backward(q, k, v, out, lse, grad_out, scale)


def kernel_backward(op, q, k, v, out, lse, grad_out, scale: float):
    """(dq, dk, dv) from `cpu_attention_backward.cpp`, which takes the tensors as they are (any
    strides, a dense last dimension) and returns them dense."""
    return op(q, k, v, out, lse, grad_out, scale)


def blocked_backward(q, k, v, out, lse, grad_out, scale: float, block: int = BLOCK):
    """(dq, dk, dv) of causal attention, recomputed a block of queries at a time.

    The G query heads of a key head are stacked as rows of one matrix (B, KVH, G·rows, D),
    so every product is one batched matmul against the shared keys. The products whose
    results are subtracted or exponentiated (the scores, dO·Vᵀ) and dQ are float32, as the
    forward's scores are: rounded to bf16 they made dQ twice as far from float32's as sdpa's
    (tests/test_cpu_attention.py); the two that only sum into dK and dV run in the inputs'
    dtype (bf16: float32 sums inside), summed over the blocks in float32."""
    B, H, T, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    dtype = q.dtype
    q5 = q.reshape(B, KVH, G, T, D)
    qf5 = q5.float() * scale  # the scores' left side, scaled once in float32 (a new tensor)
    do5 = grad_out.reshape(B, KVH, G, T, D)
    lse5 = lse.view(B, KVH, G, T)
    delta = (do5.float() * out.reshape(B, KVH, G, T, D).float()).sum(-1)  # rowsum(dO ∘ O)
    dq = torch.empty(B, KVH, G, T, D, dtype=dtype)
    dk = torch.zeros(B, KVH, T, D, dtype=torch.float32)
    dv = torch.zeros(B, KVH, T, D, dtype=torch.float32)
    kf, vf = k.float(), v.float()
    above = torch.ones(block, block, dtype=torch.bool).triu_(1)  # keys after the query
    for s in range(0, T, block):
        e = min(s + block, T)
        rows = e - s
        qb = q5[:, :, :, s:e].reshape(B, KVH, G * rows, D)
        qfb = qf5[:, :, :, s:e].reshape(B, KVH, G * rows, D)
        dob = do5[:, :, :, s:e].reshape(B, KVH, G * rows, D)
        kb = kf[:, :, :e]
        p = torch.matmul(qfb, kb.transpose(-1, -2)).view(B, KVH, G, rows, e)
        p[..., s:e].masked_fill_(above[:rows, :rows], float("-inf"))
        p.sub_(lse5[:, :, :, s:e, None]).exp_()  # the forward's probabilities, exactly renormalized
        p_in = p.to(dtype).view(B, KVH, G * rows, e)
        dv[:, :, :e] += torch.matmul(p_in.transpose(-1, -2), dob)
        dp = torch.matmul(dob.float(), vf[:, :, :e].transpose(-1, -2)).view(B, KVH, G, rows, e)
        ds = p.mul_(dp.sub_(delta[:, :, :, s:e, None])).view(B, KVH, G * rows, e)
        dq[:, :, :, s:e] = torch.matmul(ds, kb).mul_(scale).view(B, KVH, G, rows, D)
        dk[:, :, :e] += torch.matmul(ds.to(dtype).transpose(-1, -2), qb)
    return dq.view(B, H, T, D), dk.mul_(scale).to(k.dtype), dv.to(v.dtype)


def serves(model) -> bool:
    """Whether the kernel computes this model's attention backward: the model switched to
    `NAME` (`use`), heads the kernel takes, and the kernel built (here and now, where it is
    not yet: before training, not in its first step)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != NAME:
        return False
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kernel_for(head_size) is not None


def kernel_for(head_size: int):
    """The backward kernel's operator for heads of this size, where it is built; else None."""
    ops = kernels_for(head_size)
    return ops.causal_attention_backward if ops is not None else None


def kernel_forward(head_size: int):
    """The forward kernel's operator for heads of this size, where it is built; else None."""
    ops = kernels_for(head_size)
    return ops.causal_attention_forward if ops is not None else None


def kernels_for(head_size: int):
    """`cpu_kernels.ops()` for heads the attention kernels compute: multiples of 16 up to 512
    (64, 80, 96, 128, 256: the families' heads); else None."""
    return cpu_kernels.ops() if head_size % 16 == 0 and head_size <= 512 else None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention interface: (output (B, T, H, D), None). This path where
    it applies (`applies`), transformers' sdpa otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not applies(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return causal_attention(query, key, value, scale), None


def applies(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> bool:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and attention_mask is None
        and not dropout
        and causal
        and 1 < query.shape[2] == key.shape[2]
        # past LONGEST sdpa's backward is as fast as the Python one, not as the kernel
        and (key.shape[2] <= LONGEST or kernel_for(query.shape[-1]) is not None)
        and query.shape[1] % key.shape[1] == 0
        and key.shape == value.shape  # one head size for all three (not DeepSeek's latent attention)
        and query.shape[-1] == key.shape[-1]
        and all(x.stride(-1) == 1 for x in (query, key, value))  # what the flash kernel reads
        and all(kwargs.get(term) is None for term in ("sliding_window", "softcap", "position_bias", "s_aux", "sinks"))
    )


def register() -> str:
    """Make `NAME` an attention implementation transformers knows (its masks: sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use(model) -> bool:
    """Switch a model that transformers loaded with sdpa to `NAME`; True when it did.

    Loading with sdpa first keeps transformers' own check that the model's attention is
    sdpa's (a model with attention sinks or another term sdpa lacks refuses it, where a
    registered name would be taken on trust). The switch is made only where every attention
    layer goes through transformers' attention interface; another model (remote code among
    them) keeps sdpa."""
    config = model.config
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    switch = getattr(model, "set_attn_implementation", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or None in (can_set, switch) or not can_set():
        return False
    register()
    switch(NAME)
    return config._attn_implementation == NAME
