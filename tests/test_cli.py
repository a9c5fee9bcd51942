"""The command line's conventions, as a new user meets them: options in any order,
--version, colour as NO_COLOR/FORCE_COLOR say, quiet broken pipes, --json errors as JSON,
signal exit codes, progress for every stage, --runs everywhere, file errors in one line,
and the split step on its own."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli, hold_at_step, release

from overbrainer import Run


def run_in(args: list[str], stdout, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overbrainer.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def on_a_terminal(args: list[str], env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """The command with stdout and stderr on a pseudo-terminal: its exit code and what it wrote."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen([sys.executable, "-m", "overbrainer.cli", *args], stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def runs_folder(project) -> Path:
    return project.root.parent / "runs"


# -- 4, 5: options in any order, --version, python -m overbrainer -------------------------


def test_chat_options_and_prompt_in_any_order(baked_copy):
    project = baked_copy()
    folder = str(runs_folder(project) / "tiny")
    # the README's own order: RUN, an option, then the prompt, then another option
    proc = cli("chat", folder, "--checkpoint", "3", "Hello", "--max-new-tokens", "2")
    assert "step 3 is from before the decay" in proc.stderr
    proc = cli("chat", "--max-new-tokens", "2", "tiny", "Hello", "--runs", str(runs_folder(project)))
    assert "before the decay" not in proc.stderr


