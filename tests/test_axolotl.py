"""The Axolotl trainer, for real: Axolotl 0.19.0 in its own environment, on the tiny model.

The environment (``overbrainer/trainers/axolotl_env.py``) is built once per checkout by the real builder,
at ``.venv/overbrainer-tools/axolotl-0.19.0`` (or ``$OVERBRAINER_AXOLOTL_VENV``): a minute
or two (uv) and 3.7 GB the first time, which is why the tests that use it are marked slow
(CI runs them: pytest runs without -m). They skip, saying why, only when no package
index can be reached to build it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from helpers import bake_json, cli, configured

from overbrainer.portable import axolotl_plugin, script
from overbrainer.trainers import axolotl_env as tools
from overbrainer.trainers.axolotl import Axolotl, AxolotlConfigError

REPO = Path(__file__).resolve().parent.parent
LOCAL_ENV = REPO / ".venv" / "overbrainer-tools" / f"axolotl-{tools.AXOLOTL_VERSION}"
# Axolotl (Hugging Face Trainer) restores weights, optimizer, scheduler, data position and
# RNG on resume, but not bit for bit: a resumed run's losses stay this close to those of
# a run never stopped (measured: equal to 6 decimals on CPU; the per-step change is ~1e-2)
LOSS_TOLERANCE = 1e-3


# -- without Axolotl: what overbrainer writes for it ------------------------------------------


def test_plugin_phase_is_the_built_in_trainers():
    """One schedule phase for both trainers: the same function, with the WSD boundaries."""
    from overbrainer.trainers.builtin import loop

    assert axolotl_plugin.phase_of is loop.phase_of
    phases = [axolotl_plugin.phase_of(i, 2, 3) for i in range(7)]
    assert phases == ["warmup", "warmup", "stable", "stable", "stable", "decay", "decay"]
    assert axolotl_plugin.phase_of(0, 0, 0) == "decay"


def test_config_yaml_trains_on_the_train_split_and_evaluates_on_validation(project):
    """config.yaml is the config Axolotl runs: its datasets is train.parquet (the train rows of
    examples.parquet, in its order), its test_datasets validation.parquet, and nothing in it
    is the built-in trainer's alone (device, deterministic: on its command line)."""
    import pyarrow.parquet as pq

    project.write(device="cpu", deterministic=True)
    run_dir = configured(project.plan_path)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    dataset = {"ds_type": "parquet", "type": "chat_template", "field_messages": "messages",
               "roles_to_train": ["assistant"], "train_on_eos": "turn"}
    assert cfg["datasets"] == [{"path": "train.parquet", **dataset}]
    assert cfg["test_datasets"] == [{"path": "validation.parquet", "split": "train", **dataset}]
    assert cfg["val_set_size"] == 0.0 and cfg["eval_strategy"] == "steps" and cfg["save_strategy"] == "steps"
    assert cfg["auto_resume_from_checkpoints"] is True and cfg["logging_steps"] == 1
    assert cfg["dataset_prepared_path"].startswith("axolotl-job/prepared/")
    assert "device" not in cfg and "deterministic" not in cfg and "plugins" not in cfg
    examples = pq.read_table(run_dir / "examples.parquet").to_pylist()
    for split in ("train", "validation"):
        rows = pq.read_table(run_dir / f"{split}.parquet").to_pylist()
        assert rows and rows == [{"id": r["id"], "messages": r["messages"]} for r in examples if r["split"] == split]


def test_no_validation_rows_means_no_evaluation_in_config_yaml(project):
    project.plan["split"]["validation"] = 0
    project.write()
    run_dir = configured(project.plan_path)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    # Axolotl refuses eval_steps or an eval_strategy without an eval set
    assert "test_datasets" not in cfg and "eval_steps" not in cfg and "eval_strategy" not in cfg


def test_the_built_in_trainer_is_told_the_device_on_its_command_line():
    from overbrainer.trainers.builtin import Builtin

    assert Builtin().commands() == [["python", "-m", "overbrainer.trainers.builtin", "config.yaml"]]
    assert Builtin(device="cpu", deterministic=True).commands() == [
        ["python", "-m", "overbrainer.trainers.builtin", "config.yaml", "--device", "cpu", "--deterministic"]]


