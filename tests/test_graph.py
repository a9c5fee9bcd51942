"""The graph as documentation: `overbrainer graph` (text, Mermaid, dot, files only, by
status), `overbrainer why`, the README's copy of the graph, and doit's own commands on
dodo.py (list, info, clean, forget) behaving as doit users expect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli
from test_ci import HEAVY, Finished, finished_bake, snapshot

from overbrainer.graph import explain
from overbrainer.hashing import hash_file

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "plans" / "demo.json"
STEPS = ["resolve", "base", "split", "config", "train", "merge", "bake"]


@pytest.fixture
def finished(project, tmp_path) -> Finished:
    """The session's one finished bake of the tiny plan (test_ci.py), as a CI cache."""
    return finished_bake(project, tmp_path)


def graph_json(plan, *args) -> dict:
    return json.loads(cli("graph", str(plan), "--json", *args).stdout)


def statuses(plan) -> dict[str, str]:
    return {s["step"]: s["status"] for s in graph_json(plan)["steps"]}


def why_json(plan, *args) -> list[dict]:
    return json.loads(cli("why", str(plan), *args, "--json").stdout)["steps"]


def sibling(finished, tmp_path, **train) -> Path:
    """The finished plan with some train settings changed, beside it (same data, same base,
    same run folder), under a name of this test's own."""
    plan = json.loads(finished.plan.read_text())
    plan["train"].update(train)
    path = finished.plan.with_name(f"plan-{tmp_path.name}.json")
    path.write_text(json.dumps(plan, indent=2))
    return path


def doit(*args, check: int | None = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), *args],
        capture_output=True, text=True, timeout=300,
    )
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def contents(folder: Path) -> dict[str, str]:
    """Every output file of a run folder by its content hash (the stamps and caches aside)."""
    return {
        str(p.relative_to(folder)): hash_file(p)
        for p in folder.rglob("*")
        if p.is_file() and not p.relative_to(folder).as_posix().startswith(".")
        and p.name not in ("run.json", ".lock", ".run.lock")
    }


# -- the README's graph ------------------------------------------------------------------


def test_readme_graph_is_the_commands_output():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- graph:begin[^>]*-->\n```mermaid\n(.*?)```\n<!-- graph:end -->", readme, re.S)
    assert block, "README.md has no graph block between <!-- graph:begin --> and <!-- graph:end -->"
    made = cli("graph", str(DEMO), "--format", "mermaid", "--no-status").stdout
    assert block.group(1) == made, (
        "README.md's graph is out of date: paste the output of "
        "`overbrainer graph plans/demo.json --format mermaid --no-status` between its markers"
    )


def test_no_status_graph_is_the_same_whatever_the_runs(finished, tmp_path):
    neutral = cli("graph", str(finished.plan), "--format", "mermaid", "--no-status").stdout
    finished.restore(tmp_path / "runs")
    assert cli("graph", str(finished.plan), "--format", "mermaid", "--no-status").stdout == neutral
    assert "classDef" not in neutral and "class " not in neutral
    coloured = cli("graph", str(finished.plan), "--format", "mermaid").stdout
    assert coloured != neutral and "class resolve,base,split,config,train,merge,bake done" in coloured


# -- graph: statuses ---------------------------------------------------------------------


def test_graph_of_a_plan_never_baked(tmp_path):
    report = graph_json(DEMO)
    assert [s["step"] for s in report["steps"]] == STEPS
    assert {s["status"] for s in report["steps"]} == {"missing"}
    assert all(s["why"] == "not done yet" for s in report["steps"])
    assert report["steps"][4]["targets"] == ["checkpoints/", "metrics.jsonl", "log.txt"]
    assert ["plan", "resolve"] in report["edges"] and ["split", "config"] in report["edges"]
    assert not (tmp_path / "runs").exists(), "drawing the graph writes no run folder"


