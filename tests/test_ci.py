"""Incremental reruns in CI: a run folder cached, restored elsewhere and checked.

A finished run folder is tarred (as ``actions/cache`` does, ``tar --posix``) or copied
with ``cp -a`` into another runs folder: new inodes, same content and mtimes. Restored, it
reruns nothing and reads no weights; restored with every mtime changed, it hashes its
outputs once, finds the same content, reruns nothing, and the next check reads nothing.
``bake --check`` is the CI gate: exit 0 when up to date, 1 when something would run.

One real bake of the tiny plan is made per session (`finished`) and shared, as a tarball,
with the tests here and in test_graph.py; each test restores it into its own runs folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import bake_json, cli

REPO = Path(__file__).resolve().parent.parent
WEIGHTS = (".safetensors", ".pt", ".bin", ".gguf")
HEAVY = ("torch", "transformers", "peft", "pyarrow")


@dataclass
class Finished:
    plan: Path  # the plan file (its project folder: data and base model, never changed)
    cache: Path  # a `tar --posix` of the runs folder, as a CI cache keeps it
    report: dict  # the bake's --json report

    def restore(self, runs: Path, how: str = "tar") -> Path:
        """The cached runs folder, unpacked into `runs`; the run folder."""
        runs.mkdir(parents=True, exist_ok=True)
        if how == "tar":
            subprocess.run(["tar", "-xf", str(self.cache), "-C", str(runs)], check=True)
        else:
            unpacked = self.cache.with_suffix("")
            if not unpacked.exists():
                unpacked.mkdir()
                subprocess.run(["tar", "-xf", str(self.cache), "-C", str(unpacked)], check=True)
            for child in unpacked.iterdir():
                subprocess.run(["cp", "-a", str(child), str(runs)], check=True)
        return runs / "tiny"


_FINISHED: dict[str, Finished] = {}


@pytest.fixture
def finished(project, tmp_path) -> Finished:
    return finished_bake(project, tmp_path)


def finished_bake(project, tmp_path) -> Finished:
    """A finished bake of the tiny plan, made once per session (by the first test that
    asks, in its folders), kept as a CI cache."""
    if "tiny" not in _FINISHED:
        runs = tmp_path / "first-bake"
        report = bake_json(str(project.plan_path), "--foreground", "--runs", str(runs))
        assert report["state"] == "done" and len(report["ran"]) == 7
        cache = tmp_path / "runs-cache.tar"
        subprocess.run(["tar", "--posix", "-cf", str(cache), "-C", str(runs), "."], check=True)
        _FINISHED["tiny"] = Finished(project.plan_path, cache, report)
    return _FINISHED["tiny"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every stamp's bytes: what a run that reran nothing leaves as it was."""
    return {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()}


class Reads:
    """What this process hashes and opens while it is watched: `hash_file` calls, and
    every file opened from Python (an audit hook: it sees open(), os.open, io.open)."""

    _active: list[Reads] = []
    _hooked = False

    def __init__(self, monkeypatch):
        from overbrainer import hashing

        self.hashed: list[str] = []
        self.opened: list[str] = []
        real = hashing.hash_file

        def counting(path):
            self.hashed.append(os.path.abspath(path))
            return real(path)

        monkeypatch.setattr(hashing, "hash_file", counting)
        if not Reads._hooked:
            sys.addaudithook(Reads._hook)
            Reads._hooked = True

    @staticmethod
    def _hook(event, args):
        if event == "open" and Reads._active and isinstance(args[0], (str, os.PathLike)):
            Reads._active[-1].opened.append(os.path.abspath(args[0]))

    def __enter__(self):
        Reads._active.append(self)
        return self

    def __exit__(self, *exc):
        Reads._active.remove(self)

    def weights(self) -> list[str]:
        return [p for p in self.hashed + self.opened if p.endswith(WEIGHTS)]


def outputs_in(folder: Path) -> set[str]:
    """Every output file the run folder's stamps list (the base step's lie in the base)."""
    out = set()
    for stamp in (folder / ".stamps").iterdir():
        data = json.loads(stamp.read_text())
        if not data["root"]:
            out.update(str(folder / e["path"]) for e in data["outputs"])
    return out


def compile_here(plan: Path, runs: Path):
    from overbrainer.graph.driver import compile_bake

    return compile_bake(plan, runs=runs)


