"""Does llama.cpp answer like transformers? The baked GGUF files of a run, side by side with merged/.

Run by hand, with the project's venv, given a Python that has llama-cpp-python (a separate
venv: it compiles llama.cpp, which is no dependency of overbrainer)::

    python3 -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    .venv/bin/python bench/check_llamacpp.py --llama-python /tmp/llamacpp-venv/bin/python
    .venv/bin/python bench/check_llamacpp.py --llama-python ... --run runs/demo   # a baked run

Without ``--run`` it bakes a short copy of ``plans/demo.json`` (the real SmolLM2-135M-Instruct,
a few steps) with ``bake.formats`` = safetensors, gguf-f16, gguf-q8_0, ollama. For every GGUF in
``baked/`` and every prompt it prints whether llama.cpp cuts the chat text into the same tokens
as the merged model's tokenizer, the largest difference of the next-token logits, whether the
greedy answers (from the same prompt tokens) are the same, and llama.cpp's own chat completion
(its reading of the GGUF's chat template and end-of-turn token) against transformers' answer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "Name a primary colour.",
    "What is 12 plus 30?",
]
NEW_TOKENS = 32

# Runs under --llama-python: reads a job on stdin, answers on stdout. Only llama-cpp-python's
# public API; the transformers side stays in this process.
WORKER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_ctx=1024, n_threads=2, logits_all=True, verbose=False, seed=0)
eos = llm.token_eos()
out = []
for p in job["prompts"]:
    tokens = llm.tokenize(p["text"].encode("utf-8"), add_bos=False, special=True)
    llm.reset()
    llm.eval(p["ids"])
    last = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    answer = []
    for _ in range(job["new_tokens"]):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        answer.append(nxt)
        if nxt == eos:
            break
        llm.eval([nxt])
    llm.reset()
    chat = llm.create_chat_completion(
        messages=[{"role": "user", "content": p["prompt"]}], temperature=0.0, top_k=1,
        max_tokens=job["new_tokens"], seed=0,
    )["choices"][0]["message"]["content"]
    out.append({"tokens": tokens, "logits": last.tolist(), "answer": answer, "chat": chat})
print(json.dumps({"eos": eos, "results": out}))
"""


# Runs under --llama-python: llama.cpp's own quantizer (llama-quantize), f32 GGUF -> ftype.
QUANTIZE = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""
FLOAT_TYPES = ("f32", "f16")  # bf16 keeps 8 bits: near ties tip as with quantized types


def bake_demo(work: Path, steps: int) -> Path:
    plan = json.loads((REPO / "plans" / "demo.json").read_text())
    plan["data"] = str(REPO / "plans" / plan["data"])
    plan["train"].update(
        epochs=None, steps=steps, micro_batch_size=2, gradient_accumulation_steps=1,
        sequence_len=128, save_every=steps, eval_every=steps,
    )
    plan["bake"] = {"formats": ["safetensors", "gguf-f16", "gguf-q8_0", "ollama"]}
    path = work / "demo-llamacpp.json"
    path.write_text(json.dumps(plan, indent=2))
    proc = subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", "bake", str(path), "--json"],
        cwd=work, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"the bake failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return Path(json.loads(proc.stdout.strip().splitlines()[-1])["folder"])


