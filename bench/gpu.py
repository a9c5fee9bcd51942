"""Training on one GPU: the built-in trainer vs TRL's SFTTrainer, same model, same batches.

    python3 bench/gpu.py                      # on the GPU machine: fits in 8 minutes on one H200
    python3 bench/gpu.py --device cpu --tiny  # the same code path here, on a tiny model

Inputs: the machine's torch, transformers, peft and accelerate, plus what ``bench/gpu-wheels``
downloads (trl, datasets, liger-kernel, bitsandbytes, overbrainer's own dependencies),
installed with ``pip install --target /tmp/site`` and put on PYTHONPATH (bench/README.md
has the one command).

What it does, in order:

1. measures the device's bf16 matmul peak (8192² random matrices, CUDA events; 1024² and
   wall time on a CPU): the denominator of MFU;
2. for each case (random-init models of SmolLM2-1.7B's and -135M's shapes, LoRA r=16 on
   every linear of the layers and a full fine-tune), writes a run folder as a bake would
   (``examples.parquet`` by ``split_conversations``, ``config.yaml`` by ``build_config``)
   and runs each contender in its own process on **the same batches** (bench/train.py's
   way: TRL gets the built-in loop's own token ids, labels and step order):
   - ``builtin``: ``python -m overbrainer.trainers.builtin config.yaml``, the real trainer,
     bf16 by "auto", with Liger off and on (``train.liger``);
   - ``builtin-shard`` (the full fine-tunes): the same under ``train.shard``, FSDP2 over every
     GPU under torchrun (on one GPU a world of one: FSDP2's code path and its bf16 policy,
     with nothing to share), or 2 gloo processes with ``--device cpu``;
   - ``trl-padfree``: SFTTrainer, bf16, sdpa, ``padding_free=True`` (``trl``: padded batches,
     with ``--padded``); ``trl-liger``: padding-free with ``use_liger_kernel=True`` (TRL 1.16: RMSNorm, RoPE and
     SwiGLU; its own chunked LM head). Gradient checkpointing off on both sides.
3. prints per contender: useful tokens/s (non-pad tokens, steady state: steps after
   ``--skip``), peak GPU memory (``torch.cuda.max_memory_allocated``), MFU and the largest
   relative loss difference from the built-in's on identical batches; the ratios the issue's
   goals name; writes everything as JSON to ``$OUT/gpu.json`` when ``$OUT`` is set;
4. runs ``pytest -m gpu`` (tests/test_gpu.py).

A contender that fails is one row saying why; the others still run.

MFU counts model FLOPs per useful token, for a document of length s: full fine-tune
``6·N + 12·L·d·s``, LoRA ``4·N + 6·N_lora + 12·L·d·s`` (forward 2N, backward through the
frozen matmuls 2N, no weight grads for them), N the parameters in matmuls (lm_head in,
the embedding lookup out), attention counted non-causal (PaLM's), recomputation not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH), str(REPO), str(REPO / "tests")]

from train import batches, make_chats, run_builtin, thread_env  # noqa: E402

PY = sys.executable

SHAPES = {
    # SmolLM2's configs (rope_theta aside, which costs nothing); vocab 49152, tied embeddings
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=49152),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def work() -> Path:
    root = Path(os.environ.get("BENCH_WORK") or "/tmp/overbrainer-bench") / "gpu"
    root.mkdir(parents=True, exist_ok=True)
    return root


# --- the model, the data and the run folder ------------------------------------------------


def random_model(shape: str) -> Path:
    """A random-init Llama of `shape`, saved in bf16, with the tests' tiny tokenizer (its
    400 ids fall inside the 49152-row embedding: the matmuls are the real model's)."""
    folder = work() / f"model-{shape}"
    if (folder / "config.json").exists():
        return folder
    import torch
    from tiny import make_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=True,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    del model
    if torch.cuda.is_available():
        # this process's caching allocator would keep what the model held (~10 GB for the
        # 1.7B shape: float32, then bf16) reserved while the contenders train in their own
        torch.cuda.empty_cache()
    return folder


