"""The bf16 causal attention on the CPU, side by side. The backward: sdpa's (torch's CPU flash
kernel), the built-in trainer's Python backward (`blocked_backward`) and its C++ kernel
(`cpu_attention_backward.cpp`); the forward: sdpa's and the C++ kernel
(`cpu_attention_forward.cpp`), on inputs laid out as a model's projections give them (viewed
(B, T, H, D) and transposed). The kernels where this machine builds and runs them; on
SmolLM2-135M's heads (9 query heads over 3 key heads of 64), a batch of 4 sequences of each
length.

    bench/.venv/bin/python bench/attention.py [--lengths 128,256,384,512] [--threads 2]

Prints milliseconds a backward (the best of 3 rounds of 20 calls) and the kernel's speed-up
over each, the largest relative error of each one's gradients against float32's, and
milliseconds a forward, sdpa's and the kernel's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_ms  # noqa: E402

from overbrainer.trainers.builtin import cpu_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,256,384,512")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    op = cpu_attention.kernel_for(args.dim)
    print(f"# torch {torch.__version__}, {args.threads} threads, batch {args.batch}, {args.heads}/{args.kv_heads} heads "
          f"of {args.dim}; kernel: {'built' if op is not None else 'not available here'}")
    print("| length | sdpa ms | Python ms | kernel ms | kernel vs sdpa | kernel vs Python "
          "| rel. error sdpa / Python / kernel | forward: sdpa ms | kernel ms | kernel vs sdpa |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        print(row(length, args, op))


def row(length: int, args, op) -> str:
    """One length's line of the table."""
    g = torch.Generator().manual_seed(length)
    shapes = [(args.batch, args.heads, length, args.dim), (args.batch, args.kv_heads, length, args.dim),
              (args.batch, args.kv_heads, length, args.dim), (args.batch, args.heads, length, args.dim)]
    q, k, v, grad = (torch.randn(s, generator=g) for s in shapes)
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True).backward(grad)
    qb, kb, vb, gb = (x.bfloat16() for x in (q, k, v, grad))
    scale = args.dim ** -0.5
    # sdpa's backward alone: its forward's outputs kept, the graph kept for each call
    leaves = [t.detach().requires_grad_() for t in (qb, kb, vb)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    theirs = torch.autograd.grad(out, leaves, gb, retain_graph=True)
    sdpa_ms = best_ms(lambda: torch.autograd.grad(out, leaves, gb, retain_graph=True))
    attn, lse = cpu_attention._attend(qb, kb, vb, scale)
    inputs = (qb, kb, vb, attn.transpose(1, 2), lse, gb, scale)
    python = cpu_attention.blocked_backward(*inputs)
    python_ms = best_ms(lambda: cpu_attention.blocked_backward(*inputs))

    def error(grads):
        return max(float((a.float() - e.grad).norm() / e.grad.norm()) for a, e in zip(grads, exact))

    # the forwards, on the layout the projections give: (B, T, H, D) viewed and transposed
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (qb, kb, vb))
    sdpa_forward_ms = best_ms(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_t, k_t, v_t, 0.0, True, attn_mask=None, scale=scale))
    if op is None:
        return (f"| {length} | {sdpa_ms:.2f} | {python_ms:.2f} | | | | {error(theirs):.4f} / {error(python):.4f} / "
                f"| {sdpa_forward_ms:.2f} | | |")
    mine = cpu_attention.kernel_backward(op, *inputs)
    kernel_ms = best_ms(lambda: cpu_attention.kernel_backward(op, *inputs))
    forward = cpu_attention.kernel_forward(args.dim)
    forward_ms = best_ms(lambda: forward(q_t, k_t, v_t, scale))
    return (f"| {length} | {sdpa_ms:.2f} | {python_ms:.2f} | {kernel_ms:.2f} | {sdpa_ms / kernel_ms:.2f}x | "
            f"{python_ms / kernel_ms:.2f}x | {error(theirs):.4f} / {error(python):.4f} / {error(mine):.4f} "
            f"| {sdpa_forward_ms:.2f} | {forward_ms:.2f} | {sdpa_forward_ms / forward_ms:.2f}x |")


if __name__ == "__main__":
    main()
