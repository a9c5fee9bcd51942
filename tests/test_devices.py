"""The built-in trainer's device settings on the CPU: train.device, deterministic, gradient
checkpointing, QLoRA (bitsandbytes' CPU backend), and hardware the machine lacks refused
before anything is written. What needs a GPU is in test_gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import bake_json, cli, make_project, needs_cpp_compiler
from test_distributed import metric_lines
from test_resume import kill_bake_at

from overbrainer.errors import PlanError
from overbrainer.inputs.sizing import GiB, Shape, estimate
from overbrainer.plan import TrainSettings

FINAL = "checkpoints/step-000008"


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def meta(folder: Path) -> dict:
    return json.loads((folder / FINAL / "meta.json").read_text())


@pytest.mark.skipif("cuda_here()", reason="on a GPU machine auto is cuda")
def test_device_cpu_given_and_deterministic_change_nothing_on_cpu(project, references):
    """device "cpu" named, deterministic kernels on: the same bits as the default (auto is
    the CPU here), and the device in the checkpoint's sidecar and in run.json."""
    reference = references.folder()
    project.write(device="cpu", deterministic=True)
    report = bake_json(str(project.plan_path))
    folder = Path(report["folder"])
    assert "8 steps of 2x2 on cpu" in (folder / "log.txt").read_text()
    assert meta(folder)["device"] == "cpu" and meta(reference)["device"] == "cpu"
    assert json.loads((folder / "run.json").read_text())["device"] == "cpu"
    final = "checkpoints/step-000008/adapter_model.safetensors"
    assert (folder / final).read_bytes() == (reference / final).read_bytes()


KEPT_AFTER_A_FREE = """
import sys, psutil, torch
from overbrainer.trainers.builtin.device import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
rss = lambda: psutil.Process().memory_info().rss
x = torch.ones(50 * 2**20)  # 200 MB
before = rss()
del x
print(kept, (before - rss()) >> 20)
"""


@pytest.mark.skipif("not glibc_here()", reason="glibc's allocator only")
def test_freed_memory_is_kept_for_the_next_step_on_the_cpu():
    """A 200 MB tensor freed: with the trainer's allocator settings its pages stay with the
    process for the next step to reuse (glibc's default hands them back to the kernel, and
    the next step faults them in again, page by page); a user's own MALLOC_* setting wins."""
    import os
    import subprocess
    import sys

    def run(mode, **env):
        out = subprocess.run([sys.executable, "-c", KEPT_AFTER_A_FREE, mode], capture_output=True, text=True,
                             env={**{k: v for k, v in os.environ.items()
                                  if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}, **env},
                             check=True)
        kept, returned_mb = out.stdout.split()
        return kept == "True", int(returned_mb)

    kept, returned_kept = run("keep")
    plain, returned_plain = run("plain")
    assert kept and not plain
    assert returned_kept < 10 and returned_plain > 190
    assert run("keep", MALLOC_TRIM_THRESHOLD_="131072")[0] is False


def glibc_here() -> bool:
    import platform

    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif("cuda_here() or not glibc_here()", reason="the CPU's allocator settings")
def test_the_allocator_settings_change_no_bit(project, references):
    """The same bake with glibc's defaults (a MALLOC_ variable set: the trainer leaves the
    allocator alone) as with the trainer's own choice (tcmalloc where it is installed, else
    glibc keeping freed memory): the same adapter, bit for bit; the log names tcmalloc."""
    from overbrainer.trainers.builtin import allocator

    reference = references.folder()
    said = "host memory from tcmalloc" in (reference / "log.txt").read_text()
    assert said == (allocator.to_preload("auto") is not None)
    report = bake_json(str(project.plan_path), env={"MALLOC_ARENA_MAX": "8"})
    assert "tcmalloc" not in (Path(report["folder"]) / "log.txt").read_text()
    final = "checkpoints/step-000008/adapter_model.safetensors"
    assert (Path(report["folder"]) / final).read_bytes() == (reference / final).read_bytes()


def allocator_left_alone() -> dict:
    """This environment without the allocator choices a user could have made (a preload,
    glibc's knobs, OVERBRAINER_MALLOC): what the trainer decides for itself from."""
    import os

    from overbrainer.trainers.builtin import allocator

    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", allocator.ENV)}


RESTARTED = """
import os, sys
from overbrainer.trainers.builtin import allocator
print("pid", os.getpid(), file=sys.stderr, flush=True)  # before the restart, and again after it
allocator.restart_with_tcmalloc(sys.argv[1])
print(os.getpid(), allocator.in_use(), "libtcmalloc" in open("/proc/self/maps").read())
"""