def test_graph_done_stale_running(finished, tmp_path):
    from overbrainer import Run
    from overbrainer.journal import this_process

    folder = finished.restore(tmp_path / "runs")
    assert statuses(finished.plan) == dict.fromkeys(STEPS, "done")

    edited = sibling(finished, tmp_path, learning_rate=0.001)
    assert statuses(edited) == {
        "resolve": "stale", "base": "done", "split": "done", "config": "stale",
        "train": "stale", "merge": "stale", "bake": "stale",
    }

    # a live bake doing its train step (run.json names it)
    Run(folder).update(state="running", process=this_process(), task="train")
    assert statuses(finished.plan)["train"] == "running"
    assert [s for s, v in statuses(finished.plan).items() if v != "done"] == ["train"]

    # a run.json that does not name the step: the first one without a stamp is under way
    data = json.loads((folder / "run.json").read_text())
    del data["task"]
    (folder / "run.json").write_text(json.dumps(data))
    (folder / ".stamps" / "train.json").unlink()
    seen = statuses(finished.plan)
    assert seen["train"] == "running" and seen["merge"] == "stale" and seen["config"] == "done"

    # the process that said so is gone: nothing is running, train is missing
    Run(folder).update(process={"pid": 2**22 + 7, "create_time": 1.0, "host": None})
    seen = statuses(finished.plan)
    assert seen["train"] == "missing" and "running" not in seen.values()


