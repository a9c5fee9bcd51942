"""Training on CPU: the built-in trainer's loop vs TRL's SFTTrainer, same model, same batches.

    bench/.venv/bin/python bench/train.py --model tiny|smollm2 [--steps 30] [--skip 5]
        [--chats 400] [--batch 4] [--seq 512] [--lora-r 8] [--threads 2]
        [--only builtin,trl,trl-pad8,trl-padfree,trl-packed] [--rounds 3] [--profile]

The same run folder feeds every contender: ``examples.parquet`` written by
``overbrainer.data.split_conversations`` (no validation rows) and ``config.yaml`` by
``overbrainer.steps.config.build_config``, as a bake would write them. Then, each in its own
process, with ``--threads`` torch threads (OMP_NUM_THREADS too):

- ``builtin``: ``python -m overbrainer.trainers.builtin config.yaml``, the real trainer;
  its ``metrics.jsonl`` gives cumulative tokens and seconds per step.
- ``trl``: ``SFTTrainer`` on the **same batches**: the built-in loop's own tokenization
  (``trainers.examples.load_examples``: token ids and assistant-only labels) and data
  order (``Order``: step k's conversations), fed as ``input_ids``/``labels`` in that
  order with a sequential sampler, batch = the built-in micro-batch, padded to the
  longest in the batch. Same base weights, LoRA (r, alpha, dropout 0, q/k/v/o, seeded
  the same way before ``get_peft_model``), AdamW (``adamw_torch``), warmup-stable-decay
  schedule, clipping, fp32, no gradient checkpointing (TRL's default is on: off is its
  faster setting), no eval, no saving. Its per-step loss is what its ``compute_loss``
  returns (summed over micro-batches): compared step by step with the built-in's.
- ``trl-pad8``: as ``trl``, each batch padded to a multiple of 8 (``SFTConfig``'s
  ``pad_to_multiple_of=8``): on a CPU in bf16, oneDNN's matmuls for each new length are
  prepared once and then reused, as the built-in's ``train.pad_to_multiple_of`` "auto" does.
- ``trl-padfree``: the same batches, ``padding_free=True`` (each batch flattened into one
  sequence with position ids; ``max_length=None``, the inputs being cut already).
- ``trl-packed``: ``packing=True`` (best-fit decreasing into ``--seq``-token rows,
  padding-free), ``--packed-batch`` rows a step: other batches, so no loss comparison.

Steady state: steps ``--skip``+1 .. ``--steps`` only. useful tokens = non-pad tokens
(the built-in's ``tokens`` metric counts attention-mask tokens), loss tokens = positions
with a label. Peak RSS from ``wait4``. ``--profile`` also runs the built-in loop under
py-spy and under ``torch.profiler`` and prints where its time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, measure, print_machine, save_json, table, venv_bin, work_dir  # noqa: E402

WHEELHOUSE = "/tmp/wheels"


# --- preparing the model and the run folder ----------------------------------------------


def model_folder(name: str) -> Path:
    if name == "tiny":
        folder = work_dir("train") / "tiny-llama"
        if not (folder / "config.json").exists():
            sys.path.insert(0, str(REPO / "tests"))
            from tiny import make_tiny_llama

            make_tiny_llama(folder)
        return folder
    os.environ.setdefault("OVERBRAINER_CACHE", str(work_dir("cache")))
    if Path(WHEELHOUSE).is_dir():
        os.environ.setdefault("OVERBRAINER_WHEELHOUSE", WHEELHOUSE)
    from overbrainer.inputs.base_cache import materialize
    from overbrainer.inputs.base_model import parse_base

    return materialize(parse_base("smollm2-135m-instruct", Path(".")), log=lambda m: print(m, flush=True))


_WORDS = (
    "the a of to and in is it that for on with as was at by this be from or have an they which one you "
    "were all we when there can more if no out so what up said about into than them can only other time "
    "new some could these two may first then do any like my now over such our man me even most made after "
    "also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three sea ship wind captain sail map island gold river mountain city"
).split()


def make_chats(n: int, tokenizer, seed: int = 0, lo: int = 20, hi: int = 400) -> list[dict]:
    """`n` chats whose rendered length is spread over [lo, hi] tokens (uniform target)."""
    rng = random.Random(seed)
    # tokens per word of this tokenizer, measured on a sample
    sample = " ".join(rng.choices(_WORDS, k=400))
    per_word = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / 400
    chats = []
    for _ in range(n):
        target = rng.uniform(lo, hi)
        words = max(4, int((target - 12) / per_word))  # ~12 tokens of template
        user_words = max(2, int(words * rng.uniform(0.15, 0.45)))
        answer_words = max(2, words - user_words)
        messages = [
            {"role": "user", "content": " ".join(rng.choices(_WORDS, k=user_words)).capitalize() + "?"},
            {"role": "assistant", "content": " ".join(rng.choices(_WORDS, k=answer_words)).capitalize() + "."},
        ]
        chats.append({"messages": messages})
    return chats


def prepare(args) -> tuple[Path, dict]:
    """A run folder with examples.parquet and config.yaml, as a bake writes them."""
    from transformers import AutoTokenizer

    from overbrainer.inputs.conversations import split_conversations
    from overbrainer.plan import TrainSettings
    from overbrainer.steps.config import build_config, schedule_steps, special_tokens, write_splits

    base = model_folder(args.model)
    run = work_dir("train") / f"run-{args.model}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    chats = make_chats(args.chats, tokenizer)
    data = run / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    summary = split_conversations([data], run / "examples.parquet", validation=0, seed=0)
    settings = TrainSettings(
        steps=args.steps, micro_batch_size=args.batch, gradient_accumulation_steps=args.gas,
        sequence_len=args.seq, lora_r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
        learning_rate=args.lr, save_every=10**6, eval_every=10**6, seed=0,
        group_by_length=not args.no_group_by_length, bf16=args.bf16, compile=args.compile,
    )
    steps = schedule_steps(settings, summary.train)
    cfg = build_config(settings, str(base), steps, special_tokens(base),
                       has_validation=False)
    write_splits(run / "examples.parquet", run)  # train.parquet, which config.yaml names
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run, cfg


def batches(run: Path, cfg: dict) -> list[list]:
    """Step k's examples, in micro-batch order, exactly as the built-in loop trains them."""
    from transformers import AutoTokenizer

    from overbrainer.trainers.examples import Order, load_examples, micro_batches

    tokenizer = AutoTokenizer.from_pretrained(cfg["base_model"])
    for key, value in (cfg.get("special_tokens") or {}).items():
        setattr(tokenizer, key, value)
    train, _, _ = load_examples(run / "examples.parquet", tokenizer, cfg["sequence_len"])
    mbs, gas = cfg["micro_batch_size"], cfg["gradient_accumulation_steps"]
    lengths = [len(e.ids) for e in train] if cfg.get("group_by_length") else None
    order = Order(len(train), mbs * gas, cfg["seed"], lengths)
    out = []
    for k in range(cfg["max_steps"]):
        step = [train[i] for i in order.step(k)]
        out.append([e for micro in micro_batches(step, mbs) for e in micro])
    return out


