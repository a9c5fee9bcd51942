"""Trackers mirror metrics.jsonl: read back from TensorBoard's event files, MLflow's file
store and W&B's offline run files, across a killed bake and its resume."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import psutil
import pytest
from helpers import bake_json, cli, hold_at_step

from overbrainer import journal
from overbrainer.errors import PlanError
from overbrainer.folder import RunFolder
from overbrainer.plan import load_plan
from overbrainer.trackers import mlflow_uri
from overbrainer.trainers.samples import read_samples

SECRET = "wandb-key-that-must-not-be-written-0123456789"


def test_unknown_tracker_gets_did_you_mean(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"name": "x", "base": "b", "data": "d.jsonl", "report_to": ["tensorbord"]}))
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert "report_to.0: unknown tracker 'tensorbord'; did you mean 'tensorboard'?" in str(e.value)


def test_trackers_mirror_a_killed_and_resumed_bake(project, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    project.plan["report_to"] = ["tensorboard", "mlflow", "wandb"]
    project.write(samples={"every": 4, "max_new_tokens": 3})  # samples at steps 0, 4 and 8
    folder = RunFolder(tmp_path / "runs" / "tiny")

    # killed at step 5 (its last checkpoint at 3): the resume rewrites 4 and 5
    cli("bake", str(project.plan_path), "--detach")
    held = hold_at_step(folder.root, 5)
    deadline = time.monotonic() + 120
    while (journal.read(folder).get("trackers") or {}).get("step", 0) < 5:
        assert time.monotonic() < deadline, "the bake did not mirror step 5"
        time.sleep(0.05)
    # drawn at checkpoint 3, before the kill; the bake draws it after it mirrors the lines
    # it read in the same poll, so one slow to poll (a busy machine) mirrors step 5 first
    while not folder.loss_plot.exists():
        assert time.monotonic() < deadline, "the bake did not draw the loss curve at checkpoint 3"
        time.sleep(0.05)
    assert folder.loss_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    supervisor = psutil.Process(journal.read(folder)["process"]["pid"])
    supervisor.send_signal(signal.SIGKILL)
    for p in held:
        os.kill(p.pid, signal.SIGKILL)
    supervisor.wait(30)
    first_ids = journal.read(folder)["trackers"]
    report = bake_json(str(project.plan_path))
    assert report["state"] == "done"

    metrics = [json.loads(x) for x in folder.metrics.read_text().splitlines()]
    loss = {m["step"]: m["loss"] for m in metrics if "step" in m}
    assert sorted(loss) == list(range(1, 9))
    kept = journal.read(folder)["trackers"]
    assert kept["step"] == 8 and kept["mlflow"] == first_ids["mlflow"] and kept["wandb"] == first_ids["wandb"]

    # TensorBoard: each step once, the values of metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder.tensorboard))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb] == list(range(1, 9))
    assert all(abs(v - loss[s]) < 1e-6 for s, v in tb)
    assert "eval_loss" in acc.Tags()["scalars"] and "plan" in str(acc.Tags()["tensors"])
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    shots = {line["step"]: line["samples"] for line in read_samples(folder.samples)}
    assert sorted(texts) == sorted(shots) == [0, 4, 8]
    assert all(s["prompt"].splitlines()[0] in texts[step] for step in shots for s in shots[step])

    # MLflow: one run, the same one before and after the kill, with plan, tag and checkpoints
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri(folder))
    runs = client.search_runs([client.get_experiment_by_name("overbrainer").experiment_id])
    assert [r.info.run_id for r in runs] == [kept["mlflow"]["run_id"]]
    run = runs[0]
    assert run.data.tags["overbrainer.fingerprint"] == kept["fingerprint"]
    assert run.data.params["train.learning_rate"] == "0.003" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert all(abs(m.value - loss[m.step]) < 1e-6 for m in history)
    saved = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert saved == ["checkpoints/step-000003", "checkpoints/step-000006", "checkpoints/step-000008"]
    logged = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert logged == ["samples/step-000000.json", "samples/step-000004.json", "samples/step-000008.json"]

    # W&B offline: two run files (before and after the kill) of one run id, each step once
    files = sorted(folder.wandb.glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{kept['wandb']['run_id']}.wandb" for f in files)
    steps = [s for f in files for s, item in wandb_history(f) if "loss" in item]
    # W&B's service writes its log on its own time: what it held when the bake was killed
    # is lost with it (some or all of steps 1 to 5, by how busy the machine is); after the
    # resume the same run goes on, and no step is written twice
    assert steps == sorted(set(steps)) and set(steps) <= set(range(1, 9)) and steps[-3:] == [6, 7, 8], steps
    tables = [s for f in files for s, item in wandb_history(f) if item.get("samples/_type") == "table-file"]
    assert tables == sorted(set(tables)) and set(tables) <= {0, 4, 8} and tables[-1] == 8, tables

    # the key came from the environment and went nowhere
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the W&B key was written to {path}"


def test_tracker_that_fails_mid_run_warns_once(tmp_path):
    pytest.importorskip("mlflow")
    from overbrainer.trackers import Mirror

    folder = RunFolder(tmp_path / "runs" / "x")
    folder.root.mkdir(parents=True)
    journal.update(folder, state="running")  # as the bake that follows the trainer has it
    said = []
    mirror = Mirror(["mlflow"], folder, "f" * 64, {"name": "x"}, said.append)
    line = {"step": 1, "tokens": 10, "loss": 2.0, "lr": 0.1, "eval_loss": None, "seconds": 1.0, "phase": "warmup"}
    mirror.lines([line])
    # the store goes away under it (a disk unmounted): a file where its folder was

    (folder.mlruns / "mlflow.db").write_bytes(b"not a database any more")
    mirror.lines([{**line, "step": 2}])
    mirror.lines([{**line, "step": 3}])
    mirror.close(finished=True)
    assert len(said) == 1 and said[0].startswith("warning: mlflow stopped mirroring"), said
    assert journal.read(folder)["trackers"]["step"] == 3  # the others (none here) went on


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of each history record of a W&B run file: its transaction log
    (LevelDB's log format: 32 KiB blocks of records with a 7-byte header, after a 7-byte
    ``:W&B`` file header), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, records, part = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            records.append(part + chunk)
        elif kind == 0:
            pos += block - pos % block if pos % block else 0
    out = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out.append((record.history.step.num, items))
    return out
