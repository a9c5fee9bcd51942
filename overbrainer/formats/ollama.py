"""An Ollama ``Modelfile`` beside the GGUF: ``ollama create <name> -f baked/Modelfile``.

::

    FROM ./demo-q8_0.gguf
    TEMPLATE \"\"\"...\"\"\"          the chat template, in Ollama's Go template language
    SYSTEM \"\"\"...\"\"\"            the system prompt the chat template puts in when none is given
    PARAMETER stop "<|im_end|>"   the tokens that end the model's turn

Ollama runs Go templates, not the Jinja ones Hugging Face tokenizers carry, so the template is
translated. That is done for ChatML-style templates (``<|im_start|>role\\n...<|im_end|>\\n``,
SmolLM2's and the tiny test model's), recognised by rendering the Jinja template on probe
conversations and comparing with ChatML; any other template is left out of the Modelfile, and
Ollama picks its own from the GGUF's ``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["modelfile", "chatml_system"]

# Ollama's Go template for ChatML: every message of the conversation, then the assistant's
# turn opened. A default system prompt goes in SYSTEM (Ollama adds it as the first message).
CHATML_TEMPLATE = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

_PROBE = [
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def modelfile(merged: Path, gguf_name: str) -> str:
    """The Modelfile text for ``gguf_name`` (a file in the same folder), from the merged model's
    tokenizer files."""
    config = _read_json(merged / "tokenizer_config.json")
    template = _chat_template(merged, config)
    eos = _content(config.get("eos_token"))
    lines = [f"FROM ./{gguf_name}", ""]
    system = chatml_system(template, config) if template else None
    if system is not None:
        lines += [f'TEMPLATE """{CHATML_TEMPLATE}"""', ""]
        if system:
            lines += [f'SYSTEM """{system}"""', ""]
        stops = ["<|im_end|>", "<|im_start|>"]  # the end of a turn, and the start of another
    else:
        lines += [
            "# TEMPLATE: the chat template is not ChatML, so it is not translated here;",
            "# Ollama picks one from the GGUF's tokenizer.chat_template.",
            "",
        ]
        stops = []
    if eos and eos not in stops:
        stops.insert(0, eos)
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines) + "\n"


def chatml_system(template: str, special_tokens: dict) -> str | None:
    """For a ChatML-style Jinja template: the system prompt it inserts when the conversation
    has none ("" for none). None when the template is not ChatML."""
    try:
        plain = _render(template, _PROBE, special_tokens)
        with_system = _render(template, [{"role": "system", "content": "S"}, *_PROBE], special_tokens)
    except Exception:  # a template that needs more than the probe: not plain ChatML
        return None
    turns = _chatml(_PROBE)
    if with_system != _chatml([{"role": "system", "content": "S"}]) + turns:
        return None
    if plain == turns:
        return ""
    head = "<|im_start|>system\n"
    tail = "<|im_end|>\n" + turns
    if plain.startswith(head) and plain.endswith(tail) and len(plain) > len(head) + len(tail):
        return plain[len(head) : -len(tail)]
    return None


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _render(template: str, messages: list[dict], special_tokens: dict) -> str:
    # as transformers renders chat templates: a sandbox, blocks trimmed
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    tokens = {k: _content(special_tokens.get(k)) or "" for k in ("bos_token", "eos_token")}
    rendered = env.from_string(template).render(messages=messages, add_generation_prompt=True, **tokens)
    # the generation prompt is the template's last words; the probe compares what comes before
    opening = "<|im_start|>assistant\n"
    return rendered[: -len(opening)] if rendered.endswith(opening) else rendered + "\x00"


def _chat_template(merged: Path, config: dict) -> str | None:
    jinja = merged / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