def prepare(case: dict, args) -> tuple[Path, dict]:
    """A run folder with examples.parquet and config.yaml, as a bake writes them."""
    import yaml
    from transformers import AutoTokenizer

    from overbrainer.inputs.conversations import split_conversations
    from overbrainer.plan import TrainSettings
    from overbrainer.steps.config import build_config, schedule_steps, special_tokens, write_splits

    base = random_model(case["shape"])
    run = work() / f"run-{case['name']}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    chats = make_chats(args.chats, tokenizer, lo=args.min_len, hi=args.max_len)
    (run / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    summary = split_conversations([run / "chats.jsonl"], run / "examples.parquet", validation=0, seed=0)
    settings = TrainSettings(
        adapter=case["adapter"], steps=args.steps, micro_batch_size=args.batch, gradient_accumulation_steps=1,
        sequence_len=args.max_len, lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=TARGETS,
        learning_rate=1e-4 if case["adapter"] == "lora" else 1e-5, save_every=10**6, eval_every=10**6, seed=0,
        device=args.device, bf16="auto",
    )
    cfg = build_config(settings, str(base), schedule_steps(settings, summary.train), special_tokens(base),
                       has_validation=False)
    write_splits(run / "examples.parquet", run)  # train.parquet, which config.yaml names
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run, cfg


# what a built-in contender's name turns on, after "builtin": "builtin-liger-compile" is both
BUILTIN_OPTIONS = ("liger", "compile", "shard")


def builtin_options(name: str) -> set[str]:
    """{"liger", "compile", "shard"} as `name` says ("builtin", "builtin-liger", ...)."""
    words = name.split("-")
    unknown = [w for w in words[1:] if w not in BUILTIN_OPTIONS]
    if words[0] != "builtin" or unknown:
        raise SystemExit(f"gpu.py: contender {name!r}: a built-in contender is builtin[-liger][-compile][-shard]")
    return set(words[1:])


def profile_window(steps: int) -> dict:
    """``--profile``: train.profile over the 2 steps before the last (the one before them
    warms the profiler up; the last step is left out, as a recorded step runs to the next
    one's top and the run's end has its final checkpoint); the rates leave those 4 out
    (`PROFILE_TAIL`)."""
    return {"start": steps - 2, "steps": 2, "memory": False}


PROFILE_TAIL = 4


def set_contender(run: Path, cfg: dict, liger: bool, processes: int = 0, compile: bool = False,
                  profile: dict | None = None) -> None:
    """config.yaml as `prepare` wrote it (`cfg`), with the Liger keys (``train.liger``) and
    ``torch_compile`` (``train.compile``: each decoder layer) as given and, for `processes`
    > 0, ``shard`` (``train.shard``) with each step's examples in as many micro-batches, one
    a process (the same examples a step: the same math); `profile`: ``train.profile``."""
    import yaml

    cfg = dict(cfg)
    if profile:
        cfg["profile"] = profile
    # each contender says on or off itself: `liger` false is train.liger false (all the keys
    # false and no `liger` would be train.liger "auto", which is on for a LoRA on CUDA)
    cfg["liger"] = liger
    for key in ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy"):
        cfg[key] = liger
    cfg["torch_compile"] = compile
    if processes:
        per_step = cfg["micro_batch_size"] * cfg["gradient_accumulation_steps"]
        if per_step % processes:
            raise RuntimeError(f"--batch {per_step} cannot be shared by {processes} processes")
        cfg.update(shard=True, micro_batch_size=per_step // processes, gradient_accumulation_steps=processes)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def shard_processes(device: str) -> int:
    """Processes of the sharded contender: one per GPU, or 2 on the CPU."""
    import torch

    return max(1, torch.cuda.device_count()) if device.startswith("cuda") else 2


# --- the peak, and the FLOPs of a step -----------------------------------------------------


def timed(work, reps: int, device: str, warm: int = 1) -> float:
    """Seconds that `reps` calls of `work` take on `device` (CUDA events there), after `warm`."""
    import torch

    for _ in range(warm):
        work()
    if not device.startswith("cuda"):
        t = time.perf_counter()
        for _ in range(reps):
            work()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def matmul_peak(device: str) -> float:
    """FLOP/s of a bf16 matmul on `device`, measured (random data: zeros run faster)."""
    import torch

    n, reps = (8192, 20) if device.startswith("cuda") else (1024, 5)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = timed(partial(torch.mm, a, b), reps, device, warm=3)
    del a, b
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # nothing of it held while the contenders train
    return 2 * n**3 * reps / seconds


def layer_matmuls(shape: str, tokens: int, device: str) -> float:
    """FLOP/s of one decoder layer's seven linear layers at `tokens` rows in bf16, forward
    and backward (X·Wᵀ, dY·W, dYᵀ·X): what the model's own matmul shapes reach here. A full
    fine-tune's model FLOPs are nearly all these, so this over the peak is about the most
    MFU a step can have, whatever else it does better."""
    import torch

    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in): q k v o gate up down
    made = [(torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16),
             torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16),
             torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)) for n_out, n_in in shapes]

    def layer():
        for x, w, dy in made:
            x @ w.t(), dy @ w, dy.t() @ x

    cuda = device.startswith("cuda")
    reps = 20 if cuda else 2
    seconds = timed(layer, reps, device)
    made.clear()
    if cuda:
        torch.cuda.empty_cache()
    return 3 * 2 * tokens * sum(o * n for o, n in shapes) * reps / seconds