@pytest.mark.parametrize("how", ["tar", "cp"])
def test_restored_run_reruns_nothing_and_reads_no_weights(finished, tmp_path, monkeypatch, how):
    from overbrainer.graph.driver import dry_run, run_bake

    folder = finished.restore(tmp_path / "runs", how)
    merged = next((folder / "merged").glob("*.safetensors"))
    original = Path(finished.report["folder"]) / "merged" / merged.name
    assert merged.stat().st_ino != original.stat().st_ino  # a copy: another inode
    assert merged.stat().st_mtime_ns == original.stat().st_mtime_ns  # with its mtime kept
    stamps, cache_mtime = snapshot(folder), (folder / ".hashes.json").stat().st_mtime_ns
    with Reads(monkeypatch) as reads:
        rows = dry_run(compile_here(finished.plan, tmp_path / "runs"))
        bake = compile_here(finished.plan, tmp_path / "runs")
        done = run_bake(bake)
        assert done.code == 0, done.error
    assert [r for r in rows if r["run"]] == []
    assert done.ran == [] and sorted(done.skipped) == sorted(finished.report["ran"])
    assert reads.hashed == [], "a restored run with its mtimes kept hashes nothing"
    assert reads.weights() == []
    assert not [p for p in reads.opened if p.startswith(str(folder / "checkpoints"))]
    assert snapshot(folder) == stamps
    assert (folder / ".hashes.json").stat().st_mtime_ns == cache_mtime  # nothing new to remember

    check = cli("bake", str(finished.plan), "--check", "--json")  # and the CLI agrees
    assert json.loads(check.stdout.splitlines()[-1])["up_to_date"] is True


def test_restored_run_with_new_mtimes_rehashes_once(finished, tmp_path, monkeypatch):
    from overbrainer.graph.driver import dry_run

    folder = finished.restore(tmp_path / "runs")
    later = 1_900_000_000_000_000_000
    for dirpath, _, files in os.walk(folder):
        for name in files:
            os.utime(Path(dirpath) / name, ns=(later, later))
    stamps = snapshot(folder)

    with Reads(monkeypatch) as first:
        rows = dry_run(compile_here(finished.plan, tmp_path / "runs"))
    assert [r for r in rows if r["run"]] == []  # the same content: nothing reruns
    assert set(first.hashed) == outputs_in(folder)  # each output read once, nothing else
    assert len(first.hashed) == len(set(first.hashed))

    with Reads(monkeypatch) as second:
        rows = dry_run(compile_here(finished.plan, tmp_path / "runs"))
    assert [r for r in rows if r["run"]] == []
    assert second.hashed == [] and second.weights() == [], "the first check remembered the hashes"

    again = bake_json(str(finished.plan))  # the CLI's own bake: up to date, nothing run
    assert again["ran"] == [] and again["state"] == "done"
    assert snapshot(folder) == stamps


def test_bake_check_exit_codes_and_json(finished, tmp_path):
    plan = str(finished.plan)
    fresh = cli("bake", plan, "--check", "--json", check=1)  # nothing baked here yet
    report = json.loads(fresh.stdout.splitlines()[-1])
    assert report["up_to_date"] is False
    assert report["would_run"] == ["resolve", "base", "split", "config", "train", "merge", "bake"]
    assert {r["step"]: r["why"] for r in report["steps"]}["config"] == "after base, split"
    assert "would run resolve" in fresh.stderr
    assert not (tmp_path / "runs").exists(), "a check writes no run folder"

    finished.restore(tmp_path / "runs")
    ok = cli("bake", plan, "--check")
    assert "everything is up to date" in ok.stdout

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "base": "./nowhere", "data": "none.jsonl"}))
    err = cli("bake", str(bad), "--check", check=2)
    assert err.stderr.startswith("error: ") and len(err.stderr.strip().splitlines()) == 1


def test_check_imports_no_heavy_library(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "overbrainer.cli", "bake", str(finished.plan), "--check"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}
    # the run folder remembers the validated plan: no pydantic while the plan file is as it was
    assert "overbrainer.remembered" in imported and "pydantic" not in imported and "overbrainer.plan" not in imported


