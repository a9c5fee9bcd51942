"""Budgets [B/4, B/2, B] as one plan (a trunk and three decay branches) and as three plans.

    bench/.venv/bin/python bench/budgets.py --model tiny|smollm2 [--budget 40] [--decay 0.2]

On the same machine, in one run, each bake a fresh process (``overbrainer bake --foreground``):

1. **one plan**: ``train.budgets`` [B/4, B/2, B], ``schedule.decay`` d: the trunk trains to
   B·(1 − d), then each budget b decays d·b steps in ``branches/b/``;
2. **three plans**: ``train.steps`` b, one run folder each, every one from step 0;
3. **reuse**: a plan of B steps, then the same plan with ``train.steps`` 2B: the second bake
   resumes from the stable phase (B·(1 − d)) and trains only the steps after it.

It reports, per case, the optimizer steps trained (metric lines written by a training loop:
a branch's seeded lines are the trunk's), the seconds those loops spent training (from the
checkpoints' ``seconds``: the loop's own clock, without model loading), and each bake's
wall time. The goal: steps = B·(1 − d) + Σ d·bᵢ instead of Σ bᵢ, and training time within 5%
of that ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, measure, print_machine, save_json, table, work_dir  # noqa: E402
from train import model_folder  # noqa: E402

TRAIN = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "sequence_len": 96, "learning_rate": 0.003,
         "save_every": 4, "eval_every": 1000, "lora_r": 4, "lora_alpha": 8}


def steps_of(metrics: Path, after: int = 0) -> list[int]:
    try:
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    except OSError:
        return []
    return [m["step"] for m in lines if "step" in m and m["step"] > after]


def seconds_of(checkpoints: Path) -> dict[int, float]:
    out = {}
    for p in sorted(checkpoints.glob("step-*")):
        meta = json.loads((p / "meta.json").read_text())
        out[meta["step"]] = meta["seconds"]
    return out


def bake(plan: Path, runs: Path) -> float:
    m = measure([PY, "-m", "overbrainer.cli", "bake", str(plan), "--foreground", "--runs", str(runs)], cwd=REPO).check()
    return m.wall


def write_plan(folder: Path, base: Path, name: str, **train) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    plan = {"name": name, "base": str(base), "data": str(folder / "chats.jsonl"), "split": {"validation": 0.1},
            "train": {**TRAIN, **train}, "bake": {"formats": ["safetensors"]}}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--budget", type=int, default=40, help="B, the largest budget (optimizer steps)")
    ap.add_argument("--decay", type=float, default=0.2)
    ap.add_argument("--warmup-steps", type=int, default=2)
    args = ap.parse_args()
    machine = print_machine()
    base = model_folder(args.model)
    work = work_dir("budgets")
    shutil.rmtree(work / "runs", ignore_errors=True)
    runs = work / "runs"
    plans = work / "plans"
    plans.mkdir(exist_ok=True)
    lines = (REPO / "plans" / "data" / "pirate.jsonl").read_text().splitlines()[:160]
    (plans / "chats.jsonl").write_text("\n".join(lines) + "\n")
    B, d = args.budget, args.decay
    budgets = [B // 4, B // 2, B]
    schedule = {"warmup_steps": args.warmup_steps, "decay": d}
    rows = []

    # 1. one plan, three budgets
    wall = bake(write_plan(plans, base, "budgets", budgets=budgets, schedule=schedule), runs)
    trunk = runs / "budgets"
    trained = len(steps_of(trunk / "metrics.jsonl"))
    secs = seconds_of(trunk / "checkpoints")
    train_s = secs[max(secs)]
    for b in budgets:
        branch = trunk / "branches" / str(b)
        own = seconds_of(branch / "checkpoints")
        seed = min(own)
        trained += len(steps_of(branch / "metrics.jsonl", after=seed))
        train_s += own[b] - own[seed]
    rows.append({"case": f"one plan, budgets {budgets}", "optimizer steps": trained, "train s": round(train_s, 2),
                 "bake wall s": round(wall, 2)})

    # 2. three plans
    trained, train_s, wall = 0, 0.0, 0.0
    for b in budgets:
        wall += bake(write_plan(plans, base, f"steps{b}", steps=b, schedule=schedule), runs)
        trained += len(steps_of(runs / f"steps{b}" / "metrics.jsonl"))
        train_s += seconds_of(runs / f"steps{b}" / "checkpoints")[b]
    rows.append({"case": "three plans, from step 0 each", "optimizer steps": trained, "train s": round(train_s, 2),
                 "bake wall s": round(wall, 2)})

    # 3. reuse: steps B, then 2B
    plan = write_plan(plans, base, "grow", steps=B, schedule=schedule)
    bake(plan, runs)
    data = json.loads(plan.read_text())
    data["train"]["steps"] = 2 * B
    plan.write_text(json.dumps(data, indent=1))
    log = runs / "grow" / "log.txt"
    before = log.read_text().count("\n")
    wall = bake(plan, runs)
    said = log.read_text().splitlines()[before:]
    resumed = next((int(x.split("step-")[1][:6]) for x in said if "resuming from step-" in x), 0)
    secs = seconds_of(runs / "grow" / "checkpoints")
    rows.append({"case": f"steps {B} → {2 * B}: the second bake", "optimizer steps": len(steps_of(runs / "grow" / "metrics.jsonl", resumed)),
                 "train s": round(secs[2 * B] - secs[resumed], 2), "bake wall s": round(wall, 2)})

    print(table(rows, ["case", "optimizer steps", "train s", "bake wall s"]))
    decays = [round(d * b) for b in budgets]
    ceiling = max(b - x for b, x in zip(budgets, decays)) + sum(decays)
    step_ratio = rows[1]["optimizer steps"] / rows[0]["optimizer steps"]
    time_ratio = rows[1]["train s"] / rows[0]["train s"]
    print(f"\nsteps: {rows[0]['optimizer steps']} (ceiling B(1-d) + Σ d·b = {ceiling}) vs {rows[1]['optimizer steps']} "
          f"(Σ b = {sum(budgets)}): {step_ratio:.2f}x fewer")
    print(f"training time: {time_ratio:.2f}x less ({100 * abs(time_ratio - step_ratio) / step_ratio:.1f}% from the "
          f"step ratio; goal within 5%); bake wall: {rows[1]['bake wall s'] / rows[0]['bake wall s']:.2f}x")
    print(f"reuse: {rows[2]['optimizer steps']} steps trained of {2 * B} (resumed from step {resumed})")
    save_json("budgets", {"machine": machine, "args": vars(args), "rows": rows, "ceiling": ceiling})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
