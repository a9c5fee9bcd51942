"""Sample generations while training (``train.samples``): the built-in trainer's greedy answers
in samples.jsonl, the same as the checkpoint of that step answers, shown by ``overbrainer
samples``; the weights are those of a run that takes none. (The trackers' copies, across a
killed and resumed bake: tests/test_trackers.py.)"""

from __future__ import annotations

import json

import yaml
from helpers import bake_json, cli

from overbrainer.chat import Model
from overbrainer.folder import RunFolder
from overbrainer.trainers import checkpoint as ckpt
from overbrainer.trainers.samples import read_samples


def test_samples_during_training(project, tmp_path, references):
    project.write(samples={"every": 3, "max_new_tokens": 6})
    bake_json(str(project.plan_path))
    folder = RunFolder(tmp_path / "runs" / "tiny")
    lines = read_samples(folder.samples)
    assert [line["step"] for line in lines] == [0, 3, 6, 8]  # the base, every 3 steps, the last
    prompts = [s["prompt"] for s in lines[0]["samples"]]
    assert len(prompts) == 4 and len(set(prompts)) == 4  # the first validation conversations'

    # what the checkpoint of step 3 answers, greedily, is what was sampled at step 3
    cfg_prompts = yaml.safe_load(folder.config.read_text())["samples"]["prompts"]
    model = Model.checkpoint(folder.root, 3)
    assert [model.chat(m, max_new_tokens=6) for m in cfg_prompts] == [s["answer"] for s in lines[1]["samples"]]
    assert any(s["answer"] for line in lines for s in line["samples"])

    # sampling changes no weight: the final checkpoint is the reference run's, which took none
    done, ref = ckpt.complete(folder.checkpoints)[-1][1], ckpt.complete(references.folder() / "checkpoints")[-1][1]
    assert ckpt.read_meta(done)["loss"] == ckpt.read_meta(ref)["loss"]
    assert (done / "adapter_model.safetensors").read_bytes() == (ref / "adapter_model.safetensors").read_bytes()

    shown = cli("samples", "tiny").stdout
    assert shown.count("  step 6  ") == 4 and prompts[1].splitlines()[0][:40] in shown
    as_json = json.loads(cli("samples", "tiny", "--json").stdout)
    assert [a["step"] for a in as_json[0]["answers"]] == [0, 3, 6, 8]

    # a new prompt on the finished run: config is written again, nothing retrains
    project.write(samples={"every": 3, "max_new_tokens": 6, "prompts": ["Hello?"]})
    again = bake_json(str(project.plan_path))
    assert "config" in again["ran"] and "train" not in again["ran"], again
    assert ckpt.complete(folder.checkpoints)[-1][1].stat().st_mtime_ns == done.stat().st_mtime_ns


def test_axolotl_refuses_samples_at_the_config_step(project):
    project.write(trainer="axolotl", samples={"every": 2})
    out = cli("bake", str(project.plan_path), check=None)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        'error: config: train.samples is taken by the built-in trainer only, not by axolotl; '
        'remove train.samples or set train.trainer to "builtin"')