def test_unknown_keys_are_named_at_every_level():
    known = {"config": ["base_model", "datasets"], "dataset": ["path", "type"]}
    cfg = {"base_model": "b", "lora_rr": 4, "datasets": [{"path": "p", "typ": "x"}]}
    assert axolotl_plugin.unknown_keys(cfg, known) == ["lora_rr", "datasets[0].typ"]


def test_commands_run_the_tools_python_and_merge_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(tools.VENV_ENV, str(tmp_path / "env"))
    trainer = Axolotl(processes=1)
    trainer.max_steps, trainer.lora = 8, True
    python = str(tmp_path / "env" / "bin" / "python")
    plugins = '--plugins=["overbrainer_portable.axolotl_plugin.OverbrainerPlugin"]'
    assert trainer.commands() == [
        [python, "-m", "axolotl.cli.train", "config.yaml", plugins],
        [python, "-m", "axolotl.cli.merge_lora", "config.yaml", plugins, "--lora_model_dir=checkpoints/checkpoint-8",
         "--output_dir=axolotl-job"],
    ]
    assert trainer.stages() == ["train", "merge"] and trainer.stop_marker() == "stopped.json"
    two = Axolotl(processes=2)
    two.max_steps, two.lora = 8, False
    assert two.commands() == [[python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                               "-m", "axolotl.cli.train", "config.yaml", plugins]]
    env = trainer.env("/runs/x")
    assert env["AXOLOTL_DO_NOT_TRACK"] == "1" and env["PYTHONPATH"] == "/runs/x/axolotl-job"
    assert env["PATH"].startswith(str(tmp_path / "env" / "bin") + os.pathsep)
    assert trainer.metrics_required() and trainer.caches_tools()


def test_a_job_staged_to_run_elsewhere_needs_no_tools_here(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from overbrainer.inputs.conversations import SCHEMA

    monkeypatch.setenv(tools.VENV_ENV, str(tmp_path / "never-built"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "arr"}]
    rows = [{"id": str(i), "split": "validation" if i == 0 else "train", "messages": chat, "source": "x"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp_path / "examples.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:], schema=SCHEMA), tmp_path / "train.parquet")
    cfg = {"base_model": "../base", "max_steps": 2, "output_dir": "checkpoints", "adapter": "lora", "eval_steps": 1,
           "datasets": [{"path": "train.parquet", "ds_type": "parquet", "type": "chat_template"}],
           "plugins": ["axolotl.integrations.liger.LigerPlugin"]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    trainer = Axolotl()
    trainer.prepare(tmp_path, "/elsewhere/runs/tiny")
    assert not (tmp_path / "never-built").exists()
    assert [c[0] for c in trainer.commands()] == ["python", "python"]  # the job's own interpreter there
    env = trainer.env("/elsewhere/runs/tiny")
    assert "PATH" not in env and env["PYTHONPATH"] == "/elsewhere/runs/tiny/axolotl-job"
    # the config's own plugins too, after overbrainer's; config.yaml is left as it is
    assert trainer.commands()[0][-1] == ('--plugins=["overbrainer_portable.axolotl_plugin.OverbrainerPlugin", '
                                         '"axolotl.integrations.liger.LigerPlugin"]')
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg
    assert (tmp_path / "axolotl-job" / "overbrainer_portable" / "axolotl_plugin.py").is_file()


def test_several_processes_need_as_many_gpus(tmp_path, monkeypatch):
    from overbrainer.errors import OverbrainerError

    monkeypatch.setattr(tools, "nvidia_gpus", lambda: 0)
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    (tmp_path / "config.yaml").write_text("max_steps: 4\nadapter: lora\n")
    with pytest.raises(OverbrainerError, match="train.processes is 2, but the Axolotl trainer runs one process per GPU"):
        Axolotl(processes=2).prepare(tmp_path, str(tmp_path))


def test_the_environment_is_installed_by_uv_with_pips_index_settings(monkeypatch):
    """uv (a dependency) installs Axolotl; pip's index settings from the environment go
    along as uv's flags, since uv reads only its own."""
    assert tools._uv() and Path(tools._uv()).is_file()
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://a.example/simple https://b.example/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    assert tools._pip_indexes_for_uv() == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "https://a.example/simple", "--extra-index-url", "https://b.example/simple",
        "--find-links", "/opt/wheels",
    ]


def test_no_examples_is_its_own_error(tmp_path):
    from overbrainer.trainers import NoTrainingData

    (tmp_path / "config.yaml").write_text("max_steps: 1\n")
    with pytest.raises(NoTrainingData, match="run `overbrainer split PLAN` first"):
        Axolotl().prepare(tmp_path, str(tmp_path))


# -- with Axolotl ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def axolotl_venv(pytestconfig) -> Path:
    """The tools environment, built by tools.py's own builder once per checkout, its
    phases shown as they go (pip's output goes to a log file beside it)."""
    env = Path(os.environ.get(tools.VENV_ENV) or LOCAL_ENV)
    if not (env / "bin" / "python").exists():
        _skip_without_an_index()
        log = env.parent / f"{env.name}.build.log"
        env.parent.mkdir(parents=True, exist_ok=True)
        capture = pytestconfig.pluginmanager.getplugin("capturemanager")
        with pytest.MonkeyPatch.context() as mp, capture.global_and_fixture_disabled():
            mp.setenv(tools.VENV_ENV, str(env))
            print(f"\n(pip's output: {log})", flush=True)
            tools.axolotl_env(say=lambda line: print(line, flush=True), log=log)
    return env


def _skip_without_an_index() -> None:
    with tempfile.TemporaryDirectory() as d:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                 f"axolotl=={tools.AXOLOTL_VERSION}", "-d", d],
                capture_output=True, text=True, timeout=120,
            )
        except subprocess.TimeoutExpired:
            pytest.skip("cannot build the Axolotl environment: pip found no package index in 120 s (no network)")
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"cannot build the Axolotl environment: pip cannot download axolotl=={tools.AXOLOTL_VERSION} ({why})")


