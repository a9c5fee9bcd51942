"""Hermetic tests: every test gets its own cache, runs folder and offline hub; tiny models
are built once per session, never downloaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DEMO_DATA, REPO  # noqa: E402,F401
from tiny import make_tiny_llama  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--kill-matrix", action="store_true", help="run every case of tests/reliability/")


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERBRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OVERBRAINER_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def project(tmp_path, tiny_model):
    """A plan folder: the tiny model, 40 demo conversations, and a plan of 8 short steps."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copytree(tiny_model, root / "tiny")
    lines = DEMO_DATA.read_text().splitlines()[:40]
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    plan = {
        "name": "tiny",
        "base": "./tiny",
        "data": "chats.jsonl",
        "split": {"validation": 0.2},
        "train": {
            "steps": 8,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "sequence_len": 96,
            "learning_rate": 0.003,
            "save_every": 3,
            "eval_every": 4,
            "lora_r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.1,
        },
    }
    return Project(root, plan)


class Project:
    def __init__(self, root: Path, plan: dict):
        self.root = root
        self.plan = plan
        self.write()

    @property
    def plan_path(self) -> Path:
        return self.root / "plan.json"

    def write(self, **train) -> Path:
        self.plan.setdefault("train", {}).update(train)
        self.plan_path.write_text(json.dumps(self.plan, indent=2))
        return self.plan_path