def transformers_side(merged: Path, gguf: Path | None = None) -> tuple[list[dict], int]:
    """Prompt tokens, next-token logits and greedy answers from merged/ or, given ``gguf``,
    from that file as transformers' GGUF reader dequantizes it (float32 compute)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    if gguf is None:
        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    rows = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            last = model(**ids).logits[0, -1]
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answer = out[0, ids["input_ids"].shape[1]:].tolist()
        rows.append({
            "prompt": prompt, "text": text, "ids": ids["input_ids"][0].tolist(), "logits": last,
            "answer": answer, "said": tokenizer.decode(answer, skip_special_tokens=True).strip(),
        })
    return rows, tokenizer.eos_token_id


def llamacpp_side(python: str, gguf: Path, rows: list[dict]) -> dict:
    job = {
        "model": str(gguf), "new_tokens": NEW_TOKENS,
        "prompts": [{"prompt": r["prompt"], "text": r["text"], "ids": r["ids"]} for r in rows],
    }
    proc = subprocess.run([python, "-c", WORKER], input=json.dumps(job), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llama.cpp could not run {gguf.name}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_as_llama_quantize(python: str, merged: Path, gguf: Path, work: Path) -> str:
    """Whether llama.cpp's own quantizer, given the same weights in f32, writes the same tensor
    bytes as our file of that type."""
    import gguf as gg
    import numpy as np

    from overbrainer.formats.gguf import write_gguf

    qtype = gguf.stem.rsplit("-", 1)[1]
    if qtype == "f32":
        return "(f32: nothing to quantize)"
    if qtype == "mxfp4":
        return "(llama-quantize has MXFP4 for MoE experts only: nothing to compare on a dense model)"
    f32, theirs = work / "f32.gguf", work / f"llama-quantize-{qtype}.gguf"
    if not f32.exists():
        write_gguf(merged, f32, "f32", "check")
    ftype = int(gg.GGUFReader(gguf).fields["general.file_type"].contents())
    proc = subprocess.run([python, "-c", QUANTIZE, str(f32), str(theirs), str(ftype)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"llama-quantize failed ({proc.stderr.strip().splitlines()[-1:]})"
    ours = {t.name: t for t in gg.GGUFReader(gguf).tensors}
    other = {t.name: t for t in gg.GGUFReader(theirs).tensors}
    if set(ours) != set(other):
        return f"DIFF tensor names: {sorted(set(ours) ^ set(other))[:4]}"
    differ = [
        n for n in ours
        if ours[n].tensor_type != other[n].tensor_type
        or not np.array_equal(np.asarray(ours[n].data).view(np.uint8), np.asarray(other[n].data).view(np.uint8))
    ]
    return f"DIFF in {len(differ)} of {len(ours)} tensors, e.g. {differ[:3]}" if differ else f"same ({len(ours)} tensors)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    parser.add_argument("--run", type=Path, help="a baked run folder (default: bake a short demo)")
    parser.add_argument("--steps", type=int, default=6, help="training steps of the short demo")
    args = parser.parse_args()

    import torch

    run = args.run or bake_demo(Path(tempfile.mkdtemp(prefix="check-llamacpp-")), args.steps)
    baked, merged = run / "baked", run / "merged"
    ggufs = sorted(baked.glob("*.gguf"))
    if not ggufs:
        sys.exit(f"{baked} has no .gguf file; add a gguf format to bake.formats")
    rows, eos = transformers_side(merged)
    print(f"run: {run}\n")
    failures = 0
    work = Path(tempfile.mkdtemp(prefix="check-llamacpp-quantize-"))
    for gguf in ggufs:
        quantized = same_as_llama_quantize(args.llama_python, merged, gguf, work)
        got = llamacpp_side(args.llama_python, gguf, rows)
        # the same file in transformers: what the GGUF holds, apart from how llama.cpp computes
        same_file, _ = transformers_side(merged, gguf)
        print(f"== {gguf.name}  (llama.cpp eos {got['eos']}, transformers eos {eos})")
        print(f"   tensor bytes against llama-quantize of the same weights: {quantized}")
        print("   llama.cpp against merged/ | against this GGUF read by transformers")
        print(f"{'prompt':34} {'tokens':>6} {'max|Δlogit|':>11} {'top-1':>5} {'greedy':>6} {'chat':>5} |"
              f" {'max|Δlogit|':>11} {'greedy':>6}")
        for row, dequantized, res in zip(rows, same_file, got["results"]):
            same_tokens = res["tokens"] == row["ids"]
            logits = torch.tensor(res["logits"])
            diff = (logits - row["logits"]).abs().max().item()
            top1 = int(logits.argmax()) == int(row["logits"].argmax())
            theirs = [t for t in res["answer"] if t != got["eos"]]
            greedy = [t for t in row["answer"] if t != eos] == theirs
            chat = res["chat"].strip() == row["said"]
            file_diff = (logits - dequantized["logits"]).abs().max().item()
            file_greedy = [t for t in dequantized["answer"] if t != eos] == theirs
            # a quantized type may tip a near tie: llama.cpp also rounds the activations (to
            # q8_0) in its quantized matmuls; the file is checked by its bytes instead
            exact = gguf.stem.rsplit("-", 1)[1] in FLOAT_TYPES
            failures += not same_tokens or (exact and not (top1 and greedy))
            print(f"{row['prompt'][:34]:34} {'same' if same_tokens else 'DIFF':>6} {diff:11.4f} "
                  f"{'same' if top1 else 'DIFF':>5} {'same' if greedy else 'DIFF':>6} {'same' if chat else 'DIFF':>5} |"
                  f" {file_diff:11.4f} {'same' if file_greedy else 'DIFF':>6}")
            if not chat:
                print(f"    transformers: {row['said']!r}\n    llama.cpp:    {res['chat'].strip()!r}")
        # the ternary types are BitNet's: llama-quantize picks other fallbacks for other models
        if not gguf.stem.endswith(("-tq1_0", "-tq2_0")):
            failures += quantized.startswith(("DIFF", "llama-quantize failed"))
        print()
    shutil.rmtree(work, ignore_errors=True)
    print("llama.cpp agrees with transformers" if not failures else f"{failures} disagreement(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
