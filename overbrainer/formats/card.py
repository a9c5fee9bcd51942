"""The model card, ``baked/README.md``, and its loss curve, ``baked/loss.png``.

Both are read from the run's ``metrics.jsonl`` (one line per optimizer step: step, tokens,
loss, lr, eval_loss on eval steps, seconds, phase) and the steps' stamps: the card says what
the model was made from, how, how the losses went, and how to use each file in ``baked/``.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard

from ..portable.common import read_json_lines

__all__ = ["read_metrics", "metrics_table", "plot_loss", "model_card", "card_data"]

# the Hub's library_name for the card: the first kind of file baked/ holds, in this order
_LIBRARIES = (("safetensors", "transformers"), ("gguf", "gguf"), ("adapter", "peft"))
PHASE_COLORS = {"warmup": "#f4a261", "stable": "#8ab6d6", "decay": "#90be6d"}


def read_metrics(path: Path) -> list[dict]:
    """The metric lines, one per step (the last line of a step wins), in step order. A torn
    last line (a killed trainer) is skipped."""
    by_step = {m["step"]: m for m in read_json_lines(path) if isinstance(m.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _fmt(value, spec: str = ".4f") -> str:
    if value is None:
        return "—"
    return format(value, spec) if isinstance(value, float) else str(value)


def metrics_table(metrics: list[dict]) -> str:
    """A Markdown table of every eval step and the last step."""
    if not metrics:
        return "No metrics were logged."
    last = metrics[-1]["step"]
    rows = [m for m in metrics if m.get("eval_loss") is not None or m["step"] == last]
    lines = ["| step | loss | eval_loss | lr | phase |", "|---:|---:|---:|---:|---|"]
    for m in rows:
        lines.append(
            f"| {m['step']} | {_fmt(m.get('loss'))} | {_fmt(m.get('eval_loss'))} "
            f"| {_fmt(m.get('lr'), '.2e')} | {m.get('phase') or '—'} |"
        )
    return "\n".join(lines)


def _phase_spans(metrics: list[dict]) -> list[tuple[str, int, int]]:
    """(phase, first step, last step) for each run of steps in the same phase."""
    spans: list[tuple[str, int, int]] = []
    for m in metrics:
        phase = m.get("phase") or "?"
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], m["step"])
        else:
            spans.append((phase, m["step"], m["step"]))
    return spans


def plot_loss(metrics: list[dict], path: Path, title: str = "") -> None:
    """Train and eval loss by step, the schedule's phases shaded, as a PNG."""
    # the Agg canvas directly, not pyplot: no global backend switched in the caller's process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shaded = set()
    for phase, first, last in _phase_spans(metrics):
        ax.axvspan(
            first - 0.5, last + 0.5, color=PHASE_COLORS.get(phase, "#cccccc"), alpha=0.25, lw=0,
            label=None if phase in shaded else phase,
        )
        shaded.add(phase)
    train = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None]
    evals = [(m["step"], m["eval_loss"]) for m in metrics if m.get("eval_loss") is not None]
    if train:
        ax.plot(*zip(*train), color="#1d3557", lw=1.5, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", color="#e63946", lw=1.5, ms=4, label="eval loss")
    if not metrics:
        ax.text(0.5, 0.5, "no metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if metrics:
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    # no "Software" stamp: the same metrics make the same bytes
    fig.savefig(path, format="png", metadata={"Software": None})


def model_card(card: dict, metrics: list[dict], files: dict[str, str]) -> str:
    """The card's Markdown. ``files`` maps what ``baked/`` holds to the format that made it:
    ``{"model.safetensors": "safetensors", "demo-q8_0.gguf": "gguf-q8_0", ...}``."""
    data, train, result = card["data"], card["train"], card["result"]
    settings = "\n".join(f"| `{k}` | `{v}` |" for k, v in train.items() if k != "schedule")
    schedule = train["schedule"]
    sources = ", ".join(f"`{name}` ({n})" for name, n in data.get("files", {}).items())
    how = (
        "the LoRA adapter merged into the weights" if train["adapter"] in ("lora", "qlora") else "a full fine-tune"
    )
    warmup = f"{schedule['warmup_steps']} steps" if schedule.get("warmup_steps") is not None else f"{schedule['warmup']:g}"
    decay = f"{schedule['decay_steps']} steps" if schedule.get("decay_steps") is not None else f"{schedule['decay']:g}"
    branch = card.get("branch")
    branched = (
        f"\nA decay branch ({branch['label']}): the run's shared stable phase up to its checkpoint "
        f"`{branch['trunk']}`, then a decay of its own to step {result['steps']}; the same weights as a run of "
        f"{result['steps']} steps from step 0.\n" if branch else ""
    )
    body = f"""
# {card['name']}

Fine-tuned from {_base_named(card)} by [overbrainer](https://pypi.org/project/overbrainer/)
({train['adapter']}, {result['steps']} steps, {how}).
{branched}
## Files

{_files_section(files)}

## Data

{data['rows']} conversations from {sources}: {data['train']} for training, {data['validation']} for
validation; {data['duplicates']} exact duplicates dropped.

## Result

| | |
|---|---|
| final training loss | {_fmt(result['loss'])} |
| final validation loss | {_fmt(result['eval_loss'])} |
| tokens trained | {result['tokens']} |
| training time | {result['seconds']:.0f} s ({result['tokens_per_second']:.0f} tokens/s) |

## Training

Every evaluation step, and the last:

{metrics_table(metrics)}

![Train and eval loss by step, the warmup, stable and decay phases shaded](loss.png)

## Settings

| setting | value |
|---|---|
{settings}
| `schedule` | warmup {warmup}, decay {decay} (warmup-stable-decay) |

## Use

{_use_section(card['name'], files)}
"""
    return str(ModelCard(f"---\n{card_data(card, files).to_yaml()}\n---\n{body}"))


def card_data(card: dict, files: dict[str, str]):
    """The card's front matter, as the Hub reads it: base_model (a Hub id, never a local
    path), license, datasets, pipeline_tag, library_name, tags, and a model-index entry with
    the final validation loss."""
    from huggingface_hub import EvalResult, ModelCardData

    kinds = [fmt.split("-")[0] for fmt in files.values()]
    library = next((lib for kind, lib in _LIBRARIES if kind in kinds), "transformers")
    tags = ["overbrainer", card["train"]["adapter"], *(["gguf"] if "gguf" in kinds else []),
            *(["ollama"] if "ollama" in kinds else [])]
    result = card["result"]
    evals = None
    if result.get("eval_loss") is not None:
        datasets = card.get("datasets") or []
        evals = [EvalResult(
            task_type="text-generation", task_name="Causal language modeling",
            dataset_type=datasets[0] if len(datasets) == 1 else "validation",
            dataset_name="the held-out validation split of the training data", dataset_split="validation",
            metric_type="loss", metric_name="validation loss", metric_value=round(float(result["eval_loss"]), 6),
        )]
    return ModelCardData(
        base_model=card.get("base_model"), license=card.get("license"), datasets=card.get("datasets") or None,
        pipeline_tag="text-generation", library_name=library, tags=tags,
        model_name=card["name"] if evals else None, eval_results=evals,
    )


def _base_named(card: dict) -> str:
    hub = card.get("base_model")
    return f"[{hub}](https://huggingface.co/{hub})" if hub else f"`{Path(card['base']).name}` (a local model)"


def _files_section(files: dict[str, str]) -> str:
    formats = set(files.values())
    rows = []
    if "safetensors" in formats:
        rows.append("| `model.safetensors`, `config.json`, tokenizer files | the merged model (Hugging Face transformers) |")
    for file, fmt in files.items():
        if fmt.startswith("gguf-"):
            rows.append(f"| `{file}` | GGUF, {fmt.removeprefix('gguf-')} (llama.cpp, Ollama, LM Studio) |")
    if "ollama" in formats:
        rows.append("| `Modelfile` | Ollama: the GGUF, its chat template and stop tokens |")
    if "adapter" in formats:
        rows.append("| `adapter/` | the LoRA adapter alone (PEFT), to serve over the base model |")
    rows.append("| `loss.png` | the loss curve |")
    return "| file | what |\n|---|---|\n" + "\n".join(rows)


def _use_section(name: str, files: dict[str, str]) -> str:
    formats = set(files.values())
    parts = []
    if "safetensors" in formats:
        parts.append("""With transformers:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/baked")
tokenizer = AutoTokenizer.from_pretrained("path/to/baked")
messages = [{"role": "user", "content": "Hello!"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))
```""")
    gguf = next((f for f, fmt in files.items() if fmt.startswith("gguf-")), None)
    if gguf:
        parts.append(f"""With llama.cpp:

```sh
llama-cli -m path/to/baked/{gguf} -cnv
```""")
    if "ollama" in formats:
        parts.append(f"""With Ollama:

```sh
ollama create {name.lower()} -f path/to/baked/Modelfile
ollama run {name.lower()} "Hello!"
```""")
    if "adapter" in formats:
        parts.append("""The adapter over the base model, with PEFT:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("path/to/the/base/model")
model = PeftModel.from_pretrained(base, "path/to/baked/adapter")
```""")
    return "\n\n".join(parts)