def test_a_plan_edited_after_its_bake_is_validated_again(finished, tmp_path):
    folder = finished.restore(tmp_path / "runs")
    memo = json.loads((folder / ".plan.json").read_text())
    assert memo["plan"]["train"]["learning_rate"] == json.loads(finished.plan.read_text())["train"]["learning_rate"]
    plan = tmp_path / "edited" / "plan.json"
    shutil.copytree(finished.plan.parent, plan.parent)
    data = json.loads(plan.read_text())
    data["train"]["learnig_rate"] = data["train"].pop("learning_rate")
    plan.write_text(json.dumps(data, indent=1))
    err = cli("bake", str(plan), "--check", "--runs", str(tmp_path / "runs"), check=2)
    assert "train.learnig_rate: unknown setting; did you mean train.learning_rate?" in err.stderr
    data["train"]["learning_rate"] = data["train"].pop("learnig_rate") * 2
    plan.write_text(json.dumps(data, indent=1))
    out = cli("bake", str(plan), "--check", "--runs", str(tmp_path / "runs"), check=1)
    assert "would run config" in out.stdout and "train.learning_rate" in out.stdout
    assert "would run split" not in out.stdout
    memo = json.loads((folder / ".plan.json").read_text())
    assert memo["plan"]["train"]["learning_rate"] == data["train"]["learning_rate"]  # remembered anew


def test_ci_recipe_changed_data_reruns_split_and_after(finished, tmp_path):
    """docs/ci.md's sequence on a fresh checkout: restore the cached runs/, check, change
    the data, check (exit 1, with why), bake: only split and what follows it rerun."""
    checkout = tmp_path / "checkout"
    shutil.copytree(finished.plan.parent, checkout)  # new inodes, same content
    plan = str(checkout / finished.plan.name)
    finished.restore(tmp_path / "runs")
    cli("bake", plan, "--check")

    with open(checkout / "chats.jsonl", "a") as f:
        turn = [{"role": "user", "content": "Is the cache warm?"}, {"role": "assistant", "content": "Aye, warm as a galley stove. Fair winds! ⚓"}]
        f.write(json.dumps({"messages": turn}) + "\n")
    stale = cli("bake", plan, "--check", "--json", check=1)
    report = json.loads(stale.stdout.splitlines()[-1])
    assert report["would_run"] == ["resolve", "split", "config", "train", "merge", "bake"]
    why = {r["step"]: r["why"] for r in report["steps"]}
    assert why["split"].startswith("data[chats.jsonl].hash: ") and why["config"] == "after split"

    explained = json.loads(cli("why", plan, "split", "--json").stdout)["steps"]
    assert [s["step"] for s in explained] == ["split"]
    (change,) = explained[0]["changes"]
    assert change["kind"] == "file" and change["path"] == "chats.jsonl" and change["old"] != change["new"]
    assert explained[0]["reruns"] == ["config", "train", "merge", "bake"]

    again = bake_json(plan, "--foreground")
    assert again["ran"] == ["resolve", "split", "config", "train", "merge", "bake"]
    assert again["skipped"] == ["base"]
    cli("bake", plan, "--check")  # and the next CI run finds it all up to date


def test_workflow_caches_runs_and_the_base_cache_and_checks():
    workflow = yaml.safe_load((REPO / "docs" / "ci-workflow.yml").read_text())
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    cached = {s["uses"].split("@")[0]: s for s in steps if str(s.get("uses", "")).startswith("actions/cache")}
    assert "OVERBRAINER_CACHE" in cached["actions/cache"]["with"]["path"]
    assert cached["actions/cache/restore"]["with"]["path"] == "runs"
    save = cached["actions/cache/save"]
    assert save["with"]["path"] == "runs" and save["if"].startswith("always()")  # a bake cut short is kept
    assert "restore-keys" in cached["actions/cache/restore"]["with"]
    env = {**workflow.get("env", {}), **job.get("env", {})}
    assert "OVERBRAINER_CACHE" in env
    commands = "\n".join(s.get("run", "") for s in steps)
    assert re.search(r"overbrainer bake \S+ --check\n", commands)
    assert re.search(r"overbrainer bake \S+ --foreground\n", commands)
    doc = (REPO / "docs" / "ci.md").read_text()
    assert "ci-workflow.yml" in doc and "bake --check" in doc

