"""What tests share: running the real command line in its own process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
DEMO_DATA = REPO / "plans" / "data" / "pirate.jsonl"


def needs_cpp_compiler() -> None:
    """Skip where no C++ compiler is installed: inductor cannot build CPU kernels there (and
    train.compile "auto" stays off)."""
    import pytest

    from overbrainer.trainers.builtin.device import cpp_compiler

    if cpp_compiler() is None:
        pytest.skip("no C++ compiler here: inductor cannot build CPU kernels")


def cli(*args: str, check: int | None = 0, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real command line in its own process."""
    proc = subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check is not None and proc.returncode != check:
        raise AssertionError(
            f"exit {proc.returncode}, expected {check}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def cli_started(*args: str, env: dict | None = None) -> subprocess.Popen:
    """The real command line, started in its own process and left running."""
    return subprocess.Popen(
        [sys.executable, "-m", "overbrainer.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def configured(plan: Path, runs: Path | None = None) -> Path:
    """The run folder after the config step (resolve, base, split, config), run in this
    process: for a test about what those steps write, without the training after them."""
    from overbrainer.graph.driver import compile_bake, run_bake

    bake = compile_bake(plan, runs)
    done = run_bake(bake, "train:config")
    assert done.code == 0, done.error
    return bake.folder.root


def bake_json(*args: str, check: int | None = 0, env: dict | None = None) -> dict:
    proc = cli("bake", *args, "--json", check=check, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trainers_of(folder: Path) -> list[psutil.Process]:
    """The built-in trainer's processes working in `folder` (a job runs in its run folder)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            if "overbrainer.trainers.builtin" in cmd and Path(p.cwd()) == Path(folder):
                out.append(p)
        except psutil.Error:
            continue
    return out


@contextmanager
def held(processes: list[psutil.Process]):
    """Keep `processes` still (SIGSTOP) until the block ends, then let them go on (SIGCONT).

    A test that stops a run in the middle holds its trainer while the stop request travels,
    so the trainer cannot finish its last step first on a busy machine: the test is about
    what a stop does, not about winning a race against a fast tiny model."""
    for p in processes:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        release(processes)


def stop_held(folder: Path, trainers: list[psutil.Process], request: Path, *args: str) -> str:
    """`overbrainer stop FOLDER`, with the trainers held until the stop request has reached
    them as the file `request`; its output once it returned."""
    with held(trainers):
        proc = cli_started("stop", str(folder), *args)
        deadline = time.monotonic() + 120
        while not request.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return out


def last_step(metrics: Path) -> int:
    """The newest step a metrics file records (0 before the first)."""
    try:
        text = metrics.read_text()
    except OSError:
        return 0
    steps = [0]
    for raw in text.splitlines():
        try:
            steps.append(json.loads(raw).get("step") or 0)
        except (ValueError, AttributeError):
            continue  # a line being written
    return max(steps)


def hold_at_step(folder: Path, step: int, timeout: float = 300) -> list[psutil.Process]:
    """The built-in trainer working in `folder`, held still (SIGSTOP) once its metrics file
    there shows `step` (or a little more). A tiny model trains a step in milliseconds on an
    idle machine: faster than a test can watch it, or a stop can travel to it."""
    deadline = time.monotonic() + timeout
    while not (trainers := trainers_of(folder)):
        assert time.monotonic() < deadline, f"no trainer started in {folder}"
        time.sleep(0.01)
    while last_step(folder / "metrics.jsonl") < step:
        assert time.monotonic() < deadline, f"the trainer in {folder} did not reach step {step}"
        assert all(p.is_running() for p in trainers), f"the trainer in {folder} ended before step {step}"
        time.sleep(0.001)
    for p in trainers:
        os.kill(p.pid, signal.SIGSTOP)
    return trainers


def release(processes: list[psutil.Process]) -> None:
    """Let held processes go on (SIGCONT)."""
    for p in processes:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# the tiny plan every project fixture starts from (tests/conftest.py)
TINY_PLAN = {
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


class Project:
    def __init__(self, root: Path, plan: dict, write: bool = True):
        self.root = root
        self.plan = plan
        if write:
            self.write()

    @property
    def plan_path(self) -> Path:
        return self.root / "plan.json"

    def write(self, **train) -> Path:
        self.plan.setdefault("train", {}).update(train)
        self.plan_path.write_text(json.dumps(self.plan, indent=2))
        return self.plan_path


def make_project(root: Path, tiny_model: Path) -> Project:
    """A plan folder: the tiny model, 40 demo conversations, and a plan of 8 short steps."""
    root.mkdir(parents=True)
    shutil.copytree(tiny_model, root / "tiny")
    lines = DEMO_DATA.read_text().splitlines()[:40]
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return Project(root, json.loads(json.dumps(TINY_PLAN)))


def can_build_the_kernel() -> bool:
    """What the CPU kernels (the attention's backward, the loss) need: Linux on x86-64, a C++ compiler, and a CPU whose
    oneDNN packs bf16 operands for its brgemm: AMX (ATen's `could_pack`; AVX-512 BF16 alone
    is not enough)."""
    import platform

    from overbrainer.portable.common import cpu_flags

    flags = cpu_flags() or set()
    return (sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("c++") is not None
            and "amx_bf16" in flags)


def on_threads(counts: tuple[int, ...], compute) -> list:
    """`compute()` with torch's intra-op threads set to each of `counts` in turn, its results in
    that order; the process's own number of threads restored after, whatever happens."""
    import torch

    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(compute())
        return results
    finally:
        torch.set_num_threads(threads)
