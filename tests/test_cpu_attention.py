"""The built-in trainer's causal attention for bf16 training on the CPU: sdpa's forward,
its own backward (overbrainer/trainers/builtin/cpu_attention.py). Its gradients against
sdpa's, in float32 (the same math) and bf16 (no less accurate), and where the trainer
takes it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import can_build_the_kernel, needs_cpp_compiler, on_threads

from overbrainer.trainers.builtin import cpu_attention, cpu_kernels
from overbrainer.trainers.builtin.cpu_attention import causal_attention


def inputs(batch, heads, kv_heads, length, dim=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim),
              (batch, heads, length, dim)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def forward_backward(attend, q, k, v, grad):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attend(q, k, v)
    out.backward(grad)
    return [out, q.grad, k.grad, v.grad]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def ours(q, k, v):
    return causal_attention(q, k, v, q.shape[-1] ** -0.5).transpose(1, 2)


@pytest.mark.parametrize("shared_in_kernel", [True, False], ids=["torch-gqa", "repeated-heads"])
@pytest.mark.parametrize("heads,kv_heads,length", [(9, 3, 37), (9, 3, 64), (4, 4, 130), (4, 2, 200), (2, 1, 2)])
def test_float32_gradients_are_sdpas(heads, kv_heads, length, shared_in_kernel, monkeypatch):
    """The same math as sdpa in float32: output and the three gradients, for lengths that
    are and are not a multiple of the block, with key heads shared (GQA) and not; and with
    the key heads repeated for the forward, as on a torch whose CPU flash kernel lacks GQA."""
    if shared_in_kernel and not cpu_attention.KEY_HEADS_SHARED:
        pytest.skip("this torch's CPU flash kernel does not share key heads")
    monkeypatch.setattr(cpu_attention, "KEY_HEADS_SHARED", shared_in_kernel)
    x = inputs(2, heads, kv_heads, length)
    given = [t.clone() for t in x]
    for name, a, b in zip(("out", "dq", "dk", "dv"), forward_backward(ours, *x), forward_backward(sdpa, *x)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (name, (a - b).abs().max().item())
    assert all(torch.equal(a, b) for a, b in zip(x, given))  # nothing written into the inputs


@pytest.fixture(params=["kernel", "blocked"])
def backward(request, monkeypatch):
    """The backward under test: the built kernel (where this machine builds and runs it) or the
    Python one it falls back to."""
    if request.param == "kernel":
        if cpu_kernels.ops() is None:
            pytest.skip("the CPU kernels do not run here (no bf16 brgemm, or no C++ compiler)")
    else:
        monkeypatch.setattr(cpu_kernels, "_OPS", None)
    return request.param


@pytest.mark.parametrize("batch,heads,kv_heads,length,dim", [
    (2, 9, 3, 37, 64), (2, 4, 4, 130, 64), (2, 4, 2, 200, 32), (2, 2, 1, 2, 64), (2, 8, 2, 100, 128),
    (2, 4, 2, 70, 80), (2, 4, 4, 90, 96), (2, 2, 1, 65, 256),
    # fewer sequences × key heads than threads, or not a multiple of them: keys cut into parts
    (1, 9, 3, 200, 64), (1, 2, 1, 300, 64)])
def test_the_kernel_computes_the_blocked_backward(batch, heads, kv_heads, length, dim):
    """Where it is built, the kernel's gradients are the Python backward's within bf16's rounding
    (both from sdpa's bf16 forward), for lengths and row counts that are and are not whole
    tiles, shared and unshared key heads, and head sizes 32 to 256 (80 and 96 in blocks of 16
    and 48 columns); and it is built and used wherever a C++ compiler and a bf16 brgemm are at
    hand."""
    op = cpu_attention.kernel_for(dim)
    if op is None:
        assert not can_build_the_kernel(), "a C++ compiler and a bf16 brgemm, yet no kernel"
        pytest.skip("the CPU attention kernel does not run here")
    q, k, v, g = (t.bfloat16() for t in inputs(batch, heads, kv_heads, length, dim=dim))
    scale = dim ** -0.5
    out, lse = cpu_attention._attend(q, k, v, scale)
    given = [t.clone() for t in (q, k, v, out, lse, g)]
    args = (q, k, v, out.transpose(1, 2), lse, g, scale)
    for name, a, b in zip(("dq", "dk", "dv"), cpu_attention.kernel_backward(op, *args),
                          cpu_attention.blocked_backward(*args)):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16, name
        assert a.is_contiguous(), name  # as the operator's fake says: compiled callers check it
        assert torch.allclose(a.float(), b.float(), rtol=0.05, atol=0.02 * float(b.abs().max())), (
            name, (a.float() - b.float()).abs().max().item())
        assert (a.float() - b.float()).norm() <= 0.02 * b.float().norm(), name
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, out, lse, g), given))  # nothing written into the inputs
    # past the Python backward's longest, the kernel's heads still come here (not to sdpa)
    long = [t.bfloat16() for t in inputs(1, heads, kv_heads, cpu_attention.LONGEST + 1, dim=dim)[:3]]
    with torch.enable_grad():
        assert cpu_attention.applies(None, *long, None, 0.0, True, {})


@pytest.mark.parametrize("batch,heads,kv_heads,length,dim", [
    (2, 9, 3, 37, 64), (4, 9, 3, 300, 64), (1, 9, 3, 700, 64), (2, 4, 4, 65, 16), (1, 4, 2, 130, 128),
    (2, 4, 2, 70, 80), (1, 2, 1, 90, 256), (2, 2, 1, 1, 64)])
def test_the_forward_kernel_computes_sdpa_s_forward(batch, heads, kv_heads, length, dim):
    """Where it is built, the forward kernel's output is as close to float32's as sdpa's CPU
    flash kernel's, and its log-sum-exp is sdpa's within float32's rounding, for inputs laid out
    as the model's projections give them (viewed (B, T, H, D) and transposed: strided), lengths
    that are and are not whole tiles or chunks, shared and unshared key heads, and head sizes
    16 to 256; the output is laid out (B, T, H, D), densely, as the operator's fake says."""
    forward = cpu_attention.kernel_forward(dim)
    if forward is None:
        assert not can_build_the_kernel(), "a C++ compiler and a bf16 brgemm, yet no kernel"
        pytest.skip("the CPU kernels do not run here")
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(batch, length, h, dim, generator=g).transpose(1, 2) for h in (heads, kv_heads, kv_heads))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    scale = dim ** -0.5
    theirs, their_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb, kb.repeat_interleave(heads // kv_heads, 1), vb.repeat_interleave(heads // kv_heads, 1), 0.0, True,
        attn_mask=None, scale=scale)
    ours, lse = forward(qb, kb, vb, scale)
    assert ours.shape == (batch, length, heads, dim) and ours.dtype == torch.bfloat16 and ours.is_contiguous()
    assert lse.shape == (batch, heads, length) and lse.dtype == torch.float32 and lse.is_contiguous()
    error = (ours.float() - exact).norm() / exact.norm()
    assert error <= 1.1 * (theirs.transpose(1, 2).float() - exact).norm() / exact.norm() + 1e-4, error
    assert torch.allclose(lse, their_lse, atol=2e-4), (lse - their_lse).abs().max()
    assert torch.equal(ours, forward(qb, kb, vb, scale)[0])  # the same bits again
    assert torch.equal(cpu_attention._attend(qb, kb, vb, scale)[0], ours)  # what the trainer's operator returns


