"""Hostile inputs found in the second round: each ends in one clear line (what, where, the
fix) and an exit code, never a traceback, a hang, or advice meant for a developer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import bake_json, cli

from overbrainer.errors import BaseModelError, PlanError
from overbrainer.plan import load_plan


def one_line(proc, *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- run.json damaged, or no run at all (items 5 and 10) ------------------------------------

@pytest.mark.parametrize("content", ['{"state": 5}', '{"state": "running", "process": "x"}', '{"state": "runn',
                                     '[1, 2]', ""])
def test_a_damaged_run_json_is_one_line_everywhere_and_wait_returns(tmp_path, content):
    folder = tmp_path / "runs" / "p1"
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps({"name": "p1", "resolved": {"plan_file": str(tmp_path / "p1.json")}}))
    (folder / "run.json").write_text(content)
    for command in ("status", "stop", "wait"):
        proc = cli(command, str(folder), check=2, timeout=60)
        one_line(proc, "run.json is damaged", "overbrainer status --repair")
    repaired = cli("status", "--repair", str(folder))
    assert "run.json rebuilt: failed" in repaired.stdout
    assert "failed" in cli("status", str(folder)).stdout
    assert "whole; nothing to repair" in cli("status", "--repair", str(folder)).stdout


def test_status_and_wait_on_a_folder_that_is_no_run(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    for command in ("status", "wait"):
        one_line(cli(command, str(tmp_path / "elsewhere"), check=2, timeout=60),
                 "is not a run folder (no run.json or plan.json)")


# -- the plan (items 6, 12, 13) ----------------------------------------------------------

PLAN = {"name": "p", "base": "./tiny", "data": "chats.jsonl"}


def problem(tmp_path: Path, text: str) -> str:
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError) as e:
        load_plan(path)
    assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0]
    return e.value.problems[0]


@pytest.mark.parametrize("train, said", [
    ({"seed": 10**14}, "train.seed: should be less than or equal to 4294967295"),
    ({"seed": -1}, "train.seed: should be greater than or equal to 0"),
    ({"learning_rate": float("nan")}, "train.learning_rate: is NaN, not a finite number"),
    ({"learning_rate": float("inf")}, "train.learning_rate: is Infinity, not a finite number"),
    ({"steps": True}, "train.steps: is true, not a whole number"),
    ({"learning_rate": True}, "train.learning_rate: is true, not a number"),
    ({"learning_rate": "0.001"}, 'train.learning_rate: is "0.001", not a number'),
    ({"steps": "8"}, 'train.steps: is "8", not a whole number'),
    ({"gradient_checkpointing": 1}, "train.gradient_checkpointing: is 1, not true or false"),
])
def test_strict_bounded_finite_numbers(tmp_path, train, said):
    assert said in problem(tmp_path, json.dumps({**PLAN, "train": train}))


def test_integers_are_numbers_and_a_plan_of_whole_numbers_loads(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN, "train": {"learning_rate": 1, "lora_dropout": 0, "seed": 4294967295},
                                "split": {"validation": 3, "seed": 2}}))
    plan = load_plan(path)
    assert plan.train.learning_rate == 1.0 and plan.train.seed == 4294967295 and plan.split.validation == 3


def test_a_long_name_is_told_the_limit(tmp_path):
    said = problem(tmp_path, json.dumps({**PLAN, "name": "n" * 300}))
    assert "name: is 300 characters" in said and "at most 100 characters" in said


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    text = '{\n "name": "p",\n "base": "./tiny",\n "data": "chats.jsonl",\n "train": {\n  "steps": 8,\n  "steps": 9\n }\n}'
    said = problem(tmp_path, text)
    assert said.startswith(f"{tmp_path / 'plan.json'}:7:") and "'steps' is given twice" in said and "lines 6 and 7" in said
    # the same key in two different objects is no duplicate
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN, "data": [{"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 2}]}))
    assert [s.path for s in load_plan(path).data] == ["a.jsonl", "b.jsonl"]


# -- data that is no file (item 11), and the message typo (item 14) -------------------------

def test_a_fifo_or_a_link_to_a_device_as_data(project):
    fifo = project.root / "pipe.jsonl"
    os.mkfifo(fifo)
    os.symlink("/dev/zero", project.root / "zero.jsonl")
    for name, kind in (("pipe.jsonl", "is a FIFO (named pipe), not a regular file"),
                       ("zero.jsonl", "(a link to /dev/zero) is a character device")):
        project.plan["data"] = name
        project.write()
        one_line(cli("bake", str(project.plan_path), check=2, timeout=60), name, kind)


def test_a_message_of_the_wrong_type_reads_well(tmp_path):
    from overbrainer.errors import DataError
    from overbrainer.inputs.conversations import split_conversations

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": []}]}) + "\n")
    with pytest.raises(DataError) as e:
        split_conversations([data], tmp_path / "examples.parquet", validation=0, seed=0)
    assert "is an array, not a string" in str(e.value)


# -- the base model's weights (item 7) ----------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "random", "huge header", "offsets past the end"])
def test_a_damaged_base_safetensors_is_refused_at_the_base_step(tmp_path, tiny_model, damage):
    import struct

    from overbrainer.steps.base_model import check_tensors

    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncated":
        weights.write_bytes(raw[: len(raw) - 1000])
    elif damage == "random":
        weights.write_bytes(os.urandom(4096))
    elif damage == "huge header":
        weights.write_bytes(struct.pack("<Q", 2**40) + raw[8:])
    else:
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [2**62, 2**62 + header[name]["data_offsets"][1] - header[name]["data_offsets"][0]]
        text = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(BaseModelError) as e:
        check_tensors(folder, "./tiny")
    assert str(weights) in str(e.value) and "not a valid safetensors file" in str(e.value), str(e.value)


def test_a_truncated_base_is_one_line_through_the_cli(project):
    weights = project.root / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    one_line(cli("bake", str(project.plan_path), "--foreground", check=2), "model.safetensors", "truncated")


# -- files that cannot be written (item 9) -----------------------------------------------

def test_a_folder_that_cannot_be_written_is_one_line():
    from overbrainer.graph.driver import outcome

    state, reason, kind = outcome(PermissionError(1, "Operation not permitted", "/runs/p1/baked", None, "/runs/p1/.old-baked"))
    assert state == "failed" and kind == "input" and "\n" not in reason
    assert reason.startswith("/runs/p1/baked: operation not permitted") and "permissions" in reason


@contextmanager
def unwritable(path: Path):
    """`path` made so that this user cannot change what is in it: read-only for a user,
    immutable (``chattr +i``) for root, whom permissions do not stop."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if not (shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0):
        pytest.skip("running as root, and this filesystem has no chattr +i: root writes into any folder")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("which", ["run folder", "baked"])
