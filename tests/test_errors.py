"""Bad input: one line naming what, where and the fix; exit code 2; no traceback; nothing
left behind that a later run could take for finished."""

from __future__ import annotations

import json

import pytest
from helpers import cli


def one_clear_line(proc, *needles: str) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) >= 1
    first = lines[0]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return first


def no_stamps(runs) -> bool:
    return not any(runs.glob("*/.stamps/*.json"))


def test_typo_in_plan_gets_did_you_mean(project, tmp_path):
    project.plan["train"]["learnin_rate"] = 0.1
    project.plan["train"]["steps"] = -3
    project.write()
    proc = cli("bake", str(project.plan_path), check=2)
    one_clear_line(proc, "train.learnin_rate: unknown setting; did you mean train.learning_rate?", "train.steps")
    assert "plan.json:" in proc.stderr  # file:line
    assert not (tmp_path / "runs").exists()


def test_invalid_json_plan_names_the_line(tmp_path):
    plan = tmp_path / "bad.json"
    plan.write_text('{\n  "name": "x",\n  "base": "y"\n  "data": "z"\n}\n')
    proc = cli("bake", str(plan), check=2)
    assert "bad.json:4" in one_clear_line(proc, "invalid JSON")


def test_missing_data_file(project, tmp_path):
    project.plan["data"] = ["chats.jsonl", "missing.jsonl"]
    project.write()
    proc = cli("bake", str(project.plan_path), check=2)
    one_clear_line(proc, "data[1]", "missing.jsonl", "no such file")
    assert no_stamps(tmp_path / "runs")


def test_hub_data_offline_without_a_cached_copy_is_one_line(project, tmp_path):
    project.plan["data"] = ["chats.jsonl", {"path": "tatsu-lab/alpaca", "weight": 1}]
    project.plan["data"][0] = {"path": "chats.jsonl", "weight": 1}
    project.write()
    proc = cli("bake", str(project.plan_path), check=2)
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "data[1]: the dataset 'tatsu-lab/alpaca' is not in the Hugging Face cache" in line
    assert "hf download tatsu-lab/alpaca --repo-type dataset" in line and "Traceback" not in proc.stderr
    assert no_stamps(tmp_path / "runs")


def test_missing_base(project):
    project.plan["base"] = "./nowhere"
    project.write()
    one_clear_line(cli("bake", str(project.plan_path), check=2), "nowhere")


def test_hub_base_offline_is_one_line(project):
    project.plan["base"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    project.write()
    proc = cli("bake", str(project.plan_path), check=2, env={"HF_HUB_OFFLINE": "1"})
    one_clear_line(proc, "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
        ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "assistant"),
        ('{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]}', "empty"),
    ],
)
def test_bad_data_names_file_and_line(project, tmp_path, line, needle):
    data = project.root / "chats.jsonl"
    lines = data.read_text().splitlines()
    lines.insert(6, line)
    data.write_text("\n".join(lines) + "\n")
    proc = cli("bake", str(project.plan_path), check=2)
    one_clear_line(proc, "chats.jsonl:7", needle)
    folder = tmp_path / "runs" / "tiny"
    assert not (folder / "examples.parquet").exists()
    assert not (folder / ".stamps" / "split.json").exists()


def test_non_utf8_data(project):
    data = project.root / "chats.jsonl"
    data.write_bytes(data.read_bytes() + b'{"messages": "\xff\xfe"}\n')
    one_clear_line(cli("bake", str(project.plan_path), check=2), "chats.jsonl:41", "UTF-8")


def test_training_failure_is_a_failed_run_with_the_log(project, tmp_path):
    # a base model whose weights are not the shapes its config says (a whole, valid
    # safetensors file, which the base step takes): training itself fails
    import struct

    weights = project.root / "tiny" / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2
                and v["shape"][0] != v["shape"][1])
    header[name]["shape"] = header[name]["shape"][::-1]
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    proc = cli("bake", str(project.plan_path), check=1)
    first = one_clear_line(proc, "training failed", "log.txt")
    assert first.startswith("error: training failed")
    folder = tmp_path / "runs" / "tiny"
    assert not (folder / ".stamps" / "train.json").exists()
    assert (folder / ".stamps" / "split.json").exists()  # what finished stays finished
    report = json.loads(cli("bake", str(project.plan_path), "--json", check=1).stdout.splitlines()[-1])
    assert report["state"] == "failed" and "train" not in report["ran"]


def test_base_without_chat_template_is_refused_at_config(project, tmp_path):
    tiny = project.root / "tiny"
    (tiny / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tiny / "tokenizer_config.json").write_text(json.dumps(config))
    proc = cli("bake", str(project.plan_path), "--foreground", check=2)
    first = one_clear_line(proc, "has no chat template", 'set "chat_template" in the plan')
    assert first.startswith("error: config: the base model tiny has no chat template")
    folder = tmp_path / "runs" / "tiny"
    assert (folder / ".stamps" / "split.json").exists() and not (folder / ".stamps" / "config.json").exists()
    assert not (folder / "checkpoints").exists() and not (folder / "log.txt").exists()  # no trainer started