@pytest.mark.skipif("not glibc_here()", reason="glibc's Linux only")
def test_the_trainer_starts_itself_again_with_tcmalloc_on_the_cpu():
    """Where tcmalloc is installed, the trainer's process on the CPU starts itself again with
    it preloaded, as the same process (the supervisor and torchrun watch its id), before torch
    loads; not on a GPU, nor where the user chose (an LD_PRELOAD, glibc's MALLOC_ variables,
    OVERBRAINER_MALLOC=glibc)."""
    from overbrainer.trainers.builtin import allocator

    if allocator.tcmalloc() is None:
        pytest.skip("tcmalloc is not installed here (Debian's libtcmalloc-minimal4; .ci/run installs it)")
    clean = allocator_left_alone()

    def run(device, **env):
        out = subprocess.run([sys.executable, "-c", RESTARTED, device], capture_output=True, text=True,
                             env={**clean, **env}, check=True)
        starts = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("pid ")]
        return out.stdout.split(), starts

    (pid, used, mapped), starts = run("cpu")
    assert (used, mapped) == ("tcmalloc", "True")
    assert starts == [pid, pid]  # one process, started twice
    assert run("auto")[0][1] == ("tcmalloc" if allocator.computes_on_the_cpu("auto") else "None")
    assert run("auto", CUDA_VISIBLE_DEVICES="")[0][1] == "tcmalloc"  # every GPU hidden: the CPU
    for device, env in (("cuda", {}), ("cpu", {"OVERBRAINER_MALLOC": "glibc"}), ("cpu", {"MALLOC_ARENA_MAX": "8"})):
        (_, used, mapped), starts = run(device, **env)
        assert (used, mapped) == ("None", "False") and len(starts) == 1, (device, env)
    # the user's own preload: kept as it is, not started again
    (_, used, mapped), starts = run("cpu", LD_PRELOAD=allocator.tcmalloc())
    assert (used, mapped) == ("tcmalloc", "True") and len(starts) == 1


DESCRIBED = """
import sys
from overbrainer.trainers.builtin import allocator
if sys.argv[1] == "restart":
    allocator.restart_with_tcmalloc("cpu")
print(allocator.described(allocator.tcmalloc() if sys.argv[2] == "looked-up" else None))
"""


@pytest.mark.skipif("not glibc_here()", reason="glibc's Linux only")
def test_the_log_says_where_to_get_tcmalloc_where_it_is_missing():
    """A CPU run's log names its allocator: tcmalloc where the process runs on it; where none
    is installed (`described(None)`: what `tcmalloc()` returns then), the packages that have
    it; no advice where the user chose the allocator."""
    from overbrainer.trainers.builtin import allocator

    clean = allocator_left_alone()

    def said(restart, installed, **env):
        return subprocess.run([sys.executable, "-c", DESCRIBED, restart, installed], capture_output=True,
                              text=True, env={**clean, **env}, check=True).stdout.strip()

    advice = said("stay", "missing")
    assert advice.startswith(", host memory from glibc's malloc") and "libtcmalloc-minimal4" in advice
    assert "gperftools" in advice
    assert said("stay", "missing", OVERBRAINER_MALLOC="glibc") == ""
    assert said("stay", "missing", MALLOC_ARENA_MAX="8") == ""
    # as the trainer runs: restarted onto tcmalloc where it is installed, else told where to get it
    expected = ", host memory from tcmalloc" if allocator.tcmalloc() else advice
    assert said("restart", "looked-up") == expected