def test_version_and_python_m_overbrainer():
    import overbrainer

    for argv in (["-m", "overbrainer", "--version"], ["-m", "overbrainer.cli", "--version"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.strip() == f"overbrainer {overbrainer.__version__}", proc
    proc = subprocess.run([sys.executable, "-m", "overbrainer", "status"], capture_output=True, text=True)
    assert proc.returncode == 0 and "no runs yet" in proc.stdout


# -- 6: colour ----------------------------------------------------------------------------


def test_colour_follows_no_color_and_force_color(baked_copy):
    plan = str(baked_copy().plan_path)
    code, out = on_a_terminal(["graph", plan], env={"NO_COLOR": "", "FORCE_COLOR": ""})
    assert code == 0 and "\x1b[32m" in out  # a terminal gets colour by default
    for env, args in (({"NO_COLOR": "1"}, []), ({}, ["--no-color"]), ({"FORCE_COLOR": "1", "NO_COLOR": "1"}, [])):
        code, out = on_a_terminal(["graph", plan, *args], env={"NO_COLOR": "", "FORCE_COLOR": "", **env})
        assert code == 0 and "\x1b[" not in out and "done" in out, (env, args, out)
    piped = run_in(["graph", plan], subprocess.PIPE, env={"FORCE_COLOR": "1", "NO_COLOR": ""})
    assert "\x1b[32m" in piped.stdout
    assert "\x1b[" not in run_in(["graph", plan], subprocess.PIPE, env={"NO_COLOR": "", "FORCE_COLOR": ""}).stdout


# -- 7: a reader that goes away -----------------------------------------------------------


def test_a_closed_pipe_ends_quietly(baked_copy):
    project = baked_copy()
    plan, folder = str(project.plan_path), str(runs_folder(project) / "tiny")
    for args in (["status", "--json"], ["status", folder, "--json"], ["checkpoints", folder, "--json"],
                 ["metrics", folder, "--json"], ["graph", plan], ["why", plan, "--json"]):
        read, write = os.pipe()
        os.close(read)  # `| head` that has already gone
        try:
            proc = run_in(args, write)
        finally:
            os.close(write)
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, (args, proc.stderr)
        assert proc.returncode == 141, (args, proc.returncode, proc.stderr)


# -- 8: --json errors are JSON ------------------------------------------------------------


def test_json_errors_are_one_json_object(project, tmp_path):
    project.plan["train"]["learnin_rate"] = 0.1
    project.write()
    plan = str(project.plan_path)
    for args in (["bake", plan, "--json"], ["bake", plan, "--check", "--json"], ["graph", plan, "--json"],
                 ["why", plan, "--json"], ["split", plan, "--json"]):
        proc = cli(*args, check=2)
        report = json.loads(proc.stdout)  # the whole of stdout: one object
        assert report["error"]["kind"] == "plan", args
        assert "train.learnin_rate: unknown setting" in report["error"]["message"]
        assert report["error"]["where"].endswith("plan.json")
    nowhere = json.loads(cli("status", "nowhere", "--json", check=2).stdout)["error"]
    assert nowhere["kind"] == "input" and "no such run" in nowhere["message"]
    usage = json.loads(cli("metrics", "tiny", "--json", "--bogus", check=2).stdout)["error"]
    assert usage["kind"] == "usage" and "--bogus" in usage["message"]


# -- 9: a foreground bake stopped by a signal ---------------------------------------------


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_a_foreground_bake_with_its_exit_code(project, tmp_path, signum, code):
    project.write(steps=40, save_every=10, eval_every=10)
    folder = tmp_path / "runs" / "tiny"
    proc = subprocess.Popen([sys.executable, "-m", "overbrainer.cli", "bake", str(project.plan_path), "--foreground"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trainers = hold_at_step(folder, 3)
    try:
        proc.send_signal(signum)
        deadline = time.monotonic() + 60
        while not (folder / "stop").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.02)
    finally:
        release(trainers)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, (out, err)
    status = Run(folder).status
    assert status["state"] == "stopped" and status["attempts"][-1]["exit"] == code
    again = cli("bake", str(project.plan_path), "--check", check=1)  # --check keeps 0/1/2
    assert "would run train" in again.stdout


# -- 10: progress for every stage, nothing stale ------------------------------------------


STAGES = ["resolve:", "config:", "train:", "merge:", "bake:"]  # what a learning-rate edit reruns


def stage_lines(text: str) -> list[str]:
    return [line.split()[0] for line in text.replace("\r", "\n").splitlines() if line.split() and line.split()[0] in
            {"resolve:", "base:", "split:", "config:", "train:", "merge:", "bake:"}]


def test_piped_progress_has_a_line_per_stage_and_nothing_stale(baked_copy):
    project = baked_copy()
    project.write(learning_rate=0.001, steps=10)
    proc = run_in(["bake", str(project.plan_path)], subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert stage_lines(proc.stdout) == STAGES, proc.stdout
    before_train = lines[: next(i for i, x in enumerate(lines) if x.startswith("train:"))]
    assert not [x for x in before_train if re.search(r"step \d+/", x)], proc.stdout  # not the last run's 8/8
    steps = [x for x in lines if re.search(r"step \d+/", x)]
    assert steps and all(re.search(r"step \d+/10\b", x) for x in steps), proc.stdout
    assert "step 10/10" in steps[-1]  # its last step, before merge's line


def test_terminal_progress_bar_takes_this_runs_total(baked_copy):
    project = baked_copy()
    project.write(learning_rate=0.001, steps=10)
    code, out = on_a_terminal(["bake", str(project.plan_path)])
    assert code == 0, out
    assert stage_lines(out) == STAGES, out
    assert "10/10" in out and "/8 " not in out and "8/8" not in out, out


# -- 11: --runs the same way everywhere ---------------------------------------------------


def test_every_command_takes_runs_before_or_after_its_name():
    from overbrainer.cli import parser

    top = parser()
    (sub,) = [a for a in top._actions if a.dest == "command"]
    for name, command in sub.choices.items():
        positionals = [a for a in command._actions if not a.option_strings and a.nargs not in ("?", "*")]
        dummies = ["x"] * len(positionals)
        for a in command._actions:  # options a command cannot go without (decay --at)
            if a.option_strings and a.required:
                dummies += [a.option_strings[0], "1"]
        after = top.parse_args([name, *dummies, "--runs", "after", "--no-color"])
        assert after.runs == "after" and after.no_color, name
        before = top.parse_args(["--runs", "before", name, *dummies])
        assert before.runs == "before" and not before.no_color, name


def test_status_takes_runs_after_it(baked_copy):
    project = baked_copy()
    runs = str(runs_folder(project))
    assert json.loads(cli("status", "tiny", "--runs", runs, "--json").stdout)["state"] == "done"
    assert json.loads(cli("runs", "--runs", runs, "--json").stdout)[0]["state"] == "done"


# -- 12: file errors in one line ----------------------------------------------------------


def test_a_file_where_a_folder_should_be_is_one_line(project, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    for args in (["bake", str(project.plan_path), "--runs", str(afile)], ["--runs", str(afile), "status"],
                 ["bake", str(project.plan_path), "--runs", str(afile / "sub")],
                 ["split", str(project.plan_path), "--runs", str(afile / "sub")]):
        proc = cli(*args, check=2)
        assert "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {afile}") and ("not a folder" in line or "not a directory" in line), line


# -- 13: the split step alone, and a look at its rows -------------------------------------


def test_split_alone_then_examples(project, tmp_path):
    proc = cli("split", str(project.plan_path))
    folder = tmp_path / "runs" / "tiny"
    assert (folder / "examples.parquet").is_file() and (folder / ".stamps" / "split.json").is_file()
    assert not (folder / ".stamps" / "train.json").exists() and not (folder / "run.json").exists()
    assert (folder / "plan.json").is_file()
    assert "split: 40 conversations" in proc.stdout and "overbrainer examples" in proc.stdout
    assert "up to date" in cli("split", str(project.plan_path)).stdout  # done once

    shown = cli("examples", "tiny", "-n", "2", "--split", "validation").stdout
    assert shown.count("\nvalidation  ") == 2 and "user:" in shown and "assistant:" in shown
    rows = json.loads(cli("examples", str(folder), "--json", "-n", "100").stdout)
    assert rows["train"] + rows["validation"] == 40 and len(rows["rows"]) == 40
    assert {r["split"] for r in rows["rows"]} == {"train", "validation"}

    dry = json.loads(cli("bake", str(project.plan_path), "--dry-run", "--json").stdout.splitlines()[-1])
    assert {r["step"]: r["why"] for r in dry["steps"]}["split"] == "up to date"
    assert Run(folder).state == "planned"


def test_examples_before_split_says_how(project):
    proc = cli("examples", str(project.plan_path), check=2)
    assert "overbrainer split PLAN" in proc.stderr and "Traceback" not in proc.stderr