@pytest.mark.parametrize("batch,kv_heads", [(1, 3), (4, 3)])
def test_the_kernels_give_the_same_bits_on_any_number_of_threads(batch, kv_heads):
    """How the kernels cut their work (the backward's parts of each task's keys, with one
    sequence) follows the shapes, never the threads: forward and backward give the same bits on
    1, 2 and 3 threads (the ranks of a run may have different numbers of threads, and a run
    resumed elsewhere too)."""
    op = cpu_attention.kernel_for(64)
    if op is None:
        pytest.skip("the CPU kernels do not run here")
    q, k, v, g = (t.bfloat16() for t in inputs(batch, 3 * kv_heads, kv_heads, 300))
    scale = 0.125

    def both():
        out, lse = cpu_attention.kernel_forward(64)(q, k, v, scale)
        return out, lse, *op(q, k, v, out.transpose(1, 2), lse, g, scale)

    runs = on_threads((1, 2, 3), both)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def test_a_build_killed_half_way_is_taken_up_by_the_next(tmp_path):
    """SIGKILL while the kernel builds (a user's Ctrl-C at a model's first load) leaves torch's
    build lock behind; the next process to want the kernel builds it all the same, instead of
    waiting forever on that lock."""
    import signal
    import subprocess
    import sys
    import time

    if not can_build_the_kernel():
        pytest.skip("the kernel is never built here")
    env = {**os.environ, cpu_kernels.KERNELS_ENV: str(tmp_path / "kernels")}
    code = "from overbrainer.trainers.builtin import cpu_kernels as c; print(c.ops() is not None)"
    first = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "kernels").glob("*/lock")):
        assert first.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert list((tmp_path / "kernels").glob("*/lock"))  # torch's lock, left behind
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout.strip() == "True", second.stderr[-2000:]


