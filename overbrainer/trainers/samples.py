"""Sample generations: greedy answers to a few prompts, taken while a model trains.

``config.yaml`` carries what the config step resolved from ``train.samples``::

    samples:
      every: 50              # steps between samples; step 0 (the base) and the last step too
      max_new_tokens: 64
      prompts:               # each a conversation up to the turn to answer
        - [{"role": "user", "content": "..."}]

``samples.jsonl`` in the run folder has one line per sampled step::

    {"step": 50, "samples": [{"prompt": "...", "answer": "..."}, ...]}

``prompt`` is the last user message of each conversation. A resume drops the lines past
the checkpoint it starts from (the steps are taken again, to the same answers). `complete`
is the one greedy-or-sampled generation call: ``chat.Model`` answers with it too.
"""

from __future__ import annotations

from pathlib import Path

from ..portable.common import read_json_lines

__all__ = ["is_sample_step", "complete", "answer", "prompt_text", "read_samples", "by_prompt"]


def is_sample_step(step: int, every: int, max_steps: int) -> bool:
    return step == 0 or step % every == 0 or step == max_steps


def prompt_text(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else messages[-1]["content"]


def complete(model, tokenizer, inputs: dict, max_new_tokens: int, temperature: float = 0.0) -> str:
    """The text `model` adds to `inputs` (token ids on any device), greedy unless
    `temperature` > 0, without its special tokens."""
    import torch

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=pad, use_cache=True, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def answer(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float = 0.0) -> str:
    """The assistant's next turn after `messages`, through the tokenizer's chat template."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return complete(model, tokenizer, dict(inputs), max_new_tokens, temperature)


def read_samples(path: Path) -> list[dict]:
    """samples.jsonl's lines, in step order (a line torn by a kill left out)."""
    out = [line for line in read_json_lines(path)
           if isinstance(line.get("step"), int) and isinstance(line.get("samples"), list)]
    return sorted(out, key=lambda line: line["step"])


def by_prompt(lines: list[dict]) -> list[dict]:
    """The same samples turned around: ``[{"prompt", "answers": [{"step", "answer"}]}]``,
    each prompt's answers in step order (what `overbrainer samples` and the page show)."""
    prompts: dict[str, list[dict]] = {}
    for line in lines:
        for s in line["samples"]:
            prompts.setdefault(s["prompt"], []).append({"step": line["step"], "answer": s["answer"]})
    return [{"prompt": p, "answers": a} for p, a in prompts.items()]
