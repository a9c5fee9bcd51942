"""Sizing: the memory estimate, the micro-batch it picks, and how close it is to the peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bake_json, cli, configured

from overbrainer.errors import OverbrainerError
from overbrainer.inputs.sizing import GiB, cuda_gpu, estimate, fit, model_shape


@pytest.fixture
def shape(tiny_model):
    return model_shape(tiny_model)


def test_shape_reads_config_and_headers(shape):
    assert shape.layers == 2 and shape.hidden == 32 and shape.vocab == 400
    assert shape.params == 44192  # read from the safetensors headers, not the weights


def test_fit_keeps_examples_per_step(shape):
    common = dict(lora=True, lora_r=8, targets=["q_proj", "v_proj"], sequence_len=512, device="cpu")
    roomy = fit(shape, micro_batch_size=8, gradient_accumulation_steps=1, total_memory=64 * GiB, **common)
    assert (roomy.micro_batch_size, roomy.gradient_accumulation_steps) == (8, 1)
    one = estimate(shape, micro_batch_size=1, gradient_accumulation_steps=8, total_memory=64 * GiB, **common)
    two = estimate(shape, micro_batch_size=2, gradient_accumulation_steps=4, total_memory=64 * GiB, **common)
    # a budget between the two: the micro-batch that fits, and 8 examples a step still
    budget = (one.total + two.total) / 2 / 0.85
    tight = fit(shape, micro_batch_size=8, gradient_accumulation_steps=1, total_memory=int(budget), **common)
    assert (tight.micro_batch_size, tight.gradient_accumulation_steps) == (1, 8)


def test_fit_refuses_in_one_line_with_the_numbers(shape):
    with pytest.raises(OverbrainerError) as e:
        fit(shape, lora=True, lora_r=8, targets=["q_proj"], micro_batch_size=4, gradient_accumulation_steps=1,
            sequence_len=4096, device="cpu", total_memory=GiB // 4)
    message = str(e.value)
    assert "\n" not in message and "GiB" in message and "sequence_len" in message


def test_the_gpu_sized_is_the_one_torch_numbers():
    """nvidia-smi lists GPUs in bus order; CUDA numbers them fastest first unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID, and only those CUDA_VISIBLE_DEVICES names (by number in
    that order, or by UUID), from 0: cuda:N is sized against that GPU's free memory."""
    gpus = [{"index": "0", "uuid": "GPU-aaaa-0", "free": 10 * GiB, "cap": 7.5},   # a T4 on bus 0
            {"index": "1", "uuid": "GPU-bbbb-1", "free": 70 * GiB, "cap": 9.0},   # an H100 on bus 1
            {"index": "2", "uuid": "GPU-cccc-2", "free": 40 * GiB, "cap": 8.0}]
    def free(index, **env):
        gpu = cuda_gpu(index, env=env, gpus=gpus)
        return gpu and gpu["free"] // GiB
    assert [free(i) for i in range(4)] == [70, 40, 10, None]  # fastest first
    assert [free(i, CUDA_DEVICE_ORDER="PCI_BUS_ID") for i in range(3)] == [10, 70, 40]
    assert [free(i, CUDA_VISIBLE_DEVICES="2,0") for i in range(3)] == [10, 70, None]
    assert [free(i, CUDA_VISIBLE_DEVICES="2,0", CUDA_DEVICE_ORDER="PCI_BUS_ID") for i in range(2)] == [40, 10]
    assert free(0, CUDA_VISIBLE_DEVICES="GPU-cccc") == 40  # a UUID's prefix, as CUDA takes it
    assert free(1, CUDA_VISIBLE_DEVICES="1,MIG-0a1b,0") is None  # CUDA stops at what it cannot read
    assert free(0, CUDA_VISIBLE_DEVICES="") is None  # no GPU visible
    assert cuda_gpu(0, env={}, gpus=[]) is None


def test_estimate_is_close_to_the_measured_peak(project):
    report = bake_json(str(project.plan_path))
    folder = Path(report["folder"])
    estimated = json.loads((folder / ".stamps/config.json").read_text())["summary"]["memory"]["total"]
    measured = json.loads((folder / "checkpoints/step-000008/meta.json").read_text())["peak_memory"]
    assert 0.7 < estimated / measured < 1.6, (estimated, measured)
    dry = cli("bake", str(project.plan_path), "--dry-run").stdout
    assert "memory:" in dry and "GiB estimated" in dry


def test_reasoning_the_template_drops_is_warned(project, tmp_path):
    """<think> blocks are warned about when the chat template drops them; kept otherwise."""
    import shutil

    dropping = (
        "{% for message in messages %}{% set content = message['content'] %}"
        "{% if message['role'] == 'assistant' and '</think>' in content %}"
        "{% set content = content.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    data = project.root / "chats.jsonl"
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    for row in rows[:5]:
        row["messages"][-1]["content"] = "<think>the user asks; answer briefly</think>" + row["messages"][-1]["content"]
    rows[6]["messages"][-1]["reasoning_content"] = "thinking"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = configured(project.plan_path, tmp_path / "kept")  # the config step warns; no training needed
    warnings = json.loads((kept / ".stamps/config.json").read_text())["summary"]["warnings"]
    assert len(warnings) == 1 and "reasoning fields" in warnings[0]  # the tiny template keeps <think>

    shutil.copytree(project.root / "tiny", project.root / "dropping")
    (project.root / "dropping" / "chat_template.jinja").write_text(dropping)
    project.plan["base"] = "./dropping"
    project.write()
    dropped = configured(project.plan_path, tmp_path / "dropped")
    warnings = json.loads((dropped / ".stamps/config.json").read_text())["summary"]["warnings"]
    assert any("5 assistant turns have <think> blocks" in w and "drops them" in w for w in warnings), warnings