def test_without_a_working_compiler_it_says_so_and_falls_back(tmp_path, monkeypatch, capfd):
    """A build that fails (here a compiler that fails every time, in an empty kernels folder)
    is one line on stderr, and the Python backward computes the gradients; so does
    OVERBRAINER_CPU_KERNEL=0, without a word."""
    if not can_build_the_kernel():
        pytest.skip("the kernel is never built here")
    monkeypatch.setattr(cpu_kernels, "_OPS", False)
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert cpu_kernels.ops() is None
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(cpu_kernels, "_OPS", False)
    monkeypatch.delenv(cpu_kernels.ENV)
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, str(tmp_path / "kernels"))
    # inductor reads $CXX once, when its config is first imported: read before CXX is
    # replaced, or every later compilation in this process would fail (`-k compile` ran
    # this test first and broke the compiled-layers test after it)
    import torch._inductor.config  # noqa: F401

    monkeypatch.setenv("CXX", "false")
    assert cpu_kernels.ops() is None
    said = [line for line in capfd.readouterr().err.splitlines() if "kernel" in line]
    assert said[-1].startswith("the CPU kernels were not built (") and said[-1].endswith(
        "the slower plain paths are used"), said
    x = inputs(2, 4, 2, 40)
    for a, b in zip(forward_backward(ours, *(t.bfloat16() for t in x)), forward_backward(sdpa, *x)):
        assert (a.float() - b).norm() <= 0.02 * b.norm()


@pytest.mark.parametrize("length", [64, 200, 512])
def test_bf16_gradients_are_as_close_to_float32_as_sdpas(length, backward):
    """In bf16 no further from the float32 result than sdpa's own bf16 kernels are (the
    kernel's backward and the Python one)."""
    x = inputs(4, 9, 3, length)
    exact = forward_backward(sdpa, *x)
    low = [t.bfloat16() for t in x]
    theirs, mine = forward_backward(sdpa, *low), forward_backward(ours, *low)
    for name, e, t, m in zip(("out", "dq", "dk", "dv"), exact, theirs, mine):
        assert m.dtype == torch.bfloat16, name
        their_error, my_error = (t.float() - e).abs().max().item(), (m.float() - e).abs().max().item()
        assert my_error <= 1.25 * their_error + 1e-3, (name, my_error, their_error)


def test_it_leaves_to_sdpa_what_its_kernel_does_not_compute():
    """applies(): a value head size other than the key's (DeepSeek's latent attention), a
    last dimension that is not contiguous (the flash kernel reads it as if it were),
    attention sinks, a mask, float32 or no gradient go to sdpa."""
    q, k, v, _ = inputs(1, 4, 2, 16, dtype=torch.bfloat16)

    def takes(query=q, key=k, value=v, mask=None, **kwargs):
        with torch.enable_grad():
            return cpu_attention.applies(None, query, key, value, mask, 0.0, True, kwargs)

    assert takes()
    assert not takes(value=torch.cat([v, v], dim=-1))
    assert not takes(query=q.transpose(-1, -2).contiguous().transpose(-1, -2))
    assert not takes(s_aux=torch.zeros(4))
    assert not takes(sinks=torch.zeros(4))
    assert not takes(mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))
    assert not takes(query=q.float(), key=k.float(), value=v.float())
    assert not takes(key=k[:, :, :8], value=v[:, :, :8])  # decoding against a cache
    with torch.no_grad():
        assert not cpu_attention.applies(None, q, k, v, None, 0.0, True, {})


