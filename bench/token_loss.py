"""The output layer and its loss in bf16 on the CPU, forward and backward, side by side: the
plain path eager (a bf16 matmul, the cross-entropy in float32, as the built-in trainer runs it
without `train.compile`), the same compiled (`TokenLoss(compiled=True)`, what it runs with
`train.compile`), and the C++ kernel (`cpu_token_loss.cpp`, where this machine builds and runs
it), on SmolLM2-135M's output layer (49,152 x 576, frozen), for a number of loss positions.

    bench/.venv/bin/python bench/token_loss.py [--rows 300,600,945,1500] [--threads 2]

Prints milliseconds a forward and backward (the best of 3 rounds of 5 calls), the kernel's
speed-up over each, and each one's relative error against float32's (the summed loss, and the
hidden states' gradient).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_ms  # noqa: E402

from overbrainer.trainers.builtin import cpu_kernels, cpu_token_loss
from overbrainer.trainers.builtin.model import TokenLoss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="300,600,945,1500")
    ap.add_argument("--vocabulary", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    built = cpu_kernels.ops() is not None
    print(f"# torch {torch.__version__}, {args.threads} threads, output layer {args.vocabulary} x {args.hidden} "
          f"(bf16, frozen); kernel: {'built' if built else 'not available here'}")
    print("| loss positions | eager ms | compiled ms | kernel ms | kernel vs eager | kernel vs compiled "
          "| loss rel. error eager / compiled / kernel | gradient rel. error eager / compiled / kernel |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocabulary, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocabulary, args.hidden, generator=g) * 0.05)
    head = head.bfloat16().requires_grad_(False)
    plain, compiled = TokenLoss(), TokenLoss(compiled=True)
    for rows in (int(x) for x in args.rows.split(",")):
        print(row(rows, head, plain, compiled, built, g), flush=True)


def row(rows: int, head, plain: TokenLoss, compiled: TokenLoss, built: bool, g: torch.Generator) -> str:
    """One number of loss positions' line of the table."""
    states = torch.randn(rows, head.weight.shape[1], generator=g).bfloat16()
    targets = torch.randint(0, head.weight.shape[0], (rows,), generator=g)
    exact_x = states.float().requires_grad_()
    exact = F.cross_entropy(exact_x @ head.weight.float().t(), targets, reduction="sum")
    exact.backward()

    def run(loss_of):
        x = states.clone().requires_grad_()
        loss = loss_of(x, head, targets)
        loss.backward()
        return loss.detach(), x.grad

    sides = {"eager": plain.plain, "compiled": compiled._compiled}
    if built:
        sides["kernel"] = lambda x, head, targets: cpu_token_loss.token_loss(x, head.weight, targets, 1.0)
    ms, errors = {}, {}
    for name, side in sides.items():
        loss, grad = run(side)
        errors[name] = (abs(loss.item() - exact.item()) / abs(exact.item()),
                        float((grad.float() - exact_x.grad).norm() / exact_x.grad.norm()))
        ms[name] = best_ms(lambda side=side: run(side), calls=5, warmup=2)
    kernel = ms.get("kernel")
    speedups = [f"{ms[other] / kernel:.2f}x" if kernel else "" for other in ("eager", "compiled")]
    return (f"| {rows} | {ms['eager']:.1f} | {ms['compiled']:.1f} | {f'{kernel:.1f}' if kernel else ''} "
            f"| {speedups[0]} | {speedups[1]} "
            f"| {' / '.join(f'{e[0]:.1e}' for e in errors.values())} "
            f"| {' / '.join(f'{e[1]:.4f}' for e in errors.values())} |")


if __name__ == "__main__":
    main()