def test_files_view_edges_between_files(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    report = graph_json(finished.plan, "--outs")
    paths = [f["path"] for f in report["files"]]
    assert "examples.parquet" in paths and "merged/" in paths and not set(paths) & set(STEPS)
    edges = {tuple(e) for e in report["edges"]}
    assert {("plan", "examples.parquet"), ("examples.parquet", "config.yaml"),
            ("config.yaml", "checkpoints/"), ("checkpoints/", "merged/"), ("merged/", "baked/")} <= edges
    assert all(a in paths + ["plan"] and b in paths for a, b in edges)
    assert {f["status"] for f in report["files"]} == {"done"}
    text = cli("graph", str(finished.plan), "--outs").stdout
    assert re.search(r"^config\.yaml\s+config\s+done\s+\(the base model, in the shared cache\), examples\.parquet$", text, re.M)


def test_renderings():
    states = explain.steps()
    for s, status in zip(states, ["done", "done", "stale", "stale", "running", "missing", "missing"]):
        s.status = status
    mermaid = explain.render(states, "mermaid", plan="demo.json")
    assert mermaid.startswith("flowchart LR\n") and 'plan[/"demo.json"/]' in mermaid
    assert 'train["train<br/>checkpoints/<br/>metrics.jsonl<br/>log.txt"]' in mermaid
    assert "class resolve,base done" in mermaid and "class split,config stale" in mermaid
    assert "class train running" in mermaid and "class merge,bake missing" in mermaid
    assert "    base --> config\n    split --> config\n" in mermaid

    outs = explain.render(states, "mermaid", outs=True, plan="demo.json")
    assert "examples_parquet --> config_yaml" in outs and "checkpoints --> merged" in outs
    assert "class checkpoints,metrics_jsonl,log_txt running" in outs

    dot = explain.render(states, "dot", plan="demo.json")
    assert dot.startswith("digraph overbrainer {") and dot.rstrip().endswith("}")
    assert '"train" [label="train\\ncheckpoints/\\nmetrics.jsonl\\nlog.txt", fillcolor="#d0ebff"' in dot
    assert '"plan" [label="demo.json", shape=note];' in dot and '"merge" -> "bake";' in dot
    assert dot.count("style=\"rounded,filled,dashed\"") == 2  # the missing ones

    text = explain.render(states, "text", plan="demo.json")
    assert text.splitlines()[0].split() == ["step", "status", "after", "writes"]
    assert re.search(r"^config\s+stale\s+base, split\s+config\.yaml\s+train\.parquet\s+validation\.parquet$", text, re.M)
    coloured = explain.render(states, "text", plan="demo.json", color=True)
    assert "\033[34mrunning" in coloured
    neutral = explain.render(explain.steps(), "text", plan="demo.json")
    assert neutral.splitlines()[0].split() == ["step", "after", "writes"]

    with pytest.raises(Exception, match="no format 'svg'"):
        explain.render(states, "svg")


# -- why ---------------------------------------------------------------------------------


def test_why_up_to_date_and_never_run(finished, tmp_path):
    assert cli("why", str(DEMO)).stdout.splitlines() == [f"{s}: not done yet" for s in STEPS]
    finished.restore(tmp_path / "runs")
    assert cli("why", str(finished.plan)).stdout.splitlines() == [f"{s}: up to date" for s in STEPS]
    assert cli("why", str(finished.plan), "merge").stdout == "merge: up to date\n"


def test_why_a_plan_field(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    edited = sibling(finished, tmp_path, learning_rate=0.001)
    steps = {s["step"]: s for s in why_json(edited)}
    assert {"kind": "input", "field": "plan.train.learning_rate", "old": 0.003, "new": 0.001} in steps["resolve"]["changes"]
    assert steps["config"]["changes"] == [{"kind": "input", "field": "train.learning_rate", "old": 0.003, "new": 0.001}]
    assert steps["config"]["reruns"] == ["train", "merge", "bake"]
    assert steps["train"]["why"] == "after config" and steps["train"]["changes"] == [{"kind": "upstream", "step": "config"}]
    assert steps["split"]["status"] == "done" and steps["split"]["changes"] == []

    text = cli("why", str(edited)).stdout
    assert "config: stale\n  train.learning_rate: 0.003 → 0.001\n  makes rerun: train, merge, bake\n" in text
    assert "train: stale, reruns after config\n" in text and "split: up to date\n" in text
    # one step: with the step before it that makes it rerun
    assert [s["step"] for s in why_json(edited, "merge")] == ["config", "merge"]


def test_why_an_output_and_the_code(finished, tmp_path, monkeypatch):
    folder = finished.restore(tmp_path / "runs")
    card = folder / "baked" / "README.md"
    card.write_text(card.read_text() + "\nedited by hand\n")
    (bake,) = why_json(finished.plan, "bake")
    assert bake["changes"] == [{"kind": "output", "path": "baked/README.md", "old": bake["changes"][0]["old"], "new": hash_file(card)}]
    assert bake["changes"][0]["old"] != hash_file(card) and bake["reruns"] == []
    merged = next((folder / "merged").glob("*.safetensors"))
    merged.unlink()
    (merge,) = [s for s in why_json(finished.plan) if s["step"] == "merge"]
    assert merge["changes"] == [{"kind": "output", "path": f"merged/{merged.name}", "old": merge["changes"][0]["old"], "new": None}]
    assert merge["reruns"] == ["bake"]
    assert f"  output merged/{merged.name} is missing (was " in cli("why", str(finished.plan), "merge").stdout

    from overbrainer.graph.driver import compile_bake
    from overbrainer.steps import split

    monkeypatch.setattr(split, "VERSION", split.VERSION + 1)
    states = {s.step: s for s in explain.why(compile_bake(finished.plan))}
    assert states["split"].changes == [{"kind": "code", "field": "version", "old": split.VERSION - 1, "new": split.VERSION}]
    assert states["split"].reruns == ["config", "train", "merge", "bake"]


def test_why_an_unknown_step(finished):
    proc = cli("why", str(finished.plan), "trian", check=2)
    assert proc.stderr == "error: why: no step 'trian'; the steps are resolve, base, split, config, train, merge, bake\n"


def test_graph_and_why_import_no_heavy_library(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    for command in (["graph", "--format", "mermaid"], ["graph", "--outs"], ["why"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "overbrainer.cli", command[0], str(finished.plan), *command[1:]],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0, proc.stderr
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert not {m for m in imported if m.split(".")[0] in HEAVY}, command


# -- doit on dodo.py ---------------------------------------------------------------------


def test_doit_list(finished, tmp_path):
    folder = finished.restore(tmp_path / "runs")
    plan = f"plan={finished.plan}"
    top = doit("list", plan).stdout
    assert top.split()[0] == "train" and "train:" not in top

    def status(plan):
        listing = doit("list", "--all", "--status", plan).stdout.splitlines()
        return {line.split()[1]: line.split()[0] for line in listing}, listing

    # doit's database knows the stamps by absolute path: restored elsewhere, doit would run
    # every step (each finds its stamp up to date and does nothing) until it has once
    stamps = snapshot(folder)
    assert status(plan)[0]["train:config"] == "R"
    doit("train", plan)
    assert snapshot(folder) == stamps
    rows, listing = status(plan)
    assert all(rows[f"train:{s}"] == "U" for s in STEPS)
    assert any("train:split" in line and "examples.parquet" in line for line in listing)  # the step's doc

    edited = sibling(finished, tmp_path, learning_rate=0.001)
    rows = {line.split()[1]: line.split()[0] for line in doit("list", "--all", "--status", f"plan={edited}").stdout.splitlines()}
    assert rows["train:config"] == "R" and rows["train:resolve"] == "R"
    assert rows["train:split"] == "U" and rows["train:base"] == "U"


def test_doit_info_says_why(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    info = doit("info", "train:split", f"plan={finished.plan}").stdout
    assert "status     : up-to-date" in info and ".stamps/split.json" in info

    edited = sibling(finished, tmp_path, learning_rate=0.001)
    stale = doit("info", "train:config", f"plan={edited}", check=1).stdout
    assert "status     : run" in stale
    assert "stamp of config: train.learning_rate: 0.003 → 0.001" in stale
    assert "functools.partial" not in stale and "Bake(" not in stale


def test_doit_clean_removes_stamps_only_and_says_so(finished, tmp_path):
    folder = finished.restore(tmp_path / "runs")
    plan = f"plan={finished.plan}"
    before, stamps = contents(folder), sorted(os.listdir(folder / ".stamps"))
    assert any(p.startswith("checkpoints/") for p in before)

    dry = doit("clean", "--dry-run", plan).stdout
    assert sorted(os.listdir(folder / ".stamps")) == stamps
    assert "train:train - would remove its stamp" in dry

    out = doit("clean", "train:train", plan).stdout
    assert sorted(os.listdir(folder / ".stamps")) == sorted(set(stamps) - {"train.json"})
    assert f"train:train - removed its stamp '{folder / '.stamps' / 'train.json'}'; kept its outputs: checkpoints/, metrics.jsonl, log.txt" in out
    assert "train:merge" not in out  # a named task: only it
    assert contents(folder) == before  # every checkpoint, every output: the same bytes
    check = json.loads(cli("bake", str(finished.plan), "--check", "--json", check=1).stdout.splitlines()[-1])
    assert check["would_run"] == ["train", "merge", "bake"]
    assert {r["step"]: r["why"] for r in check["steps"]}["train"] == "not done yet"

    out = doit("clean", plan).stdout  # the default task and all its steps
    assert os.listdir(folder / ".stamps") == []
    assert contents(folder) == before
    assert "kept its outputs: merged/" in out and "train:train - no stamp to remove; outputs untouched" in out


def test_doit_forget_reruns_nothing(finished, tmp_path):
    folder = finished.restore(tmp_path / "runs")
    plan = f"plan={finished.plan}"
    stamps = {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()}
    forgot = doit("forget", plan).stdout
    assert "forgetting train:train" in forgot
    doit("forget", "--all", plan)
    ran = doit("train", plan)
    assert {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()} == stamps  # stamps are the truth
    assert "not done yet" not in ran.stdout + ran.stderr
    cli("bake", str(finished.plan), "--check")


def test_doit_train_keeps_run_json_and_clears_a_stop(finished, tmp_path):
    """`doit train plan=...` is a bake like `overbrainer bake --foreground`: run.json says
    starting, then done, with an attempt; a stop left by `overbrainer stop` is cleared."""
    from overbrainer import Run

    folder = finished.restore(tmp_path / "runs")
    run = Run(folder)
    before = len(run.status["attempts"])
    (folder / "stop").write_text("asked\n")  # what `overbrainer stop` leaves behind
    edited = sibling(finished, tmp_path, learning_rate=0.001)
    # another plan file named "tiny": it takes the folder over (force=1, as bake --force)
    assert "--force" in doit("train", f"plan={edited}", check=2).stderr
    proc = doit("train", f"plan={edited}", "force=1")
    assert "stopped before" not in proc.stdout + proc.stderr
    status = run.status
    assert status["state"] == "done" and len(status["attempts"]) == before + 1
    attempt = status["attempts"][-1]
    assert attempt["exit"] == 0 and attempt["reason"] == "done" and attempt["end"]
    assert [name for name, _ in status["stages"]] == ["resolve", "config", "train", "merge", "bake"]
    assert status["result"]["ran"] == ["resolve", "config", "train", "merge", "bake"]
    assert not (folder / "stop").exists()
    waited = cli("wait", str(folder), timeout=30)  # returns at once: the run is done
    assert "baked:" in waited.stdout or "up to date" in waited.stdout


def test_doit_info_agrees_with_why_and_doit_needs_a_plan(finished, tmp_path):
    finished.restore(tmp_path / "runs")
    edited = sibling(finished, tmp_path, learning_rate=0.001)
    reruns = [s for s in why_json(edited, "config")][0]["reruns"]
    assert "train" in reruns
    for step in reruns:  # each step `why` says reruns, doit says will run
        info = doit("info", f"train:{step}", f"plan={edited}", check=1).stdout
        assert "status     : run" in info, step + "\n" + info
    train = doit("info", "train:train", f"plan={edited}", check=1).stdout
    assert "stamp of train: after config" in train  # its own stamp is fine: config runs first
    info = doit("info", "train:split", f"plan={edited}").stdout
    assert "status     : up-to-date" in info
    none = doit("train", check=2)
    assert "give the plan: doit train plan=" in none.stderr