def step_flops(shape: str, adapter: str, steps: list[list]) -> list[float]:
    """Model FLOPs of each step's examples (the module's docstring says how they count)."""
    s = SHAPES[shape]
    h, i, layers, heads = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["num_attention_heads"]
    kv = s["num_key_value_heads"] * h // heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    n = per_layer * layers + h * s["vocab_size"]
    lora = layers * 16 * (2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h))
    per_token = 6 * n if adapter == "full" else 4 * n + 6 * lora
    return [sum(len(e.ids) * (per_token + 12 * layers * h * len(e.ids)) for e in step) for step in steps]


# --- TRL, in its own process ---------------------------------------------------------------


def worker_trl(run: Path, mode: str, device: str, result: Path) -> None:
    """SFTTrainer on the built-in loop's batches, bf16 where the device has it."""
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    steps = batches(run, cfg)
    flat = [e for step in steps for e in step]
    tokenizer = AutoTokenizer.from_pretrained(cfg["base_model"])
    for key, value in (cfg.get("special_tokens") or {}).items():
        setattr(tokenizer, key, value)
    cuda = device.startswith("cuda")
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    lora = cfg.get("adapter") == "lora"
    torch.manual_seed(cfg["seed"])
    # a LoRA's frozen base in bf16 (as TRL users load it); a full fine-tune's weights in
    # float32 under bf16 autocast, as the built-in trainer keeps them
    model = AutoModelForCausalLM.from_pretrained(cfg["base_model"], dtype=torch.bfloat16 if bf16 and lora else torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
            target_modules=cfg["lora_target_modules"], task_type="CAUSAL_LM",
        ))
    dataset = Dataset.from_dict({"input_ids": [e.ids for e in flat], "labels": [e.labels for e in flat]})
    kw = cfg["lr_scheduler_kwargs"]
    padfree = mode in ("trl-padfree", "trl-liger")
    args = SFTConfig(
        output_dir=str(run / "trl-out"), max_steps=cfg["max_steps"],
        per_device_train_batch_size=cfg["micro_batch_size"], gradient_accumulation_steps=1,
        learning_rate=cfg["learning_rate"], weight_decay=cfg["weight_decay"], max_grad_norm=cfg["max_grad_norm"],
        optim="adamw_torch_fused" if cuda else "adamw_torch", lr_scheduler_type="warmup_stable_decay",
        warmup_steps=cfg["warmup_steps"],
        lr_scheduler_kwargs={k: kw[k] for k in ("num_stable_steps", "num_decay_steps", "warmup_type", "decay_type",
                                                "min_lr_ratio")},
        bf16=bf16, fp16=False, tf32=True if cuda else None, gradient_checkpointing=False, use_cpu=not cuda,
        seed=cfg["seed"], logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        dataloader_pin_memory=cuda, max_length=None if padfree else cfg["sequence_len"], padding_free=padfree,
        use_liger_kernel=mode == "trl-liger",
    )
    marks: dict = {"ends": [], "losses": [], "micro": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            marks["ends"].append(time.perf_counter())
            marks["losses"].append(sum(marks["micro"]))
            marks["micro"].clear()

    class Trainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            marks["micro"].append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss

    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    result.write_text(json.dumps({
        "ends": [t - start for t in marks["ends"]],
        "losses": [float(x) for x in marks["losses"]],
        "peak_memory": torch.cuda.max_memory_allocated() if cuda else None,
    }))


def keep_profile(folder: Path, label: str) -> None:
    """train.profile's files, printed (ops.txt's head) and copied under $OUT as
    profile-<label>-<file>: the timeline only when small enough to bring back."""
    if not folder.is_dir():
        print(f"  {label}: no profile was written", flush=True)
        return
    for ops in sorted(folder.glob("ops*.txt")):
        print("\n".join(ops.read_text().splitlines()[:20]), flush=True)
    out = os.environ.get("OUT")
    if out:
        for f in sorted(folder.iterdir()):
            if not f.name.startswith(".") and (f.suffix == ".txt" or f.stat().st_size <= 32 * 2**20):
                shutil.copyfile(f, Path(out) / f"profile-{label}-{f.name}")


def run_trl(run: Path, mode: str, device: str, timeout: float) -> dict:
    out = run / f"{mode}.json"
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([PY, __file__, "--worker", mode, "--run", str(run), "--device", device, "--result",
                             str(out)], cwd=run, env=thread_env(os.cpu_count() or 1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the worker and whatever it started
        _, stderr = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f} s: {stderr[-1500:]}") from None
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(stderr.strip()[-1500:] or f"exit {proc.returncode}")
    return json.loads(out.read_text())


# --- measuring -----------------------------------------------------------------------------


def steady(ends: list[float], per_step: list[float], skip: int) -> float:
    """Per second over the steps after `skip`: sum(per_step[skip:]) / their time."""
    if len(ends) <= skip + 1:
        skip = 0
    elapsed = ends[-1] - (ends[skip - 1] if skip else 0.0)
    return sum(per_step[skip:len(ends)]) / max(elapsed, 1e-9)


def contender(name: str, case: dict, run: Path, cfg: dict, args, peak: float) -> dict:
    steps = batches(run, cfg)
    useful = [float(sum(len(e.ids) for e in step)) for step in steps]
    flops = step_flops(case["shape"], case["adapter"], steps)
    row = {"case": case["name"], "contender": name}
    try:
        if name.startswith("builtin"):
            options = builtin_options(name)
            processes = shard_processes(args.device) if "shard" in options else 0
            profile = profile_window(args.steps) if args.profile else None
            set_contender(run, cfg, liger="liger" in options, processes=processes, compile="compile" in options,
                          profile=profile)
            shutil.rmtree(run / "profile", ignore_errors=True)
            got = run_builtin(run, max(1, (os.cpu_count() or 1) // max(processes, 1)), processes,
                              timeout=args.contender_timeout)
            if profile:
                keep_profile(run / "profile", f"{case['name']}-{name}")
                got["ends"] = got["ends"][:-PROFILE_TAIL]  # the profiled steps and their warm-up are slower
            lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            memory = max((x.get("memory", 0) for x in lines if "step" in x), default=0) or None
            got["peak_memory"] = memory
        else:
            got = run_trl(run, name, args.device, args.contender_timeout)
    except (RuntimeError, SystemExit) as e:
        lines = [x for x in str(e).strip().splitlines() if x.strip() and not set(x.strip()) <= set("=-")]
        row["error"] = (lines or ["(no message)"])[-1][:300]
        row["error_tail"] = str(e)[-1500:]  # in gpu.json: the rest of what it printed
        return row
    row["tokens_per_s"] = round(steady(got["ends"], useful, args.skip), 1)
    row["mfu"] = round(steady(got["ends"], flops, args.skip) / peak, 4)
    row["peak_memory_gib"] = round(got["peak_memory"] / 2**30, 2) if got.get("peak_memory") else None
    row["losses"] = got["losses"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the same vocabulary, few steps: a dry run")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip", type=int, default=None, help="steps left out of the rates (compile, warmup)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--chats", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--only", default="", help="comma-separated case names (1.7b-lora, 1.7b-full, 135m-lora, 135m-full)")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--padded", action="store_true", help="TRL with padded batches too (its slowest)")
    ap.add_argument("--contenders", default="",
                    help="comma-separated, in place of each case's usual list: builtin[-liger][-compile][-shard], "
                         "trl, trl-padfree, trl-liger (e.g. the full fine-tune's MFU: --only 1.7b-full "
                         "--contenders builtin,builtin-liger,builtin-compile,builtin-liger-compile)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole run: a contender that cannot start with 30 s left is skipped")
    ap.add_argument("--contender-timeout", type=float, default=240, help="seconds before one contender is killed")
    ap.add_argument("--profile", action="store_true",
                    help="the built-in contenders record the 2 steps before their last with train.profile (ops.txt "
                         "printed, copied under $OUT); the rates leave out the last 4 steps")
    ap.add_argument("--worker"), ap.add_argument("--run"), ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        worker_trl(Path(args.run), args.worker, args.device, Path(args.result))
        return 0
    for name in filter(None, args.contenders.split(",")):  # a misspelled one stops here, before any training
        if name.startswith("builtin"):
            builtin_options(name)
        elif name not in ("trl", "trl-padfree", "trl-liger"):
            raise SystemExit(f"gpu.py: contender {name!r}: one of builtin[-liger][-compile][-shard], "
                             "trl, trl-padfree, trl-liger")
    # the trainer's process imports overbrainer from this checkout (installed or not)
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    tiny = args.tiny
    args.steps = args.steps or (6 if tiny else 20)
    args.skip = args.skip if args.skip is not None else (2 if tiny else 5)
    args.batch = args.batch or (2 if tiny else 16)
    args.chats = args.chats or args.steps * args.batch
    if tiny:
        args.max_len = min(args.max_len, 256)

    import torch
    import transformers

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu.py: --device cuda, but torch sees no GPU; use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    try:
        import liger_kernel  # noqa: F401

        liger = cuda
    except ImportError:
        liger = False
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU'}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; liger {'available' if liger else 'not available here'}")
    peak = matmul_peak(args.device)
    print(f"# bf16 matmul peak, measured: {peak / 1e12:.1f} TFLOP/s")

    shapes = ["tiny"] if tiny else ["1.7b", "135m"]
    cases = [{"name": f"{s}-{a}", "shape": s, "adapter": a} for s in shapes for a in ("lora", "full")]
    if args.only:
        cases = [c for c in cases if c["name"] in args.only.split(",")]
    elif not tiny:
        cases = [c for c in cases if c["name"] != "135m-full"]  # no goal names it; the 8 minutes are short
    began = time.monotonic()
    left = (lambda: args.deadline - (time.monotonic() - began)) if args.deadline else (lambda: float("inf"))
    out_json = Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else None

    def save(report: dict | None = None) -> None:
        """gpu.json as it stands: after every contender, so a run cut short keeps its rows."""
        if out_json:
            out_json.write_text(json.dumps({"device": args.device, "peak_flops": peak, "rows": rows,
                                            "layer_matmuls": ceilings, **(report or {})}, indent=1))

    rows = []
    ceilings: dict = {}  # shape: {"tokens", "flops"}: its layer matmuls' rate (layer_matmuls)
    for case in cases:
        if left() < 30:
            rows.append({"case": case["name"], "contender": "(all)", "error": "skipped: --deadline reached"})
            continue
        run, cfg = prepare(case, args)
        if case["shape"] not in ceilings:
            steps = batches(run, cfg)
            tokens = round(sum(len(e.ids) for step in steps for e in step) / len(steps))
            ceilings[case["shape"]] = {"tokens": tokens, "flops": layer_matmuls(case["shape"], tokens, args.device)}
            print(f"# the {case['shape']} shape's layer matmuls at {tokens:,} tokens (a step's mean), bf16 forward and "
                  f"backward: {ceilings[case['shape']]['flops'] / 1e12:.1f} TFLOP/s, "
                  f"{ceilings[case['shape']]['flops'] / peak:.0%} of the peak (about the most MFU a step can have)",
                  flush=True)
        # TRL padded (`trl`) only with --padded: on 2026-12-04 it was TRL's slowest (bench/README)
        names = ["builtin", "trl", "trl-padfree"] if args.padded else ["builtin", "trl-padfree"]
        if liger:
            names[1:1] = ["builtin-liger"]  # train.liger "auto" on a CUDA GPU: the built-in's default there
            names.append("trl-liger")
        if case["shape"] != shapes[0]:
            # the goal's cases run every contender; the smaller model the built-in's and TRL's padding-free
            names = [n for n in names if n in ("builtin", "builtin-liger" if liger else "builtin", "trl-padfree")]
        elif case["adapter"] == "full":
            names = [n for n in names if n != "trl-liger"]
        if case["adapter"] == "full" and case["shape"] == shapes[0]:
            names.append("builtin-shard")  # train.shard: FSDP2 (the bigger full fine-tune only: 8 minutes)
        if args.contenders:
            names = [n for n in args.contenders.split(",") if n]
        for name in names:
            if left() < 30:
                rows.append({"case": case["name"], "contender": name, "error": "skipped: --deadline reached"})
                continue
            t = time.monotonic()
            args.contender_timeout = min(args.contender_timeout, max(left(), 30))
            row = contender(name, case, run, cfg, args, peak)
            row["wall_s"] = round(time.monotonic() - t, 1)
            rows.append(row)
            print(f"  {case['name']:10} {name:14} " + (f"failed: {row['error']}" if "error" in row else
                  f"{row['tokens_per_s']:>10.0f} tok/s  MFU {row['mfu']:.1%}  peak {row['peak_memory_gib']} GiB"
                  f"  ({row['wall_s']} s)"), flush=True)
            save()
    report = summarize(rows)
    print(report["table"])
    for line in report["goals"]:
        print(line)
    save(report)
    if not args.no_pytest:
        proc = subprocess.run([PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                              cwd=REPO, capture_output=True, text=True)
        tail = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"# pytest -m gpu: exit {proc.returncode}: {tail}")
        report["pytest"] = {"exit": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}
    if out_json:
        save(report)
        print(f"# results: {out_json}")
    return 0


def summarize(rows: list[dict]) -> dict:
    """The table (with each contender's loss difference from the built-in's on the same
    batches) and the goals' ratios."""
    out, goals = [], []
    for row in rows:
        ref = next((r for r in rows if r["case"] == row["case"] and r["contender"] == "builtin" and "losses" in r), None)
        if "losses" in row and ref:
            diffs = [abs(a - b) / max(abs(b), 1e-9) for a, b in zip(row["losses"], ref["losses"])]
            row["loss_diff"] = round(max(diffs), 5) if diffs else None
    header = "| case | contender | useful tok/s | MFU | peak GiB | max rel. loss diff vs builtin |\n|---|---|---|---|---|---|"
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['contender']} | failed: {r['error']} | | | |")
        else:
            out.append(f"| {r['case']} | {r['contender']} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | "
                       f"{r['peak_memory_gib']} | {r.get('loss_diff')} |")
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r for r in rows if r["case"] == case and "error" not in r]
        # builtin-shard is reported beside, not as the built-in's best: on one GPU it is a
        # world of one, which a plan cannot ask for
        ours = max((r for r in ok if r["contender"].startswith("builtin") and "shard" not in builtin_options(r["contender"])),
                   key=lambda r: r["tokens_per_s"], default=None)
        shard = next((r for r in ok if r["contender"] == "builtin-shard"), None)
        if ours and case.endswith("-full"):
            goals.append(f"# {case}: the built-in's best MFU {ours['mfu']:.1%} ({ours['contender']}; the goal for "
                         "the 1.7B shape: 45 %)")
        if ours and shard:
            goals.append(f"# {case}: builtin-shard (FSDP2) {shard['tokens_per_s'] / ours['tokens_per_s']:.2f}x "
                         f"{ours['contender']} in useful tokens/s, MFU {shard['mfu']:.1%}, peak memory "
                         f"{shard['peak_memory_gib']} GiB, loss diff {shard.get('loss_diff')}")
        theirs = max((r for r in ok if r["contender"].startswith("trl")), key=lambda r: r["tokens_per_s"], default=None)
        if ours and theirs:
            memory = (f", peak memory {ours['peak_memory_gib']} vs {theirs['peak_memory_gib']} GiB"
                      if ours.get("peak_memory_gib") and theirs.get("peak_memory_gib") else "")
            goals.append(f"# {case}: {ours['contender']} {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
                         f"{theirs['contender']} (TRL's best) in useful tokens/s, MFU {ours['mfu']:.1%}{memory}")
    return {"table": header + "\n" + "\n".join(out), "goals": goals}


if __name__ == "__main__":
    sys.exit(main())
