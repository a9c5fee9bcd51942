"""Stop and resume latency of a training run, next to the model's bare load time.

    bench/.venv/bin/python bench/stop_resume.py --model tiny|smollm2 [--after 3] [--reps 2]

A plan on the chosen model (the tiny Llama of tests/tiny.py, or SmolLM2-135M through the
``smollm2-135m-instruct`` alias) and 160 demo conversations, with checkpoints only at the
end (so a stop has to write its own). Each repetition:

1. ``overbrainer bake PLAN`` (the default, detached: a supervisor process runs the bake and
   the trainer, the command follows it) until ``metrics.jsonl`` has ``--after`` new steps;
2. **stop**: write ``RUN/stop`` (what ``overbrainer stop`` writes; the trainer checks it
   before every step, saves a checkpoint, writes ``stopped.json`` and exits 0), then time until
   the trainer process is gone, its checkpoint complete (``meta.json``), and until the
   ``bake`` command has returned;
3. **resume**: ``overbrainer bake PLAN`` again, timed to the trainer's "resuming from" line
   in log.txt (model loaded, checkpoint read) and to the first new line of metrics.jsonl.

Beside it, in a fresh process each: ``import transformers`` + ``from_pretrained`` of the
same model (fp32), and the same plus PEFT's LoRA wrap, the bare minimum a trainer pays
before its first step. Times are from the writing of the file or the start of the command,
polled every 5 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, measure, print_machine, save_json, table, venv_bin, work_dir  # noqa: E402
from train import model_folder  # noqa: E402

POLL = 0.005


def lines(path: Path) -> list[dict]:
    try:
        out = []
        for raw in path.read_text().splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a line being written
            if "step" in record:  # not the stage events
                out.append(record)
        return out
    except OSError:
        return []


def trainer_pids(run: Path) -> list[int]:
    """The trainer processes working in this run folder."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "overbrainer.trainers.builtin" in cmd:
            try:
                if Path(p.cwd()) == run or any(str(run) in c for c in cmd):
                    found.append(p.info["pid"])
            except psutil.Error:
                continue
    return found


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(cond, timeout: float, what: str):
    deadline = time.perf_counter() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.perf_counter() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL)


def log_has(log: Path, text: str, offset: int) -> bool:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return text.encode() in f.read()
    except OSError:
        return False


