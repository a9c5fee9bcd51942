"""The output layer's loss in bf16 on the CPU without the logits (the C++ kernel in
overbrainer/trainers/builtin/cpu_token_loss.cpp): its loss and gradient against float32's
from the same bf16 inputs, and where the trainer's `TokenLoss` takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import can_build_the_kernel, on_threads
from peft import LoraConfig, get_peft_model

from overbrainer.trainers.builtin import cpu_kernels, cpu_token_loss
from overbrainer.trainers.builtin.model import TokenLoss


@pytest.fixture
def kernels():
    if cpu_kernels.ops() is None:
        assert not can_build_the_kernel(), "a C++ compiler and a bf16 brgemm, yet no kernels"
        pytest.skip("the CPU kernels do not run here (no bf16 brgemm, or no C++ compiler)")
    return cpu_kernels.ops()


def case(vocabulary, hidden, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocabulary, hidden, generator=g) * 0.2).bfloat16()
    states = torch.randn(rows, hidden, generator=g).bfloat16()
    targets = torch.randint(0, vocabulary, (rows,), generator=g)
    targets[0], targets[-1] = vocabulary - 1, 0  # the vocabulary's last entry (its padded tile) and first
    return states, weight, targets


def float32_loss(states, weight, targets, scale):
    """The loss and the states' gradient in float32, from the same bf16 values."""
    x = states.float().requires_grad_()
    loss = F.cross_entropy((x @ weight.float().t()) * scale, targets, reduction="sum")
    loss.backward()
    return loss.detach(), x.grad


def bf16_loss(states, weight, targets, scale):
    """What the trainer computes without the kernel: a bf16 matmul, the loss in float32."""
    x = states.clone().requires_grad_()
    loss = F.cross_entropy((x @ weight.t()).float() * scale, targets, reduction="sum")
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("vocabulary,hidden,rows,scale", [
    (1000, 64, 37, 1.0),  # a vocabulary that is not whole tiles
    (2048, 576, 700, 1.0),  # SmolLM2's hidden size; more rows than a product takes at once
    (300, 48, 20, 0.5),  # a hidden size in blocks of 48; a scaled output layer (Granite's, Cohere's)
    (256, 32, 1, 2.0),  # one row
])
def test_the_kernel_computes_the_loss_and_its_gradient(kernels, vocabulary, hidden, rows, scale):
    """The summed loss is float32's within float32's rounding (its logits are float32 sums, not
    bf16's), and the gradient no further from float32's than the bf16 matmul's; the inputs
    are left as they were."""
    states, weight, targets = case(vocabulary, hidden, rows)
    given = [t.clone() for t in (states, weight, targets)]
    x = states.clone().requires_grad_()
    loss = cpu_token_loss.token_loss(x, weight, targets, scale)
    loss.backward()
    exact, exact_grad = float32_loss(states, weight, targets, scale)
    _, plain_grad = bf16_loss(states, weight, targets, scale)
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and x.grad.shape == states.shape
    assert abs(loss.item() - exact.item()) <= 1e-5 * abs(exact.item()), (loss.item(), exact.item())
    ours = (x.grad.float() - exact_grad).norm() / exact_grad.norm()
    theirs = (plain_grad.float() - exact_grad).norm() / exact_grad.norm()
    assert ours <= max(1.2 * theirs, 4e-3), (ours.item(), theirs.item())
    assert all(torch.equal(a, b) for a, b in zip((states, weight, targets), given))


def test_the_same_inputs_give_the_same_bits_on_any_number_of_threads(kernels):
    """The vocabulary's parts are as many whatever the threads, each merged in one order: the
    same call gives the same loss and gradient to the bit on 1, 2 and 3 threads (what a resumed
    run, and the ranks of a run whose processes have different numbers of threads, rely on)."""
    states, weight, targets = case(3000, 64, 300)

    def loss_and_grad():
        x = states.clone().requires_grad_()
        loss = cpu_token_loss.token_loss(x, weight, targets, 1.0)
        loss.backward()
        return loss.detach(), x.grad

    runs = on_threads((1, 2, 3, 2), loss_and_grad)
    assert all(torch.equal(runs[0][0], loss) and torch.equal(runs[0][1], grad) for loss, grad in runs[1:])


def test_a_changed_weight_is_packed_again(kernels):
    """The packed weight is kept while the weight is unchanged; a weight written in place (a
    new version) or another weight gives its own loss, never the stale one's."""
    states, weight, targets = case(500, 64, 40)
    before = cpu_token_loss.token_loss(states, weight, targets, 1.0)
    with torch.no_grad():
        weight.mul_(2)
    after = cpu_token_loss.token_loss(states, weight, targets, 1.0)
    assert abs(after.item() - float32_loss(states, weight, targets, 1.0)[0].item()) <= 1e-5 * after.item()
    assert after.item() != before.item()
    other = case(500, 64, 40, seed=1)[1]
    assert abs(cpu_token_loss.token_loss(states, other, targets, 1.0).item()
               - float32_loss(states, other, targets, 1.0)[0].item()) <= 1e-5 * after.item()


def test_token_loss_takes_the_kernel_for_a_frozen_bf16_output_layer_only(kernels, monkeypatch):
    """`TokenLoss` sends a frozen bf16 output layer's loss to the kernel (same value as the
    kernel's own); a trained output layer (full fine-tune: its weight needs a gradient), a
    bias, a soft cap or float32 states go the plain way, and the weight gets its gradient."""
    states, weight, targets = case(700, 64, 30)
    labels = torch.cat([torch.tensor([-100]), targets]).unsqueeze(0)  # position t predicts labels[t + 1]
    hidden = torch.cat([states, states[:1]]).unsqueeze(0)
    head = torch.nn.Linear(64, 700, bias=False).bfloat16()
    with torch.no_grad():
        head.weight.copy_(weight)
    head.weight.requires_grad_(False)
    loss = TokenLoss()
    assert loss.on_kernel(head)
    calls = []
    real = cpu_token_loss.token_loss
    monkeypatch.setattr(cpu_token_loss, "token_loss", lambda *a: calls.append(1) or real(*a))
    kernel = loss.of(hidden, head, labels)
    assert calls == [1]
    assert torch.equal(kernel, real(states, weight, targets, 1.0))
    assert not TokenLoss(softcap=30.0).on_kernel(head)
    head.weight.requires_grad_(True)  # a full fine-tune's output layer
    assert not loss.on_kernel(head)
    plain = loss.of(hidden, head, labels)
    plain.backward()
    assert calls == [1] and head.weight.grad is not None
    assert abs(plain.item() - kernel.item()) <= 0.01 * kernel.item()  # bf16 logits against float32 ones
    head.weight.requires_grad_(False)
    loss.of(hidden.float(), head.float(), labels)
    assert calls == [1]
    biased = torch.nn.Linear(64, 700).bfloat16().requires_grad_(False)
    assert not loss.on_kernel(biased)
    # an adapter on the output layer: its gradient is needed
    wrapped = get_peft_model(torch.nn.Sequential(head.bfloat16()), LoraConfig(r=2, target_modules=["0"]))
    adapted = wrapped.base_model.model[0]
    assert not adapted.weight.requires_grad and not loss.on_kernel(adapted)