@pytest.fixture
def axolotl_project(project, axolotl_venv, monkeypatch):
    monkeypatch.setenv(tools.VENV_ENV, str(axolotl_venv))
    project.write(trainer="axolotl")
    return project


def check(python: Path, config: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """Axolotl's own validation of `config`, in its environment, as the job would see it."""
    return subprocess.run(
        [str(python), *script("axolotl_plugin", "check", str(config))],
        capture_output=True, text=True, cwd=run_dir, timeout=600,
        env={**os.environ, **tools.QUIET_ENV},
    )


@pytest.mark.slow  # the Axolotl environment: built once, minutes; then an import of Axolotl
@pytest.mark.axolotl
def test_config_yaml_passes_axolotl_validation_as_it_is(axolotl_project, axolotl_venv):
    """The run's own config.yaml, untouched, through Axolotl 0.19.0's validate_config, every
    key one Axolotl keeps: what `axolotl train config.yaml` runs; with no validation rows too."""
    for validation in (0, 0.2):  # the last, the plan's own, stays for what follows
        axolotl_project.plan["split"]["validation"] = validation
        axolotl_project.write(trainer="axolotl")
        run_dir = configured(axolotl_project.plan_path)
        done = check(axolotl_venv / "bin" / "python", run_dir / "config.yaml", run_dir)
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert axolotl_plugin.unknown_keys(cfg, tools.axolotl_keys(axolotl_venv)) == []
        assert ("test_datasets" in cfg) == (validation > 0)
    # Axolotl's own dataset loading reads the two files: the train rows only, and the
    # validation rows as its eval set (Axolotl's load_datasets, in its environment)
    run_dir = configured(axolotl_project.plan_path)
    Axolotl().prepare(run_dir, str(run_dir))
    rows = subprocess.run(
        [str(axolotl_venv / "bin" / "python"), "-c", LOAD_DATASETS, "config.yaml"],
        capture_output=True, text=True, cwd=run_dir, timeout=600, env={**os.environ, **tools.QUIET_ENV},
    )
    assert rows.returncode == 0, rows.stdout[-2000:] + rows.stderr[-3000:]
    import pyarrow.parquet as pq

    split = pq.read_table(run_dir / "examples.parquet", columns=["split"]).column("split").to_pylist()
    assert json.loads(rows.stdout.strip().splitlines()[-1]) == {"train": split.count("train"),
                                                                "eval": split.count("validation")}


# the train and eval rows Axolotl itself loads from a config (its CLI's own loading path)
LOAD_DATASETS = """
import json, sys
from axolotl.cli.config import load_cfg
from axolotl.common.datasets import load_datasets
from axolotl.cli.args import TrainerCliArgs
cfg = load_cfg(sys.argv[1])
meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
print(json.dumps({"train": len(meta.train_dataset), "eval": len(meta.eval_dataset or [])}))
"""


@pytest.mark.slow  # an import of Axolotl, in its environment
@pytest.mark.axolotl
def test_config_typo_is_refused_in_one_line(axolotl_project, axolotl_venv):
    run_dir = configured(axolotl_project.plan_path)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text() + "lora_rr: 8\n")
    with pytest.raises(AxolotlConfigError) as refused:
        Axolotl().prepare(run_dir, str(run_dir))
    message = str(refused.value)
    assert "\n" not in message and "lora_rr" in message and "not an Axolotl 0.19.0 setting" in message
    # Axolotl itself would take it without a word; the check names it
    job = run_dir / "typo.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["datasets"][0]["feild_messages"] = "messages"
    job.write_text(yaml.safe_dump(cfg))
    done = check(axolotl_venv / "bin" / "python", job, run_dir)
    assert done.returncode == 2
    lines = done.stdout.strip().splitlines()
    assert any("lora_rr: not an Axolotl setting" in line for line in lines), done.stdout
    assert any("datasets[0].feild_messages: not an Axolotl setting" in line for line in lines), done.stdout
    # and where overbrainer does not check first (a job run elsewhere), the plugin refuses it
    # as Axolotl loads it, before any training, in the one line the bake tells
    assert not (run_dir / "axolotl-job").exists()  # prepare wrote nothing it refused
    config.write_text(config.read_text().replace("lora_rr: 8\n", ""))
    trainer = Axolotl()
    trainer.prepare(run_dir, str(run_dir))
    config.write_text(config.read_text() + "lora_rr: 8\n")
    done = subprocess.run(trainer.commands()[0], cwd=run_dir, env={**os.environ, **trainer.env(str(run_dir))},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    said = (run_dir / "trainer-error.txt").read_text().strip()
    assert said.startswith("lora_rr: not an Axolotl setting") and "\n" not in said
    assert not (run_dir / "checkpoints").exists()


def metric_lines(folder: Path) -> list[dict]:
    return [m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step" in m]


@pytest.mark.slow  # Axolotl trains in its own process: about 3 minutes a bake on 2 cores
@pytest.mark.axolotl
def test_bake_end_to_end_then_stop_and_resume(axolotl_project, axolotl_venv, tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from overbrainer import Run

    started = time.monotonic()
    report = bake_json(str(axolotl_project.plan_path))
    baked_in = time.monotonic() - started
    assert report["state"] == "done", report
    assert report["ran"] == ["resolve", "base", "split", "config", "train", "merge", "bake"]
    folder = Path(report["folder"])
    run = Run(folder)

    # metrics: the built-in trainer's lines, after the job's stage events
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["stage"] == "train" and [r["stage"] for r in records if "stage" in r] == ["train", "merge"]
    lines = metric_lines(folder)
    assert [m["step"] for m in lines] == list(range(1, 9))
    for m in lines:
        assert {"step", "tokens", "loss", "lr", "seconds", "phase"} <= set(m) and m["loss"] > 0
    assert [m["step"] for m in lines if "eval_loss" in m] == [4, 8]
    assert all(m["eval_loss"] > 0 for m in lines if "eval_loss" in m)
    assert [m["phase"] for m in lines] == ["warmup"] + ["stable"] * 5 + ["decay"] * 2
    # the schedule of config.yaml, exactly: warmup from 0 over 1 step, stable, linear decay
    assert [m["lr"] for m in lines] == pytest.approx([0.0] + [0.003] * 6 + [0.0015])
    assert 0 < lines[0]["tokens"] < lines[-1]["tokens"]

    # checkpoints: Axolotl's checkpoint-N, each with overbrainer's sidecar
    assert run.checkpoints() == [3, 6, 8]
    meta = json.loads((folder / "checkpoints/checkpoint-8/meta.json").read_text())
    assert meta["step"] == 8 and meta["decayed"] is True and meta["phase"] == "decay" and meta["trainer"] == "axolotl"
    assert meta["loss"] == lines[-1]["loss"] and meta["eval_loss"] == lines[-1]["eval_loss"]
    assert json.loads((folder / "checkpoints/checkpoint-3/meta.json").read_text())["decayed"] is False
    train_stamp = json.loads((folder / ".stamps" / "train.json").read_text())
    assert train_stamp["summary"]["checkpoint"] == "checkpoint-8"
    early = run.checkpoint(6)  # the base model + step 6's adapter
    assert early.chat("hi", max_new_tokens=3) is not None

    # merged/: Axolotl's merge-lora, adopted; loadable, the adapter in it, the tokens set
    assert not (folder / "axolotl-job" / "merged").exists()  # moved to merged/, not merged again
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    q = merged.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q, base.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(merged.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    tok = AutoTokenizer.from_pretrained(folder / "baked")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert merged.generation_config.eos_token_id == tok.eos_token_id
    assert (folder / "baked" / "model.safetensors").is_file() and (folder / "baked" / "README.md").is_file()

    # a rerun runs nothing
    why = cli("bake", str(axolotl_project.plan_path), "--dry-run").stdout
    again = bake_json(str(axolotl_project.plan_path))
    assert again["ran"] == [] and again["state"] == "done", why

    # stop, then resume: the same run, within the tolerance
    runs = tmp_path / "stopped"
    cli("bake", str(axolotl_project.plan_path), "--detach", "--runs", str(runs))
    stopped = Run(runs / "tiny")
    deadline = time.monotonic() + 600
    while (stopped.progress()["step"] or 0) < 4:
        assert time.monotonic() < deadline, "the detached Axolotl run never reached step 4"
        assert stopped.state not in ("failed", "done"), stopped.status
        time.sleep(0.2)
    out = cli("stop", str(stopped.folder.root))
    assert "stopped" in out.stdout, out.stdout
    assert stopped.state == "stopped" and stopped.status["reason"].startswith("stopped at step")
    at = json.loads((stopped.folder.root / "stopped.json").read_text())
    assert 4 <= at["step"] < 8 and at["steps"] == 8
    assert stopped.checkpoints()[-1] == at["step"]  # the stop saved a checkpoint where it stopped
    assert [m["step"] for m in metric_lines(stopped.folder.root)] == list(range(1, at["step"] + 1))
    assert not (stopped.folder.root / "merged").exists()  # nothing after training ran
    stopped.resume()
    stopped.wait(poll=0.5, show=False)
    assert stopped.state == "done", stopped.status
    assert f"resuming from checkpoint-{at['step']}" in (stopped.folder.root / "log.txt").read_text()
    resumed = metric_lines(stopped.folder.root)
    assert [m["step"] for m in resumed] == list(range(1, 9))  # lines past the checkpoint never doubled
    assert [m["lr"] for m in resumed] == [m["lr"] for m in lines]  # the scheduler's state came back
    assert [m["tokens"] for m in resumed] == [m["tokens"] for m in lines]  # so did the data position
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, lines)]
    assert max(diffs) <= LOSS_TOLERANCE, diffs
    evals = [(a.get("eval_loss"), b.get("eval_loss")) for a, b in zip(resumed, lines) if "eval_loss" in b]
    assert all(abs(a - b) <= LOSS_TOLERANCE for a, b in evals), evals
    assert stopped.checkpoints()[-1] == 8 and (stopped.folder.root / "baked" / "model.safetensors").is_file()
    print(f"\naxolotl: tiny bake {baked_in:.0f} s; resumed losses within {max(diffs):.2e} of the unstopped run")
