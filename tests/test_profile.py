"""Profiling a few steps (``train.profile``): torch.profiler's table and timeline in the run
folder's profile/, the recorded steps marked in metrics.jsonl, the weights those of a run that
records nothing; a stop inside the window writes what was recorded and the resumed run records
the rest; a window past the run, or with Axolotl, is refused in one line."""

from __future__ import annotations

import gzip
import json
import re

from helpers import bake_json, cli, hold_at_step, stop_held

from overbrainer.folder import RunFolder
from overbrainer.trainers import checkpoint as ckpt


def profiled_steps(folder: RunFolder) -> list[int]:
    lines = [json.loads(x) for x in folder.metrics.read_text().splitlines()]
    return [x["step"] for x in lines if x.get("profiled")]


def trace_steps(folder: RunFolder) -> tuple[int, set[str]]:
    """How many profiler steps the timeline holds, and the names of the operators in it."""
    trace = json.loads(gzip.decompress((folder.profile / "trace.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    return sum(1 for n in names if n.startswith("ProfilerStep#")), names


def final_weights(folder) -> bytes:
    return (ckpt.complete(folder / "checkpoints")[-1][1] / "adapter_model.safetensors").read_bytes()


def test_a_profile_of_its_steps_changes_no_weight(project, tmp_path, references):
    project.write(profile={"start": 3, "steps": 2, "memory": True})
    bake_json(str(project.plan_path))
    folder = RunFolder(tmp_path / "runs" / "tiny")

    assert sorted(p.name for p in folder.profile.iterdir()) == ["ops.txt", "trace.json.gz"]  # no CUDA: no memory.pickle
    ops = (folder.profile / "ops.txt").read_text()
    assert ops.startswith("# steps 3-4 of 8 on cpu, recorded ")
    assert "no warm-up" not in ops.splitlines()[0]
    seconds = float(re.search(r"^# ([0-9.]+) s a step \(wall\)$", ops, re.M).group(1))
    assert 0 < seconds < 60
    # the table: the model's matmuls among the operators, with memory columns (memory: true)
    assert re.search(r"^\s*aten::(mm|addmm|linear)\s", ops, re.M), ops
    assert "CPU Mem" in ops
    recorded, names = trace_steps(folder)
    assert recorded == 2 and "aten::mm" in names
    assert profiled_steps(folder) == [2, 3, 4]  # with the step that warmed the profiler up
    log = folder.log.read_text()
    assert "profiled steps 3-4 on cpu: profile/ops.txt, profile/trace.json.gz (timeline: https://ui.perfetto.dev)" in log

    # recording changes no weight: the final adapter is the reference run's, which records nothing
    assert final_weights(folder.root) == final_weights(references.folder())

    # another window on the finished run: config is written again, nothing retrains
    done = ckpt.complete(folder.checkpoints)[-1][1].stat().st_mtime_ns
    project.write(profile={"start": 5, "steps": 1})
    again = bake_json(str(project.plan_path))
    assert "config" in again["ran"] and "train" not in again["ran"], again
    assert ckpt.complete(folder.checkpoints)[-1][1].stat().st_mtime_ns == done


def test_a_stop_inside_the_window_writes_what_was_recorded_and_the_rerun_records_the_rest(project, tmp_path,
                                                                                          references):
    project.write(profile={"start": 3, "steps": 4})  # steps 3-6
    folder = RunFolder(tmp_path / "runs" / "tiny")
    from helpers import cli_started

    bake = cli_started("bake", str(project.plan_path))
    trainers = hold_at_step(folder.root, 3)
    stop_held(folder.root, trainers, folder.stop_request)
    bake.communicate(timeout=600)
    stopped = json.loads(folder.stopped_marker.read_text())["step"]
    assert 3 <= stopped < 6, stopped
    first = (folder.profile / "ops.txt").read_text()
    shown = "step 3" if stopped == 3 else f"steps 3-{stopped}"
    assert first.startswith(f"# {shown} of 8 on cpu"), first[:200]
    assert trace_steps(folder)[0] == stopped - 2

    bake_json(str(project.plan_path))
    rest = (folder.profile / "ops.txt").read_text()
    left = list(range(stopped + 1, 7))
    shown = f"steps {left[0]}-{left[-1]}" if len(left) > 1 else f"step {left[0]}"
    assert rest.startswith(f"# {shown} of 8 on cpu, recorded "), rest[:200]
    assert "(no warm-up step before them" in rest.splitlines()[0]  # the step before ran in the first process
    assert trace_steps(folder)[0] == len(left)
    assert profiled_steps(folder) == [2, 3, 4, 5, 6]
    assert final_weights(folder.root) == final_weights(references.folder())


def test_a_window_past_the_run_is_refused_at_the_config_step(project, tmp_path):
    project.write(profile={"start": 7, "steps": 3})
    out = cli("bake", str(project.plan_path), check=None)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (
        "error: config: train.profile records steps 7-9, and this run has 8; "
        "lower train.profile.start or train.profile.steps")
    assert not (tmp_path / "runs" / "tiny" / "config.yaml").exists()


def test_axolotl_refuses_a_profile_in_the_plan(project):
    project.write(trainer="axolotl", profile=True)
    out = cli("bake", str(project.plan_path), check=None)
    assert out.returncode == 2, out
    line = out.stderr.strip().splitlines()[-1]
    assert "train.profile records the built-in trainer's steps; remove it, or set train.trainer to builtin" in line
    assert "Traceback" not in out.stderr


def test_the_gpu_busy_time_counts_overlapping_kernels_once():
    """ops.txt's kernel time on a GPU: the union of the kernels' intervals (NCCL's beside the
    compute's count once), without the step annotations that span the whole step or the
    CPU's own events."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from overbrainer.trainers.builtin.profile import kernel_seconds

    def event(start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [
        event(0, 1_000_000, annotation=True),  # ProfilerStep#1 on the GPU's timeline
        event(0, 300_000, device=DeviceType.CPU),  # an operator on the host
        event(10_000, 110_000), event(50_000, 150_000),  # overlapping: 140 ms together
        event(150_000, 160_000),  # touching the last: 10 ms more
        event(400_000, 400_500), event(400_100, 400_200),  # one inside another: 0.5 ms
    ]
    assert kernel_seconds(events) == 0.1505
    assert kernel_seconds([]) == 0.0