def test_a_folder_that_cannot_be_written_is_one_line_and_loses_nothing(baked_copy, tmp_path, which):
    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    if which == "baked":  # damaged, so that it is baked again: into a folder that will not move
        model = folder / "baked" / "model.safetensors"
        model.write_bytes(model.read_bytes()[:1000])
    else:
        shutil.rmtree(folder / "baked")
    # what a bake made (the bake step's own stamp goes with its damaged output); in a folder
    # that takes no new file, run.json too, unchanged
    made = ("checkpoints", "merged", ".stamps", "examples.parquet", "config.yaml", "metrics.jsonl", "run.json")
    before = {p: p.read_bytes() for p in folder.rglob("*")
              if p.is_file() and p.relative_to(folder).parts[0] in made and p.name != "bake.json"}
    with unwritable(folder / "baked" if which == "baked" else folder):
        proc = cli("bake", str(project.plan_path), "--foreground", check=2)
    line = one_line(proc, "permissions")
    assert line.startswith(f"error: {folder / 'baked' if which == 'baked' else folder}:"), line
    if which == "baked":
        assert json.loads((folder / "run.json").read_text())["state"] == "failed"
        before = {p: b for p, b in before.items() if p.name != "run.json"}
    assert {p: p.read_bytes() for p in before} == before  # no output lost or changed


# -- a checkpoint whose meta.json is garbled (item 8's sibling) -------------------------------

def test_a_garbled_meta_json_is_set_aside_and_named_everywhere(baked_copy, references, tmp_path):
    from overbrainer.chat import Model
    from overbrainer.errors import RunStateError
    from overbrainer.trainers.checkpoint import DamagedMeta, read_meta

    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    final = folder / "checkpoints" / "step-000008"
    (final / "meta.json").write_text("[1, 2]")
    with pytest.raises(DamagedMeta, match="a JSON list, not an object"):
        read_meta(final)
    (final / "meta.json").write_bytes(os.urandom(600))
    listed = cli("checkpoints", str(folder))
    assert "Traceback" not in listed.stderr and "step-000006" in listed.stdout and "step-000008" not in listed.stdout
    assert listed.stderr.startswith("warning: ") and "step-000008/meta.json is damaged" in listed.stderr
    with pytest.raises(RunStateError, match="step-000008/meta.json is damaged: not JSON"):
        Model.checkpoint(folder, 8)
    proc = cli("bake", str(project.plan_path), "--foreground")
    assert "Traceback" not in proc.stderr and "JSONDecodeError" not in proc.stderr + proc.stdout
    assert "warning: step-000008 is damaged (its meta.json is not JSON" in proc.stdout + proc.stderr
    assert (folder / "checkpoints" / "corrupt-step-000008").is_dir()
    for name in ("checkpoints/step-000008/adapter_model.safetensors", "baked/model.safetensors"):
        assert (folder / name).read_bytes() == (references.folder() / name).read_bytes(), name


# -- a checkpoint whose state is not plain tensors (item 8) ---------------------------------

def test_a_trainer_state_that_weights_only_refuses_is_set_aside(baked_copy, tmp_path):
    import argparse

    import torch

    from overbrainer.hashing import hash_file

    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    reference = (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes()
    shutil.rmtree(folder / "checkpoints" / "step-000008")
    (folder / ".stamps" / "train.json").unlink()
    step6 = folder / "checkpoints" / "step-000006"
    torch.save({"optimizer": argparse.Namespace(x=1)}, step6 / "trainer_state.pt")  # not a plain tensor
    meta = json.loads((step6 / "meta.json").read_text())
    meta["files"]["trainer_state.pt"] = hash_file(step6 / "trainer_state.pt")  # its hash made to match
    (step6 / "meta.json").write_text(json.dumps(meta))
    report = bake_json(str(project.plan_path), "--foreground")
    assert report["state"] == "done"
    log = (folder / "log.txt").read_text()
    assert "weights_only" not in log and "Traceback" not in log
    assert "step-000006 is damaged (trainer_state.pt holds something else" in log and "resuming from step-000003" in log
    assert (folder / "checkpoints" / "corrupt-step-000006").is_dir()
    assert (folder / "checkpoints/step-000008/adapter_model.safetensors").read_bytes() == reference