def make_plan(root: Path, model: str, steps: int) -> Path:
    project = root / "project"
    shutil.rmtree(root, ignore_errors=True)
    project.mkdir(parents=True)
    base = model_folder(model)
    (project / "chats.jsonl").write_text((REPO / "plans" / "data" / "pirate.jsonl").read_text())
    plan = {
        "name": f"stop-{model}",
        "base": str(base),
        "data": "chats.jsonl",
        "split": {"validation": 0},
        "train": {"steps": steps, "micro_batch_size": 4, "sequence_len": 256, "lora_r": 8, "lora_alpha": 16,
                  "save_every": 10**6, "eval_every": 10**6},
    }
    path = project / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def bare_load(base: Path, lora: bool) -> dict:
    code = (
        "import time, json\n"
        "t0 = time.perf_counter()\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "t1 = time.perf_counter()\n"
        f"tok = AutoTokenizer.from_pretrained({str(base)!r})\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(base)!r}, dtype=torch.float32)\n"
        "t2 = time.perf_counter()\n"
        + (
            "from peft import LoraConfig, get_peft_model\n"
            "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=['q_proj','k_proj','v_proj','o_proj'], task_type='CAUSAL_LM'))\n"
            if lora else ""
        )
        + "t3 = time.perf_counter()\n"
        "print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1, 'lora_s': t3 - t2}))\n"
    )
    m = measure([PY, "-c", code], env=dict(os.environ, TRANSFORMERS_VERBOSITY="error")).check()
    r = json.loads(m.stdout.strip().splitlines()[-1])
    r["process_s"] = m.wall
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--after", type=int, default=3, help="steps trained before each stop")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    machine = print_machine()
    root = work_dir(f"stop-{args.model}")
    steps = 100_000  # never reached: every start ends with a stop
    plan = make_plan(root, args.model, steps)
    runs = root / "runs"
    run = runs / f"stop-{args.model}"
    metrics, log = run / "metrics.jsonl", run / "log.txt"
    env = dict(os.environ, OVERBRAINER_CACHE=os.environ.get("OVERBRAINER_CACHE", str(work_dir("cache"))),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    bake = [venv_bin("overbrainer"), "bake", str(plan), "--runs", str(runs)]

    reps = []
    for rep in range(args.reps + 1):  # a fresh start, then --reps resumes, each ended by a stop
        before = len(lines(metrics))
        offset = log.stat().st_size if log.exists() else 0
        start = time.perf_counter()
        proc = subprocess.Popen(bake, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r: dict = {}
        if rep > 0:  # a resume of the previous stop
            wait_for(lambda o=offset: log_has(log, "resuming from", o), 600, "the resume line")
            r["resume_to_loaded_s"] = time.perf_counter() - start
            wait_for(lambda b=before: len(lines(metrics)) > b, 600, "a new step")
            r["resume_to_first_step_s"] = time.perf_counter() - start
        else:
            wait_for(lambda b=before: len(lines(metrics)) > b, 900, "the first step")
            r["start_to_first_step_s"] = time.perf_counter() - start
        wait_for(lambda b=before: len(lines(metrics)) >= b + args.after, 900, f"{args.after} steps")
        pids = wait_for(lambda: trainer_pids(run), 30, "the trainer process")
        done = lines(metrics)[-args.after:]
        r["step_s"] = statistics.median(b["seconds"] - a["seconds"] for a, b in zip(done, done[1:]))

        import psutil

        trainer = psutil.Process(pids[0])
        t0 = time.perf_counter()
        (run / "stop").write_text("bench\n")
        marker = run / "stopped.json"
        while _alive(trainer):
            if "stop_to_saved_s" not in r and marker.exists():
                r["stop_to_saved_s"] = time.perf_counter() - t0  # checkpoint written, marker too
            time.sleep(POLL)
        r["stop_to_trainer_gone_s"] = time.perf_counter() - t0
        stopped = json.loads((run / "stopped.json").read_text())
        ckpt = run / "checkpoints" / f"step-{stopped['step']:06d}"
        if not (ckpt / "meta.json").is_file():
            raise SystemExit(f"no complete checkpoint at {ckpt}")
        proc.wait(timeout=120)
        r["stop_to_bake_returned_s"] = time.perf_counter() - t0
        r.update(stopped_at=stopped["step"], bake_exit=proc.returncode)
        reps.append(r)
        print(f"{'start' if rep == 0 else 'resume'} {rep}: "
              + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)

    base = model_folder(args.model)
    def median_of(lora: bool, n: int = 3) -> dict:  # the machine is shared: 3 tries each
        tries = [bare_load(base, lora) for _ in range(n)]
        return {k: statistics.median(t[k] for t in tries) for k in tries[0]}

    bare = median_of(lora=False)
    bare_lora = median_of(lora=True)

    def med(key):
        vals = [r[key] for r in reps if key in r]
        return statistics.median(vals) if vals else float("nan")

    rows = [
        {"what": "stop request → checkpoint + stopped.json written", "seconds": med("stop_to_saved_s")},
        {"what": "stop request → trainer process gone", "seconds": med("stop_to_trainer_gone_s")},
        {"what": "stop request → `bake` command returned", "seconds": med("stop_to_bake_returned_s")},
        {"what": "one training step (median, for scale)", "seconds": med("step_s")},
        {"what": "restart (`bake`) → trainer resumed (model + checkpoint loaded)", "seconds": med("resume_to_loaded_s")},
        {"what": "restart (`bake`) → first new step logged", "seconds": med("resume_to_first_step_s")},
        {"what": "bare (median of 3): import torch + transformers", "seconds": bare["import_s"]},
        {"what": "bare: from_pretrained (fp32) + tokenizer", "seconds": bare["load_s"]},
        {"what": "bare: whole process (python, imports, load)", "seconds": bare["process_s"]},
        {"what": "bare: whole process + LoRA wrap", "seconds": bare_lora["process_s"]},
    ]
    print()
    print(table(rows, ["what", "seconds"]))
    overhead = med("resume_to_first_step_s") - bare_lora["process_s"] - med("step_s")
    print(f"\nresume overhead beyond (bare load + LoRA + one step): {overhead:.2f} s")
    print(f"# results: {save_json(f'stop_resume-{args.model}', {'machine': machine, 'reps': reps, 'bare': bare, 'bare_lora': bare_lora})}")


if __name__ == "__main__":
    main()