def test_the_trainer_takes_it_for_bf16_training_on_the_cpu_only(tiny_model, tmp_path, monkeypatch):
    """load_model: bf16 on the CPU names it as the model's attention, float32 keeps sdpa. A
    training forward goes through it once a layer; evaluation (no grad) and a batch longer
    than it takes go to sdpa; and nothing of it reaches a saved model's config.json."""
    from overbrainer.trainers.builtin.model import Decoder, TokenLoss, load_model

    cfg = {"base_model": str(tiny_model), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
           "lora_target_modules": ["q_proj", "v_proj"]}
    cpu = torch.device("cpu")
    plain, _ = load_model(cfg, cpu, bf16=False)
    assert plain.config._attn_implementation == "sdpa"
    model, tokenizer = load_model(cfg, cpu, bf16=True)
    assert model.config._attn_implementation == cpu_attention.NAME

    calls = []
    attend = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(a[0].shape) or attend(*a))
    layers = model.config.num_hidden_layers

    def batch(length):
        ids = torch.randint(5, len(tokenizer) - 5, (2, length), generator=torch.Generator().manual_seed(length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    decoder, loss = Decoder(model), TokenLoss(mask=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(decoder, batch(40))
    value.backward()
    assert len(calls) == layers and all(s[2] == 40 for s in calls), calls
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss(decoder, batch(40))
        loss(decoder, batch(cpu_attention.LONGEST + 1))
    assert calls == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss(decoder, batch(cpu_attention.LONGEST + 1)).backward()
    assert calls == []

    model.get_base_model().save_pretrained(tmp_path / "saved")
    assert cpu_attention.NAME not in (tmp_path / "saved" / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "saved" / "config.json").read_text())


@pytest.mark.parametrize("head_dim", [8, 16])
def test_compiled_layers_call_it_at_every_length_without_recompiling(tiny_model, tmp_path, head_dim):
    """train.compile: the compiled decoder layers call it as an operator of their own, so a
    new length is not a new compilation (traced, its backward's loop over blocks tied each
    compiled layer to one length, and past dynamo's recompile limit the layers ran eagerly,
    silently). The loss is compiled too (with an adapter on the output layer, which its
    gradient reaches); loss and gradients are the eager ones, within bf16's rounding. Heads
    of 8 take the Python backward, heads of 16 the kernel where it runs (its outputs' layouts
    are what the compiled graph checks)."""
    from tiny import make_tiny_llama
    from torch._dynamo.utils import counters

    from overbrainer.trainers.builtin.model import Decoder, TokenLoss, load_model

    needs_cpp_compiler()
    base = tiny_model if head_dim == 8 else make_tiny_llama(tmp_path / "wide", hidden=4 * head_dim)

    cfg = {"base_model": str(base), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
           "lora_target_modules": ["q_proj", "v_proj", "lm_head"]}
    cpu = torch.device("cpu")

    def train(model, token_loss, length):
        ids = torch.randint(5, 200, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = Decoder(model, token_loss)(ids, None, ids.clone())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        return loss.detach(), grads

    torch.manual_seed(0)
    eager, _ = load_model(cfg, cpu, bf16=True)
    torch.manual_seed(0)  # the same adapter
    compiled, _ = load_model({**cfg, "torch_compile": True}, cpu, bf16=True)
    plain, compiled_loss = TokenLoss(mask=False), TokenLoss(mask=False, compiled=True)
    assert compiled.config._attn_implementation == cpu_attention.NAME
    torch._dynamo.reset()
    counters.clear()
    seen = []
    for length in (24, 37, 61, 90):
        (a, a_grads), (b, b_grads) = train(eager, plain, length), train(compiled, compiled_loss, length)
        assert torch.allclose(a, b, rtol=2e-2), (length, a, b)
        for x, y in zip(a_grads, b_grads):
            assert torch.allclose(x, y, rtol=5e-2, atol=5e-2 * float(x.abs().max())), length
        seen.append(counters["stats"]["unique_graphs"])
    # the loss; the first layer's input needs no gradient and the others' do: three graphs,
    # then none
    assert seen[0] <= 3 and seen[-1] == seen[0], seen
    assert any(n.endswith("lm_head.lora_A.default.weight") for n, p in compiled.named_parameters() if p.requires_grad)