# --- the contenders (each in its own process) --------------------------------------------


def thread_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1",
                TRANSFORMERS_VERBOSITY="error")


def run_builtin(run: Path, threads: int, processes: int = 0, timeout: float | None = None) -> dict:
    """The real trainer process; its CPU time is read at each new metrics line.
    `processes`: that many under torchrun instead (its CPU time is the launcher's).
    `timeout`: seconds before the process (and its workers) are killed and this fails."""
    import psutil

    metrics = run / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    argv = [PY, "-m", "overbrainer.trainers.builtin", str(run / "config.yaml")]
    if processes:
        argv[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    cpu: dict[int, float] = {}
    with open(run / "trainer.log", "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=run, env=thread_env(threads), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        me = psutil.Process(proc.pid)
        seen, peak_kb = 0, 0
        while proc.poll() is None:
            if timeout is not None and time.perf_counter() - start > timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                raise SystemExit(f"trainer timed out after {timeout:.0f} s: "
                                 f"{(run / 'trainer.log').read_text()[-2000:]}")
            try:
                text = metrics.read_text()
            except OSError:
                text = ""
            steps = text.count('"step"')
            if steps > seen:
                try:
                    t = me.cpu_times()
                    cpu[steps] = t.user + t.system
                except psutil.Error:
                    pass
                seen = steps
            try:  # the peak so far (VmHWM), read while the process is there
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak_kb = max(peak_kb, int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.01)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"trainer exited {proc.returncode}: {(run / 'trainer.log').read_text()[-2000:]}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    lines = [x for x in lines if "step" in x]  # not the stage events
    return {
        "ends": [x["seconds"] for x in lines],
        "cpu": [cpu.get(i + 1) for i in range(len(lines))],
        "losses": [x["loss"] for x in lines],
        "tokens_metric": [x["tokens"] for x in lines],
        "wall_s": wall, "maxrss_mb": peak_kb / 1024,
    }


def worker_trl(run: Path, mode: str, threads: int, packed_batch: int) -> dict:
    """SFTTrainer on the built-in loop's batches (see the module's docstring)."""
    import torch

    torch.set_num_threads(threads)
    import yaml
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    steps = batches(run, cfg)
    flat = [e for step in steps for e in step]
    tokenizer = AutoTokenizer.from_pretrained(cfg["base_model"])
    for key, value in (cfg.get("special_tokens") or {}).items():
        setattr(tokenizer, key, value)
    # seeded and built the way the built-in loop does (trainers/builtin/model.py: load_model)
    torch.manual_seed(cfg["seed"])
    bf16 = bool(cfg.get("bf16"))
    model = AutoModelForCausalLM.from_pretrained(cfg["base_model"], dtype=torch.bfloat16 if bf16 else torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"],
        target_modules=cfg["lora_target_modules"], task_type="CAUSAL_LM",
    ))
    dataset = Dataset.from_dict({"input_ids": [e.ids for e in flat], "labels": [e.labels for e in flat]})

    kw = cfg["lr_scheduler_kwargs"]
    packed = mode == "trl-packed"
    args = SFTConfig(
        output_dir=str(run / "trl-out"), max_steps=cfg["max_steps"],
        per_device_train_batch_size=packed_batch if packed else cfg["micro_batch_size"],
        gradient_accumulation_steps=1 if packed else cfg["gradient_accumulation_steps"],
        learning_rate=cfg["learning_rate"], weight_decay=cfg["weight_decay"], max_grad_norm=cfg["max_grad_norm"],
        optim="adamw_torch", lr_scheduler_type="warmup_stable_decay", warmup_steps=cfg["warmup_steps"],
        lr_scheduler_kwargs={k: kw[k] for k in ("num_stable_steps", "num_decay_steps", "warmup_type", "decay_type",
                                                "min_lr_ratio")},
        bf16=bf16, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=cfg["seed"],
        torch_compile=bool(cfg.get("torch_compile")),
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, train_sampling_strategy="sequential",
        max_length=None if mode == "trl-padfree" else cfg["sequence_len"],
        pad_to_multiple_of=8 if mode == "trl-pad8" else None,
        padding_free=mode == "trl-padfree", packing=packed, packing_strategy="bfd",
    )

    marks: dict = {"ends": [], "cpu": [], "losses": [], "micro": [], "useful": [], "loss_tokens": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks["ends"].append(time.perf_counter())
            marks["cpu"].append(time.process_time())  # every thread of this process
            marks["losses"].append(sum(marks["micro"]))
            marks["micro"].clear()

    class Trainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if "attention_mask" in inputs:
                marks["useful"].append(int(inputs["attention_mask"].sum()))
            else:
                marks["useful"].append(int((inputs["position_ids"] != 0).sum() + (inputs["position_ids"] == 0).sum()))
            marks["loss_tokens"].append(int((inputs["labels"][:, 1:] != -100).sum()))
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            marks["micro"].append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    return {
        "ends": [t - start for t in marks["ends"]],
        "cpu": marks["cpu"],
        "losses": marks["losses"],
        "useful_per_micro": marks["useful"],
        "loss_tokens_per_micro": marks["loss_tokens"],
        "micro_per_step": 1 if packed else cfg["gradient_accumulation_steps"],
    }


# every contender, in the order a round runs them
CONTENDERS = ("builtin", "trl", "trl-pad8", "trl-padfree", "trl-packed")
# TRL's contenders on the built-in's own batches: their losses are compared step by step
SAME_BATCHES = ("trl", "trl-pad8", "trl-padfree")


# the built-in trainer's allocator settings on the CPU where tcmalloc is not installed
# (device.keep_freed_memory), given to TRL's process too with --peer-malloc: glibc reads them
# from the environment
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def builtin_allocator() -> tuple[str, dict]:
    """(its name, its environment): the allocator the built-in trainer's process runs with
    here, tcmalloc preloaded where it is installed (trainers/builtin/allocator.py), else
    glibc keeping freed memory; --peer-malloc gives TRL's process the same."""
    from overbrainer.trainers.builtin import allocator

    library = allocator.to_preload("cpu")
    if library:
        return "tcmalloc", allocator.preloaded(library)
    return "glibc keeping freed memory", KEEP_FREED_MEMORY


def run_trl(run: Path, mode: str, threads: int, packed_batch: int, malloc: bool = False) -> dict:
    out = run / f"{mode}.json"
    out.unlink(missing_ok=True)
    env = dict(thread_env(threads), **(builtin_allocator()[1] if malloc else {}))
    m = measure([PY, __file__, "--worker", mode, "--run", str(run), "--threads", str(threads),
                 "--packed-batch", str(packed_batch), "--result", str(out)], cwd=run, env=env).check()
    result = json.loads(out.read_text())
    result.update(wall_s=m.wall, maxrss_mb=m.maxrss_kb / 1024)
    return result


# --- reading the results -----------------------------------------------------------------


def steady(result: dict, per_step_useful: list[int], per_step_loss: list[int], skip: int) -> dict:
    ends = result["ends"]
    n = len(ends)
    seconds = ends[n - 1] - ends[skip - 1] if skip else ends[n - 1]
    useful = sum(per_step_useful[skip:n])
    loss_tokens = sum(per_step_loss[skip:n])
    cpu = result.get("cpu") or []
    cpu_s = None
    if len(cpu) == n and cpu[n - 1] is not None and (not skip or cpu[skip - 1] is not None):
        cpu_s = cpu[n - 1] - (cpu[skip - 1] if skip else 0.0)
    return {"steps": n - skip, "seconds": seconds, "useful_tps": useful / seconds, "loss_tps": loss_tokens / seconds,
            "useful_per_step": useful / (n - skip), "s_per_step": seconds / (n - skip),
            "cpu_s": cpu_s, "useful_per_cpu_s": useful / cpu_s if cpu_s else None}


def profile_builtin(run: Path, threads: int, steps: int, torch_profile: bool = True) -> str:
    """Where the built-in loop's time goes: py-spy's samples grouped by what the loop was
    doing, and torch.profiler's top operators."""
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["max_steps"] = steps
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = []
    # py-spy: sample the real trainer process
    (run / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    raw = run / "pyspy.txt"
    proc = subprocess.run([venv_bin("py-spy"), "record", "--format", "raw", "-r", "50", "-o", str(raw), "--",
                           PY, "-m", "overbrainer.trainers.builtin", str(run / "config.yaml")],
                          cwd=run, env=dict(thread_env(threads), **builtin_allocator()[1]), capture_output=True, text=True)
    if proc.returncode == 0 and raw.exists():
        out.append(summarize_pyspy(raw))
    else:
        out.append(f"py-spy failed: {proc.stderr[-500:]}")
    if not torch_profile:
        return "\n\n".join(out)
    # torch.profiler: operators, in-process
    (run / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    code = (
        "import sys, torch\n"
        f"torch.set_num_threads({threads})\n"
        "from pathlib import Path\n"
        "from overbrainer.trainers.builtin import loop\n"
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        f"    loop.train(Path({str(run / 'config.yaml')!r}))\n"
        "print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=22, max_name_column_width=50))\n"
    )
    proc = subprocess.run([PY, "-c", code], cwd=run, env=dict(thread_env(threads), **builtin_allocator()[1]),
                          capture_output=True, text=True)
    out.append("torch.profiler, top operators by self CPU time (whole run, model load excluded):\n"
               + "\n".join(line for line in proc.stdout.splitlines() if not line.startswith(("step ", "training "))))
    return "\n\n".join(out)


PHASES = [  # (label, a frame that identifies it), the first match from the leaf up wins
    ("optimizer.step (AdamW)", "step (torch/optim"),
    ("clip_grad_norm_", "clip_grad_norm_"),
    ("backward", "backward (torch/_tensor.py"),
    ("loss: lm_head + cross-entropy", "cross_entropy"),
    ("forward: decoder", "forward (overbrainer/trainers/builtin/model"),
    ("collate", "collate (overbrainer"),
    ("zero_grad", "zero_grad"),
    ("metrics / logging", "json"),
    ("load_examples (tokenize)", "load_examples"),
    ("model load", "load_model"),
    ("checkpoint save", "save (overbrainer/trainers/builtin/loop"),
    ("imports", "<module>"),
]


def summarize_pyspy(raw: Path) -> str:
    """py-spy's collapsed stacks, grouped into the loop's phases (inclusive samples)."""
    phases: Counter = Counter()
    leaves: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        label = "other"
        for name, marker in PHASES:
            if any(marker in f for f in frames):
                label = name
                break
        phases[label] += n
        leaves[frames[-1].split(" (")[0]] += n
    lines = [f"py-spy, {total} samples at 50 Hz of the whole trainer process, by phase (inclusive):"]
    for label, n in phases.most_common():
        lines.append(f"  {label:34} {100 * n / total:5.1f}%")
    lines.append("  hottest Python leaf frames: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in leaves.most_common(8)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--chats", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true",
                    help="both sides compute in bf16 (the base in bf16, the adapter float32; TRL: bf16=True)")
    ap.add_argument("--compile", action="store_true",
                    help="both sides compiled: the built-in's train.compile (each decoder layer), TRL's "
                         "torch_compile=True (the whole model); the first steps compile (raise --skip)")
    ap.add_argument("--no-group-by-length", action="store_true",
                    help="each step's conversations drawn at random (train.group_by_length false)")
    ap.add_argument("--packed-batch", type=int, default=2)
    ap.add_argument("--only", default="builtin,trl,trl-padfree,trl-packed",
                    help="contenders, of " + ", ".join(CONTENDERS))
    ap.add_argument("--peer-malloc", action="store_true",
                    help="TRL's process gets the built-in trainer's allocator too (tcmalloc where installed, else glibc keeping "
                         "freed memory)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the contenders this many times, in turn (A B A B ...): the goal's ratio is then the "
                         "median of the rounds' ratios, each measured side by side")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--no-torch-profile", action="store_true", help="py-spy only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = worker_trl(args.run, args.worker, args.threads, args.packed_batch)
        args.result.write_text(json.dumps(result))
        return

    machine = print_machine()
    run, cfg = prepare(args)
    steps = batches(run, cfg)
    useful = [sum(len(e.ids) for e in s) for s in steps]
    loss_tok = [sum(e.loss_tokens for e in s) for s in steps]
    padded = [sum(max(len(e.ids) for e in s[i:i + args.batch]) * len(s[i:i + args.batch])
                  for i in range(0, len(s), args.batch)) for s in steps]
    lengths = sorted(len(e.ids) for s in steps for e in s)
    print(f"# model {args.model} ({cfg['base_model']}), {args.chats} chats of {lengths[0]}-{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]}), {args.steps} steps of {args.batch}x{args.gas}, seq {args.seq}, "
          f"LoRA r={args.lora_r} on {','.join(cfg['lora_target_modules'])}, {'bf16' if args.bf16 else 'fp32'}{', compiled' if args.compile else ''}, "
          f"{'grouped by length' if cfg.get('group_by_length') else 'random batches'}, {args.threads} threads, "
          f"the built-in trainer's allocator {builtin_allocator()[0]}, TRL's "
          f"{'the same' if args.peer_malloc else 'glibc with its defaults'}; "
          f"steady state: steps {args.skip + 1}-{args.steps}", flush=True)
    print(f"# per step: {sum(useful) / len(useful):.0f} non-pad tokens, {sum(loss_tok) / len(loss_tok):.0f} loss tokens, "
          f"{sum(padded) / len(padded):.0f} padded positions", flush=True)

    wanted = args.only.split(",")
    runs: dict[str, list[dict]] = {}  # each contender's runs, one a round
    for round_ in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"round {round_} of {args.rounds}", flush=True)
        for name in CONTENDERS:
            if name in wanted:
                runs.setdefault(name, []).append(run_contender(name, run, args, useful, loss_tok))
    # each contender's median run (by useful tok/s) stands for it in the table
    results = {}
    for name, tries in runs.items():
        ok = sorted((r for r in tries if "steady" in r), key=lambda r: r["steady"]["useful_tps"])
        results[name] = ok[len(ok) // 2] if ok else tries[0]
    rows = []

    base = results.get("builtin", {}).get("steady")
    for name, r in results.items():
        if "steady" not in r:
            rows.append({"trainer": name, "useful tok/s": "failed"})
            continue
        s = r["steady"]
        row = {"trainer": name, "useful tok/s": s["useful_tps"], "loss tok/s": s["loss_tps"], "s/step": s["s_per_step"],
               "useful tok/CPU-s": s["useful_per_cpu_s"] or "", "CPU-s/step": (s["cpu_s"] or 0) / s["steps"] or "",
               "useful tok/step": s["useful_per_step"], "peak RSS MB": r["maxrss_mb"], "process s": r["wall_s"]}
        if base:
            row["builtin speed-up"] = base["useful_tps"] / s["useful_tps"]
        if name in SAME_BATCHES and "builtin" in results:
            diffs = [abs(a - b) for a, b in zip(results["builtin"]["losses"], r["losses"])]
            row["max |Δloss|"] = f"{max(diffs):.2e}"
            row["Δloss step 1"] = f"{diffs[0]:.2e}"
        rows.append(row)
    print()
    print(table(rows, ["trainer", "useful tok/s", "loss tok/s", "s/step", "useful tok/CPU-s", "CPU-s/step",
                       "useful tok/step", "peak RSS MB",
                       "process s", "builtin speed-up", "max |Δloss|", "Δloss step 1"]))
    if base:
        trl_best = max((r["steady"]["useful_tps"] for n, r in results.items() if n != "builtin" and "steady" in r),
                       default=None)
        if trl_best:
            ratio = base["useful_tps"] / trl_best
            per_round = round_ratios(runs)
            if len(per_round) > 1:
                # side by side within a round: the machine's drift from round to round cancels
                ratio = statistics.median(per_round)
                print("\nuseful tok/s by round: " + "; ".join(
                    f"{name} " + ", ".join(f"{r['steady']['useful_tps']:.0f}" if "steady" in r else "failed" for r in tries)
                    for name, tries in runs.items()))
                print("built-in / TRL's best, by round: " + ", ".join(f"{x:.2f}x" for x in per_round)
                      + f" (median {ratio:.2f}x, {min(per_round):.2f}-{max(per_round):.2f}x)")
            print(f"\ngoal >= 2.5x TRL's best useful tokens/s: {ratio:.2f}x, {'met' if ratio >= 2.5 else 'MISSED'}")
        cpu_best = max((r["steady"]["useful_per_cpu_s"] or 0 for n, r in results.items() if n != "builtin" and "steady" in r),
                       default=0)
        if cpu_best and base["useful_per_cpu_s"]:
            print(f"the same per CPU-second (less sensitive to other processes on the machine): "
                  f"{base['useful_per_cpu_s'] / cpu_best:.2f}x")
        for name in SAME_BATCHES:
            if name in results and "losses" in results[name]:
                b, t = results["builtin"]["losses"], results[name]["losses"]
                print(f"loss per step, builtin vs {name} (first 5): "
                      + ", ".join(f"{x:.5f}/{y:.5f}" for x, y in zip(b[:5], t[:5])))
    if args.profile:
        print("\n" + profile_builtin(run, args.threads, args.profile_steps, torch_profile=not args.no_torch_profile))
    print(f"# results: {save_json(f'train-{args.model}', {'machine': machine, 'args': vars(args), 'results': results, 'rounds': runs}, )}")


def run_contender(name: str, run: Path, args, useful: list[int], loss_tok: list[int]) -> dict:
    """One run of a contender, its steady state added (or why it failed)."""
    print(f"running {name} ...", flush=True)
    try:
        r = run_builtin(run, args.threads) if name == "builtin" else run_trl(run, name, args.threads, args.packed_batch,
                                                                      args.peer_malloc)
    except SystemExit as e:  # a contender that cannot run here is reported, not fatal
        print(f"{name}: failed\n{str(e)[-1500:]}", flush=True)
        return {"failed": str(e)[-1500:]}
    if name == "trl-packed":
        per_step_u, per_step_l = r["useful_per_micro"], r["loss_tokens_per_micro"]
    else:
        per_step_u, per_step_l = useful, loss_tok
    s = r["steady"] = steady(r, per_step_u, per_step_l, args.skip)
    print(f"  {name}: {s['useful_tps']:.1f} useful tok/s, {s['loss_tps']:.1f} loss tok/s, {s['s_per_step']:.2f} s/step, "
          f"peak RSS {r['maxrss_mb']:.0f} MB, process {r['wall_s']:.1f} s", flush=True)
    return r


def round_ratios(runs: dict[str, list[dict]]) -> list[float]:
    """The built-in's useful tok/s over the best peer's, round by round (rounds where both ran)."""
    ratios = []
    for k, mine in enumerate(runs.get("builtin", [])):
        peers = [tries[k]["steady"]["useful_tps"] for name, tries in runs.items()
                 if name != "builtin" and k < len(tries) and "steady" in tries[k]]
        if "steady" in mine and peers:
            ratios.append(mine["steady"]["useful_tps"] / max(peers))
    return ratios


if __name__ == "__main__":
    main()