def test_gradient_checkpointing_gives_the_same_losses(references):
    plain = references.folder(lora_dropout=0.0)
    checkpointed = references.folder(lora_dropout=0.0, gradient_checkpointing=True)
    for a, b in zip(metric_lines(plain), metric_lines(checkpointed), strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert (b.get("eval_loss") is None) == (a.get("eval_loss") is None)


def test_padding_to_a_multiple_changes_no_loss(references):
    """train.pad_to_multiple_of pads each micro-batch further (pads come after every real
    token, under a causal mask): the same tokens, the same losses within float32's rounding,
    and the multiple in each checkpoint's sidecar ("auto" is 1 in float32 on the CPU)."""
    plain = references.folder(lora_dropout=0.0, bf16=False)
    padded = references.folder(lora_dropout=0.0, bf16=False, pad_to_multiple_of=16)
    for a, b in zip(metric_lines(plain), metric_lines(padded), strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert (b.get("eval_loss") is None) == (a.get("eval_loss") is None)
        if a.get("eval_loss") is not None:
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5, abs=1e-6)
    assert any(m.get("eval_loss") is not None for m in metric_lines(padded))
    assert meta(plain)["pad_to_multiple_of"] == 1 and meta(padded)["pad_to_multiple_of"] == 16


def test_a_micro_batch_is_padded_to_the_multiple_within_sequence_len():
    """collate: the longest row's length rounded up to the multiple, but not past
    sequence_len when the longest is within it; pads carry no label and no mask."""
    import torch

    from overbrainer.trainers.builtin import device as hw
    from overbrainer.trainers.examples import IGNORE, collate

    def rows(*lengths):
        return [SimpleNamespace(ids=[7] * n, labels=[3] * n) for n in lengths]

    def width(lengths, multiple, limit=512):
        return collate(rows(*lengths), 0, multiple, limit)["input_ids"].shape[1]

    assert width((13, 5), 1) == 13 and width((13, 5), 8) == 16 and width((16, 2), 8) == 16
    assert width((509,), 8, limit=510) == 510 and width((505,), 8, limit=510) == 510
    assert width((501,), 8, limit=510) == 504 and width((13,), 64) == 64
    batch = collate(rows(13, 5), 0, 8, 512)
    assert batch["attention_mask"].sum().item() == 18
    assert (batch["labels"][0, 13:] == IGNORE).all() and (batch["input_ids"][1, 5:] == 0).all()
    # "auto": 8 where bf16 matmuls run on the CPU (oneDNN prepares each new shape), else 1
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert hw.pad_multiple({}, cpu, bf16=True) == 8
    assert hw.pad_multiple({"pad_to_multiple_of": "auto"}, cpu, bf16=False) == 1
    assert hw.pad_multiple({}, gpu, bf16=True) == 1
    assert hw.pad_multiple({"pad_to_multiple_of": 4}, gpu, bf16=True) == 4


def test_pad_to_multiple_of_is_the_built_in_trainers(project):
    """Axolotl pads to a multiple of 64 itself: a multiple in a plan for it is refused in
    one line, before anything is written; "auto" puts no key in config.yaml."""
    from overbrainer.steps.config import build_config

    steps = {"max_steps": 8, "warmup": 1, "stable": 5, "decay": 2}
    assert "pad_to_multiple_of" not in build_config(TrainSettings(), "../base", steps, {})
    assert build_config(TrainSettings(pad_to_multiple_of=8), "../base", steps, {})["pad_to_multiple_of"] == 8
    project.write(trainer="axolotl", pad_to_multiple_of=8)
    out = cli("bake", str(project.plan_path), check=None)
    assert out.returncode == 2, out
    line = out.stderr.strip().splitlines()[-1]
    assert "train.pad_to_multiple_of is the built-in trainer's" in line and "set train.trainer to builtin" in line
    assert "Traceback" not in out.stderr


def test_the_dropped_attention_mask_is_exact_where_loss_is_taken(tiny_model):
    """The built-in trainer gives the model no attention mask (sdpa's flash kernel takes
    none): with right padding under a causal mask a real token never sees a pad, so the
    loss and every gradient are those of the masked model, on a batch of very unequal rows."""
    import torch

    from overbrainer.trainers.builtin.model import Decoder, TokenLoss, load_model
    from overbrainer.trainers.examples import collate

    cfg = {"base_model": str(tiny_model), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
           "lora_target_modules": ["q_proj", "v_proj"]}
    torch.manual_seed(0)
    model, _ = load_model(cfg, torch.device("cpu"), bf16=False)
    with torch.no_grad():  # a random tiny model barely looks at other tokens: make attention count
        for name, p in model.named_parameters():
            if "o_proj" in name:
                p.mul_(50)
    rows = [SimpleNamespace(ids=list(range(5, 5 + n)), labels=[-100] * (n // 2) + list(range(5 + n // 2, 5 + n)))
            for n in (7, 31, 18)]
    batch = collate(rows, pad_id=0)
    assert (batch["attention_mask"] == 0).sum() > 30  # much padding

    def loss_and_grads(batch, mask):
        model.zero_grad(set_to_none=True)
        loss = TokenLoss(mask=mask)(Decoder(model), batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    (masked, masked_grads), (unmasked, unmasked_grads) = loss_and_grads(batch, True), loss_and_grads(batch, False)
    assert torch.allclose(masked, unmasked, rtol=1e-6, atol=1e-6)
    for a, b in zip(masked_grads, unmasked_grads):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), ((a - b).abs().max(), a.abs().max())
    # the control: pads on the left are seen without the mask, and the loss says so
    left = {k: v.flip(1) for k, v in batch.items()}
    assert not torch.allclose(loss_and_grads(left, True)[0], loss_and_grads(left, False)[0], rtol=1e-5)


def test_the_model_is_readied_for_where_it_computes(tiny_model, monkeypatch):
    """`load_model` readies the model for the device it will train on, which under
    train.shard is not where it is loaded (host memory, FSDP2 moving each rank's slices to
    the GPU): the CPU's attention only for a model that computes on the CPU. And config.yaml's
    `torch_compile: auto` compiles nothing there: the trainer settles it for the device first
    (a probe loading a GPU run's config.yaml compiled every layer)."""
    import torch

    from overbrainer.trainers.builtin import cpu_attention
    from overbrainer.trainers.builtin.model import decoder_layers, load_model, transformers_model

    monkeypatch.setenv("OVERBRAINER_CPU_KERNEL", "0")  # the attention's switch alone, no kernel build
    cfg = {"base_model": str(tiny_model), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
           "lora_target_modules": ["q_proj", "v_proj"]}
    cpu = torch.device("cpu")

    def attention(model):
        return transformers_model(model).config._attn_implementation

    assert attention(load_model(cfg, cpu, bf16=True)[0]) == cpu_attention.NAME
    assert attention(load_model(cfg, cpu, bf16=True, computes_on=torch.device("cuda", 0))[0]) == "sdpa"
    assert attention(load_model(cfg, cpu, bf16=False)[0]) == "sdpa"

    def compiled(setting) -> list[bool]:
        model, _ = load_model({**cfg, "torch_compile": setting}, cpu, bf16=False)
        return [getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model)]

    assert not any(compiled("auto")) and not any(compiled(False))
    on = compiled(True)
    assert on and all(on)


@pytest.mark.parametrize("train, says", [
    pytest.param({"device": "cuda"}, 'train.device: "cuda", but torch sees no CUDA GPU here', id="cuda"),
    pytest.param({"liger": True}, "train.liger: Liger Kernel runs on a CUDA GPU only", id="liger"),
])
def test_hardware_the_machine_lacks_is_one_line_before_anything_is_written(project, tmp_path, train, says):
    if cuda_here():
        pytest.skip("this machine has a GPU")
    project.write(**train)
    proc = cli("bake", str(project.plan_path), "--runs", str(tmp_path / "runs"), check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    written = {p.name for p in (tmp_path / "runs" / "tiny").iterdir() if not p.name.startswith(".")}
    assert "examples.parquet" not in written and "config.yaml" not in written and "plan.json" in written


def test_qlora_trains_merges_and_resumes_on_cpu(tmp_path):
    """NF4 base + LoRA through bitsandbytes' CPU backend: trained, merged into a 16-bit
    model, and a SIGKILL in the middle resumes to the same bits."""
    pytest.importorskip("bitsandbytes")
    from tiny import make_tiny_llama

    # bitsandbytes quantizes in blocks of 64 weights: a row must hold one at least
    base = make_tiny_llama(tmp_path / "tiny64", hidden=64)
    project = make_project(tmp_path / "project", base)
    project.write(adapter="qlora", lora_dropout=0.0)
    done = Path(bake_json(str(project.plan_path), "--runs", str(tmp_path / "runs"))["folder"])
    assert meta(done)["adapter"] == "qlora"
    lines = metric_lines(done)
    assert lines[-1]["eval_loss"] < lines[3]["eval_loss"]  # it learns
    from safetensors import safe_open

    with safe_open(done / "merged" / "model.safetensors", "pt") as f, \
            safe_open(base / "model.safetensors", "pt") as b:
        name = next(k for k in f.keys() if "q_proj" in k)
        merged, original = f.get_tensor(name), b.get_tensor(name)
    assert str(merged.dtype) == "torch.bfloat16"
    assert not (merged.float() - original.bfloat16().float()).abs().max() == 0  # the adapter is in it

    killed = tmp_path / "killed"
    kill_bake_at(killed, project.plan_path, 5)
    again = Path(bake_json(str(project.plan_path), "--runs", str(killed))["folder"])
    assert "resuming from step-000003" in (again / "log.txt").read_text()
    final = f"{FINAL}/adapter_model.safetensors"
    assert (again / final).read_bytes() == (done / final).read_bytes()


def test_how_it_computes_is_not_what_it_trains(baked_copy):
    """Gradient checkpointing or another device changes how the steps are computed, not
    the run: a finished bake stays done (config.yaml is rewritten, nothing retrains)."""
    project = baked_copy()
    folder = project.root.parent / "runs" / "tiny"
    assert "liger" not in (folder / "config.yaml").read_text()  # train.liger "auto", the default
    project.write(gradient_checkpointing=True, device="cpu", deterministic=True, liger=False)
    report = bake_json(str(project.plan_path))
    assert "config" in report["ran"] and "train" not in report["ran"], report
    config = (Path(report["folder"]) / "config.yaml").read_text()
    assert "gradient_checkpointing: true" in config and "liger: false" in config


# what a plan with every train setting at its default trains on: the keys config.yaml gives the
# train step's fingerprint (steps/train.py leaves out how it computes and what it watches)
DEFAULT_RUN_KEYS = [
    "adapter", "auto_resume_from_checkpoints", "base_model", "bf16", "chat_template", "datasets", "eval_steps",
    "eval_strategy", "excess_length_strategy", "flash_attention", "fp16", "gradient_accumulation_steps",
    "group_by_length", "learning_rate", "logging_steps", "lora_alpha", "lora_dropout", "lora_r",
    "lora_target_modules", "lr_scheduler", "lr_scheduler_kwargs", "max_grad_norm", "max_steps", "micro_batch_size",
    "optimizer", "output_dir", "sample_packing", "save_safetensors", "save_steps", "save_strategy", "sdp_attention",
    "seed", "sequence_len", "special_tokens", "test_datasets", "tf32", "train_on_inputs", "trust_remote_code",
    "val_set_size", "warmup_steps", "weight_decay",
]


def test_a_new_setting_at_its_default_retrains_nothing():
    """Upgrading overbrainer must not retrain finished runs: a config.yaml key added later
    is left out (None in `build_config`) at the value that does what was done before it
    existed, so a default plan's fingerprint keeps the same keys. If this fails, give the new
    key that neutral value as None; or, when every run is meant to train again, extend the
    list and say so in the CHANGELOG."""
    from overbrainer.steps.config import build_config
    from overbrainer.steps.train import HOW_IT_COMPUTES, WATCHING

    steps = {"max_steps": 8, "warmup": 1, "stable": 5, "decay": 2}
    for trainer in ("builtin", "axolotl"):
        cfg = build_config(TrainSettings(trainer=trainer), "../base", steps, {})
        assert sorted(k for k in cfg if k not in HOW_IT_COMPUTES + WATCHING) == DEFAULT_RUN_KEYS, trainer


def test_liger_auto_is_on_only_where_it_was_measured(references):
    """train.liger "auto" (the default; config.yaml names no Liger key) is the built-in
    trainer's to resolve: off on a CPU (the run trains and its sidecar says so), and on a
    GPU only for what was measured, LoRA in one process; false is written as such, true as
    Axolotl's four keys and its plugin; Axolotl gets no "auto"."""
    import torch

    from overbrainer.steps.config import build_config
    from overbrainer.trainers.builtin import device as hw

    if not cuda_here():
        assert meta(references.folder())["liger"] is False
        assert "with Liger's kernels" not in (references.folder() / "log.txt").read_text()
    lora = {"adapter": "lora"}
    assert not hw.use_liger(torch.device("cpu"), lora)
    gpu = torch.device("cuda", 0)  # asked about, not used: each of these is off before CUDA is touched
    for cfg, processes, deterministic in (({"adapter": "full"}, 1, False), ({"adapter": "qlora"}, 1, False),
                                          (lora, 2, False), ({**lora, "shard": True}, 1, False),
                                          ({**lora, "torch_compile": True}, 1, False), (lora, 1, True)):
        assert not hw.use_liger(gpu, cfg, processes, deterministic), cfg
    steps, tokens = {"max_steps": 8, "warmup": 1, "stable": 5, "decay": 2}, {}
    auto = build_config(TrainSettings(), "../base", steps, tokens)
    assert not any(k in auto for k in ("liger", "plugins", *hw.LIGER_KEYS))
    off = build_config(TrainSettings(liger=False), "../base", steps, tokens)
    assert off["liger"] is False and not any(k in off for k in hw.LIGER_KEYS)
    for trainer in ("builtin", "axolotl"):
        on = build_config(TrainSettings(liger=True, trainer=trainer), "../base", steps, tokens)
        assert all(on[k] is True for k in hw.LIGER_KEYS) and "liger" not in on
        assert on["plugins"] == ["axolotl.integrations.liger.LigerPlugin"]
    for value in ("auto", False):
        axolotl = build_config(TrainSettings(trainer="axolotl", liger=value), "../base", steps, tokens)
        assert not any(k in axolotl for k in ("liger", "plugins", *hw.LIGER_KEYS))


# -- what is checked without training ------------------------------------------------------


def test_processes_must_share_a_step_equally():
    with pytest.raises(ValueError, match="cannot be shared equally by 2 processes"):
        TrainSettings(processes=2, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match='set device to "cuda"'):
        TrainSettings(processes=2, gradient_accumulation_steps=2, device="cuda:1")
    with pytest.raises(ValueError, match="set rendezvous"):
        TrainSettings(nodes=2, gradient_accumulation_steps=2)
    TrainSettings(processes=2, nodes=2, gradient_accumulation_steps=4, rendezvous="node0:29400")


@pytest.mark.parametrize("train, says", [
    pytest.param({"shard": True}, "set processes to 2 or more", id="alone"),
    pytest.param({"shard": True, "processes": 2, "gradient_accumulation_steps": 2, "adapter": "qlora"},
                 'shard does not take adapter "qlora"', id="qlora"),
    pytest.param({"shard": True, "processes": 2, "gradient_accumulation_steps": 2, "trainer": "axolotl"},
                 "shard is the built-in trainer's", id="axolotl"),
])
def test_shard_that_cannot_work_is_one_line_naming_the_field(project, train, says):
    from overbrainer.plan import load_plan

    project.write(**train)
    with pytest.raises(PlanError) as e:
        load_plan(project.plan_path)
    assert says in str(e.value) and "train" in str(e.value) and "\n" not in str(e.value)
    TrainSettings(shard=True, processes=2, gradient_accumulation_steps=2, adapter="full")
    TrainSettings(shard=True, nodes=2, gradient_accumulation_steps=2, rendezvous="node0:29400")


def test_sizing_counts_the_shards():
    h, i, kv, layers, vocab = 2048, 8192, 2048, 24, 49152  # SmolLM2-1.7B's shape
    modules = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
               "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    shape = Shape(params=1_711_376_384, hidden=h, layers=layers, heads=32, kv=kv, intermediate=i, vocab=vocab,
                  modules=modules)
    common = dict(lora=False, lora_r=8, targets=["q_proj"], micro_batch_size=4, gradient_accumulation_steps=8,
                  sequence_len=1024, total_memory=24 * GiB, device="cuda", bf16="auto")
    whole, sharded = estimate(shape, **common), estimate(shape, shards=8, **common)
    assert not whole.fits and sharded.fits  # a full fine-tune of 1.7B on 24 GiB GPUs: only sharded
    assert sharded.trainable * 8 >= whole.trainable > sharded.trainable * 7
    assert sharded.weights < whole.weights / 4 and sharded.activations == whole.activations


def test_a_misspelled_device_names_the_field(project):
    from overbrainer.plan import load_plan

    project.write(device="gpu")
    with pytest.raises(PlanError) as e:
        load_plan(project.plan_path)
    assert "train.device" in str(e.value) and "\n" not in str(e.value)


def test_several_machines_meet_at_the_rendezvous():
    from overbrainer.trainers.builtin import Builtin

    (command,) = Builtin(processes=8, nodes=2, rendezvous="node0:29400", run_id="demo").commands()
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
            "--rdzv-id=demo"} <= set(command)
    assert Builtin(deterministic=True).env("/")["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_sizing_counts_bf16_qlora_checkpointing_and_the_gpu():
    # SmolLM2-135M's shape (on the tiny model the float32 embeddings QLoRA keeps outweigh
    # what 4 bits save on its small linears)
    h, i, kv, layers, vocab = 576, 1536, 192, 30, 49152
    modules = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
               "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    shape = Shape(params=134_515_008, hidden=h, layers=layers, heads=9, kv=kv, intermediate=i, vocab=vocab,
                  modules=modules)
    common = dict(lora=True, lora_r=8, targets=["q_proj", "v_proj"], micro_batch_size=4,
                  gradient_accumulation_steps=1, sequence_len=512, total_memory=64 * GiB)
    fp32 = estimate(shape, device="cpu", **common)
    bf16 = estimate(shape, device="cpu", bf16=True, **common)
    qlora = estimate(shape, device="cpu", bf16=True, qlora=True, **common)
    checkpointed = estimate(shape, device="cpu", gradient_checkpointing=True, **common)
    gpu = estimate(shape, device="cuda", bf16="auto", **common)
    assert qlora.weights < bf16.weights < fp32.weights
    assert bf16.activations < fp32.activations and checkpointed.activations < fp32.activations
    assert gpu.activations < bf16.activations  # bf16 by "auto", and sdpa keeps no scores
    assert gpu.runtime > fp32.runtime  # the CUDA context


def test_out_of_memory_is_one_line_with_the_step_the_peak_and_what_to_lower():
    import torch

    from overbrainer.trainers.builtin.loop import OOM_EXIT, out_of_memory

    t = SimpleNamespace(device=torch.device("cpu"), saved_step=6, step=7, cfg={"max_steps": 8})
    error = out_of_memory(t)
    message = str(error)
    assert error.code == OOM_EXIT and "\n" not in message
    assert "at step 8 of 8" in message and "step-000006 is intact" in message
    assert "train.micro_batch_size" in message and "train.gradient_checkpointing" in message


def test_out_of_memory_anywhere_in_a_step_is_that_line():
    """Not only the forward and backward: the optimizer's first step (its moments are
    allocated then), evaluation, samples and a save run out of memory in one line too,
    naming what was running; any other error goes through as it is."""
    import torch

    from overbrainer.trainers.builtin.loop import OOM_EXIT, GiveUp, memory_errors_told

    t = SimpleNamespace(device=torch.device("cpu"), saved_step=6, step=7, cfg={"max_steps": 8})
    with pytest.raises(GiveUp) as e, memory_errors_told(t):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert e.value.code == OOM_EXIT and "out of GPU memory at step 8 of 8" in str(e.value)
    with pytest.raises(GiveUp) as e, memory_errors_told(t, 7, "evaluating"):
        raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)")
    assert "out of GPU memory evaluating at step 7 of 8" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="mat1 and mat2"), memory_errors_told(t, 7, "saving"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_out_of_memory_on_the_cpu_and_before_the_first_step_is_one_line():
    """The CPU allocator's refusal is the same line, naming the machine's memory, not a
    GPU's; before the first step (loading the model, its checkpoint, the optimizer state)
    the line says the model does not fit and what would make it, for the run's adapter."""
    import torch

    from overbrainer.trainers.builtin.loop import (
        OOM_EXIT,
        GiveUp,
        memory_errors_at_start,
        memory_errors_told,
        too_big_to_load,
    )

    refused = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes."
    t = SimpleNamespace(device=torch.device("cpu"), saved_step=None, step=0, cfg={"max_steps": 8})
    with pytest.raises(GiveUp) as e, memory_errors_told(t):
        raise RuntimeError(refused)
    message = str(e.value)
    assert message.startswith("out of memory at step 1 of 8 (peak ") and "GPU" not in message
    assert " GiB of " in message and "on cpu; no checkpoint yet)" in message and e.value.code == OOM_EXIT

    full = {"adapter": None, "max_steps": 8}
    with pytest.raises(GiveUp) as e, memory_errors_at_start(full, torch.device("cpu"), "loading the model onto cpu", 6):
        raise RuntimeError(refused)
    message = str(e.value)
    assert message.startswith("out of memory loading the model onto cpu (peak ") and "step-000006 is intact" in message
    assert 'the model does not fit: train.adapter "lora"' in message and "qlora" not in message
    assert "a machine with more memory" in message and "\n" not in message

    lora = {"adapter": "lora", "max_steps": 8}
    with pytest.raises(GiveUp) as e, memory_errors_at_start(lora, torch.device("cpu"), "loading the model onto cpu"):
        raise RuntimeError(refused)
    assert "the model does not fit: a smaller base, or a machine with more memory" in str(e.value)
    with pytest.raises(ValueError, match="not memory"), memory_errors_at_start(lora, torch.device("cpu"), "x"):
        raise ValueError("not memory")

    # a GPU run whose host memory ran out (every process loads the model whole, sharded or
    # not): the host's figures and the host's fixes, not the GPU's (no GPU is asked here)
    sharded = {"adapter": None, "shard": True, "max_steps": 8}
    for error in (RuntimeError(refused), MemoryError()):
        with pytest.raises(GiveUp) as e, memory_errors_at_start(sharded, torch.device("cuda"), "loading the model onto cpu"):
            raise error
        message = str(e.value)
        assert message.startswith("out of memory loading the model onto cpu (peak ") and "on cpu; no checkpoint" in message
        assert "qlora" not in message and "train.shard" not in message and 'train.adapter "lora"' in message
    # on the GPU itself: qlora, and train.shard only where it is not on already
    assert "train.shard with train.processes" in too_big_to_load({"adapter": None}, torch.device("cuda"))
    assert "train.shard" not in too_big_to_load(sharded, torch.device("cuda"))
    assert too_big_to_load({"adapter": "lora"}, torch.device("cuda")).startswith(
        'the model does not fit: train.adapter "qlora" (the base in 4 bits)')


def test_the_cpu_allocators_own_refusal_is_recognized(tmp_path):
    """The text matched is torch's own: a process whose address space is capped asks for
    more than the cap, and the error it gets is one `is_out_of_memory` knows."""
    script = tmp_path / "refused.py"
    script.write_text(
        "import resource, torch\n"
        "from overbrainer.trainers.builtin.device import is_out_of_memory\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, hard))\n"
        "try:\n"
        "    torch.empty(2**34, dtype=torch.uint8).fill_(1)\n"
        "except RuntimeError as e:\n"
        "    print(is_out_of_memory(e), str(e).splitlines()[0][:160])\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True ") and "DefaultCPUAllocator: can't allocate memory" in proc.stdout, proc.stdout


def test_a_cpu_without_bf16_instructions_is_told_apart():
    """cpu_has_bf16 reads /proc/cpuinfo's flags: AVX512-BF16 or AMX on x86, BF16 on Arm; an
    AVX2-only CPU (where bf16 matmuls were 25x slower than float32's) is False, and a
    cpuinfo without flags (none to read) is None, not a guess."""
    from overbrainer.trainers.builtin.device import cpu_has_bf16

    avx2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_has_bf16(avx2) is False
    assert cpu_has_bf16(avx2.replace("avx2", "avx2 avx512f avx512_bf16")) is True
    assert cpu_has_bf16(avx2.replace("avx2", "avx2 amx_tile amx_bf16")) is True
    assert cpu_has_bf16("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n") is True
    assert cpu_has_bf16("processor\t: 0\nFeatures\t: fp asimd\n") is False
    assert cpu_has_bf16("processor\t: 0\n") is None
    assert cpu_has_bf16() in (True, False, None)


def test_bf16_auto_on_the_cpu_is_amx():
    """train.bf16 "auto" on the CPU: bf16 where AMX is (1.6-2.2x float32 there), float32 on an
    AVX512-BF16 CPU without it (not measured) and on AVX2; the trainer and sizing agree, and
    sizing takes Axolotl's "auto" as float32 on a CPU (Axolotl's rule)."""
    import torch

    from overbrainer.inputs.sizing import estimate
    from overbrainer.portable.common import cpu_has_amx
    from overbrainer.trainers.builtin.device import use_bf16

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_has_amx(avx2) is False
    assert cpu_has_amx(avx2.replace("avx2", "avx2 avx512f avx512_bf16")) is False
    assert cpu_has_amx(avx2.replace("avx2", "avx2 avx512_bf16 amx_tile amx_bf16 amx_int8")) is True
    assert cpu_has_amx("processor\t: 0\n") is False
    cpu = torch.device("cpu")
    assert use_bf16("auto", cpu) is cpu_has_amx()
    assert use_bf16(True, cpu) is True and use_bf16(False, cpu) is False

    from overbrainer.inputs.sizing import Shape

    h, i = 576, 1536
    modules = {"q_proj": (h, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    smollm2 = Shape(params=134_515_008, hidden=h, layers=30, heads=9, kv=192, intermediate=i, vocab=49152,
                    modules=modules)

    def activations(bf16) -> int:
        return estimate(smollm2, lora=True, lora_r=8, targets=["q_proj"], micro_batch_size=4,
                        gradient_accumulation_steps=1, sequence_len=256, device="cpu", total_memory=2**40,
                        bf16=bf16).activations

    assert (activations("auto") == activations(True)) is cpu_has_amx()
    assert (activations("auto") == activations(False)) is not cpu_has_amx()
    # Axolotl's "auto" is a GPU's only: sized as float32 on any CPU
    from overbrainer.inputs.sizing import fit

    def fitted(bf16, auto_on_cpu) -> int:
        return fit(smollm2, lora=True, lora_r=8, targets=["q_proj"], micro_batch_size=4, gradient_accumulation_steps=1,
                   sequence_len=256, device="cpu", total_memory=2**40, bf16=bf16, auto_on_cpu=auto_on_cpu).activations

    assert fitted("auto", auto_on_cpu=False) == fitted(False, auto_on_cpu=True)
    assert fitted("auto", auto_on_cpu=True) == activations("auto")


def test_what_to_lower_when_the_host_runs_out_depends_on_where_and_when():
    """The OOM killer's line (steps/train.py): before the first step the model's loading is
    what took the memory; later, on the CPU, a micro-batch's activations; on a GPU the host
    holds the model once per process, and activations are the GPU's."""
    from overbrainer.steps.train import host_memory_fix

    assert host_memory_fix({"adapter": "lora"}, 0, "cpu", 1) == "a smaller base, or a machine with more memory"
    later = host_memory_fix({"adapter": "lora"}, 3, "cpu", 1)
    assert later.startswith("set train.gradient_checkpointing (the run resumes), or lower train.micro_batch_size")
    assert "gradient_checkpointing" not in host_memory_fix({"adapter": "lora", "gradient_checkpointing": True}, 3, "cpu", 1)
    assert 'train.adapter "lora"' in host_memory_fix({"adapter": None}, 0, "cpu", 1)
    on_gpus = host_memory_fix({"adapter": None}, 5, "cuda", 4)
    assert on_gpus == "fewer train.processes (4 each hold the model in this machine's memory), or a smaller base, " \
                      "or a machine with more memory"


def test_compile_auto_is_a_long_bf16_lora_on_the_cpu(monkeypatch):
    """train.compile "auto": on for a LoRA in bf16 on the CPU in one process for 100 steps
    or more where a C++ compiler is at hand (measured 1.31-1.40x there); off in float32, for
    shorter runs, a full fine-tune or QLoRA, several processes, deterministic kernels, on a
    GPU and without a compiler. Axolotl gets false for it (its own "auto" means on)."""
    import torch

    from overbrainer.steps.config import build_config
    from overbrainer.trainers.builtin import device as hw

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    long = {"adapter": "lora", "max_steps": hw.COMPILE_FROM_STEPS}
    monkeypatch.setenv("CXX", "sh")  # any program on PATH stands for the compiler
    assert hw.use_compile(cpu, long, bf16=True)
    assert not hw.use_compile(cpu, long, bf16=False)
    assert not hw.use_compile(cpu, {**long, "max_steps": hw.COMPILE_FROM_STEPS - 1}, bf16=True)
    for adapter in ("full", "qlora", None):
        assert not hw.use_compile(cpu, {**long, "adapter": adapter}, bf16=True), adapter
    assert not hw.use_compile(cpu, long, bf16=True, processes=2)
    assert not hw.use_compile(cpu, long, bf16=True, deterministic=True)
    assert not hw.use_compile(gpu, long, bf16=True)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not hw.use_compile(cpu, long, bf16=True)

    steps, tokens = {"max_steps": 8, "warmup": 1, "stable": 5, "decay": 2}, {}
    assert build_config(TrainSettings(), "../base", steps, tokens)["torch_compile"] == "auto"
    assert build_config(TrainSettings(trainer="axolotl"), "../base", steps, tokens)["torch_compile"] is False
    for value in (True, False):
        for trainer in ("builtin", "axolotl"):
            cfg = build_config(TrainSettings(compile=value, trainer=trainer), "../base", steps, tokens)
            assert cfg["torch_compile"] is value
    # an explicit compile is what keeps Liger's auto off on a GPU (not measured together)
    assert not hw.use_liger(gpu, {"adapter": "lora", "torch_compile": True})


def test_compile_auto_compiles_a_long_bf16_lora_trained_on_the_cpu(project):
    """A bake of 100 steps in bf16 on the CPU with compile left at "auto": the trainer says
    its layers are compiled and the checkpoint records it; a greedy sample is taken from
    the layers as they are (eager), and the run ends as any other."""
    from overbrainer.trainers.builtin import device as hw

    needs_cpp_compiler()
    project.write(steps=100, bf16=True, save_every=100, eval_every=100, micro_batch_size=1,
                  gradient_accumulation_steps=1, samples={"every": 100, "prompts": ["Hi"], "max_new_tokens": 4})
    bake_json(str(project.plan_path), "--runs", str(project.root / "runs"))
    folder = project.root / "runs" / "tiny"
    assert "its decoder layers compiled" in (folder / "log.txt").read_text()
    last = json.loads((folder / "checkpoints" / "step-000100" / "meta.json").read_text())
    assert last["compile"] is True and last["bf16"] is True
    assert last["pad_to_multiple_of"] == hw.CPU_BF16_PAD_MULTIPLE  # "auto" where bf16 runs on the CPU
    assert (folder / "samples.jsonl").read_text().count('"step": 100') == 1
