"""Hostile and broken inputs: every one gets one clear line and exit code 2 (or the
library's own error type in-process) — no traceback, no hang, no partial output that
passes as done — and a changed file under a finished step makes that step rerun."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
from helpers import bake_json, cli
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from overbrainer.errors import DataError, PlanError
from overbrainer.inputs.conversations import split_conversations
from overbrainer.plan import load_plan

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["../../etc/passwd", "/dev/zero", "~/.ssh/id_rsa", "smollm2-135m-instruct", "org/name"]),
)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)
plan_keys = st.sampled_from(["name", "base", "data", "split", "train", "bake", "where", "trust_remote_code",
                             "lerning_rate", "steps", "validation"])
train_keys = st.sampled_from(["steps", "epochs", "learning_rate", "lora_r", "micro_batch_size", "schedule",
                              "sequence_len", "adapter", "trainer", "processes", "save_every", "lora_dropout",
                              "seed"])


@st.composite
def plans(draw):
    plan = draw(st.dictionaries(plan_keys, json_value, max_size=6))
    if draw(st.booleans()):
        plan["train"] = draw(st.dictionaries(train_keys, json_value, max_size=5))
    if draw(st.booleans()):
        plan["split"] = {"validation": draw(json_leaf), "seed": draw(json_leaf)}
    return plan


def one_line_problems(error: PlanError, path: Path) -> None:
    for problem in error.problems:
        assert "\n" not in problem and problem.startswith(str(path)), problem
        assert "Traceback" not in problem


@SETTINGS
@given(plan=plans())
# a key that str.isdigit() takes for a list index and int() refuses (found by hypothesis)
@example(plan={"name": None, "base": None, "data": None, "split": {"\u00b2": None}})
def test_random_plans_fail_cleanly(tmp_path, plan):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, allow_nan=True))
    try:
        load_plan(path)
    except PlanError as e:
        one_line_problems(e, path)


@SETTINGS
@given(raw=st.binary(max_size=300))
def test_random_bytes_as_a_plan(tmp_path, raw):
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    with pytest.raises(PlanError) as e:
        load_plan(path)
    one_line_problems(e.value, path)


def test_deeply_nested_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"name": "x", "base": "b", "data": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(PlanError):
        load_plan(path)


message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bot", ""]),
                                 "content": st.one_of(st.text(max_size=40), st.integers(), st.none())})
row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(message, max_size=4)}),
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries(
        {"from": st.sampled_from(["human", "gpt", "x"]), "value": st.text(max_size=20)}), max_size=3)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=20), "completion": st.text(max_size=20)}),
    json_value,
)


@SETTINGS
@given(rows=st.lists(row, max_size=8), tail=st.binary(max_size=40), cut=st.integers(min_value=0, max_value=400))
def test_random_data_fails_with_file_and_line_and_leaves_nothing(tmp_path, rows, tail, cut):
    data = tmp_path / "chats.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    data.write_bytes(text[: cut if cut < len(text) else len(text)] + tail)
    out = tmp_path / "examples.parquet"
    try:
        summary = split_conversations([data], out, validation=0, seed=0)
        assert out.exists() and summary.rows >= 1
    except DataError as e:
        assert "\n" not in str(e) and str(e).startswith(str(data))
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") or "tmp" in p.name]


@pytest.mark.parametrize("content", [
    b"",  # empty
    b"\x00\x01\x02\xff" * 100,  # binary
    b'{"messages": [{"role": "user", "content": "' + b"x" * 3_000_000 + b'"}]}\n',  # giant line, no answer
    b'{"text": "a wrong schema"}\n',
    b'{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}\n',  # out of order
])
def test_broken_data_files_through_the_cli(project, tmp_path, content):
    (project.root / "chats.jsonl").write_bytes(content)
    proc = cli("bake", str(project.plan_path), check=2)
    assert "Traceback" not in proc.stderr and "chats.jsonl" in proc.stderr.splitlines()[0]
    assert not (tmp_path / "runs" / "tiny" / "examples.parquet").exists()


def test_hostile_plans_through_the_cli(project, tmp_path):
    for plan in (
        {**project.plan, "train": {"steps": 10**40}},
        {**project.plan, "split": {"validation": -0.5}},
        {**project.plan, "name": "../escape"},
        {**project.plan, "data": "../../../../etc/shadow"},
        {**project.plan, "base": "/dev/null"},
        {**project.plan, "data": "chats.jsonl", "unknown": {"deep": [[[[1]]]]}},
        {**project.plan, "train": {"seed": 10**14}},
        {**project.plan, "train": {"learning_rate": float("nan")}},
        {**project.plan, "train": {"steps": True, "learning_rate": "0.001"}},
        {**project.plan, "name": "n" * 300},
    ):
        project.plan_path.write_text(json.dumps(plan))
        proc = cli("bake", str(project.plan_path), check=2, timeout=120)
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: "), proc.stderr
    project.plan_path.write_text('{"name": "tiny", "base": "./tiny",\n "data": "chats.jsonl", "base": "./x"}')
    assert "'base' is given twice in one object (lines 1 and 2)" in cli("bake", str(project.plan_path), check=2).stderr
    project.plan_path.write_bytes(b'{"name": "\xff\xfe"}')
    assert "UTF-8" in cli("bake", str(project.plan_path), check=2).stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/.stamps/*.json"))


def test_base_missing_tensors_is_refused(project):
    from safetensors.torch import load_file, save_file

    weights = project.root / "tiny" / "model.safetensors"
    state = load_file(weights)
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, weights, metadata={"format": "pt"})
    proc = cli("bake", str(project.plan_path), check=2)
    assert "lack 1 tensors" in proc.stderr and "Traceback" not in proc.stderr


def test_damaged_state_is_detected_and_redone(baked_copy, tmp_path):
    """A corrupted stamp, examples.parquet or checkpoint: found by hash, the step reruns."""
    project = baked_copy()  # a finished bake of the tiny plan
    folder = tmp_path / "runs" / "tiny"
    assert bake_json(str(project.plan_path))["ran"] == []
    reference = (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes()

    (folder / ".stamps" / "config.json").write_text("{ torn")
    (folder / "examples.parquet").write_bytes(b"PAR1 not really")
    again = bake_json(str(project.plan_path))
    assert "split" in again["ran"] and "config" in again["ran"]
    assert "train" not in again["ran"]  # same examples, same config: the training stands

    # a checkpoint altered after the fact, before training finished: set aside, resumed from the one before
    shutil.rmtree(folder / "checkpoints" / "step-000008")
    (folder / ".stamps" / "train.json").unlink()
    damaged = folder / "checkpoints" / "step-000006" / "adapter_model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    bake_json(str(project.plan_path))
    log = (folder / "log.txt").read_text()
    assert "step-000006 is damaged" in log and "resuming from step-000003" in log
    assert (folder / "checkpoints" / "corrupt-step-000006").is_dir()
    assert (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes() == reference


def test_secrets_stay_out_of_the_run_folder(project, tmp_path):
    secret = "hf_" + "".join(string.ascii_letters[i % 52] for i in range(30))
    report = bake_json(str(project.plan_path), env={"HF_TOKEN": secret, "AWS_SECRET_ACCESS_KEY": secret})
    for path in Path(report["folder"]).rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert secret.encode() not in path.read_bytes(), path
