"""An Ollama ``Modelfile`` beside the GGUF: ``ollama create <name> -f baked/Modelfile``.

::

    FROM ./demo-q8_0.gguf
    TEMPLATE \"\"\"...\"\"\"          the chat template, in Ollama's Go template language
    SYSTEM \"\"\"...\"\"\"            the system prompt the chat template puts in when none is given
    PARAMETER stop "<|im_end|>"   the tokens that end the model's turn
    PARAMETER num_ctx 512         the context the model was trained on (train.sequence_len)

Ollama runs Go templates, not the Jinja ones Hugging Face tokenizers carry, so the template is
translated, for the template families below. A family is recognised by rendering the model's
own Jinja template on probe conversations (with and without a system message, several turns)
and comparing with the family's layout; the Go template of that family renders the same text
(tests/test_ollama.py renders both). A template of no family here is left out, with a warning:
Ollama then picks one from the GGUF's ``tokenizer.chat_template``.

=========  ================================================  ======================
family     a turn                                            ends the model's turn
=========  ================================================  ======================
chatml     ``<|im_start|>user\\nHi<|im_end|>\\n``               ``<|im_end|>``
llama3     ``<|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>``  ``<|eot_id|>``
mistral    ``[INST] Hi [/INST]`` / ``Hello</s>``             ``</s>``
gemma      ``<start_of_turn>user\\nHi<end_of_turn>\\n`` (``model`` for the assistant)  ``<end_of_turn>``
phi3       ``<|user|>\\nHi<|end|>\\n``                        ``<|end|>``
=========  ================================================  ======================

Mistral and Gemma have no system role: their templates put a system message at the head of
the first user message, and so do the Go templates here. A leading BOS token is not part of
the Go template (llama.cpp adds it from the GGUF).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TEMPLATES", "modelfile", "chatml_system", "template_family", "render_jinja", "model_template"]

_SYS = "\x00SYSTEM\x00"  # stands for the system prompt when finding a default one


@dataclass(frozen=True)
class Family:
    name: str
    go: str  # Ollama's TEMPLATE
    layout: Callable[[list[dict]], str]  # the text a conversation makes, generation prompt opened
    end_of_turn: str


def _chatml(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def _llama3(messages):
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _fold_system(messages):
    if messages and messages[0]["role"] == "system":
        system, rest = messages[0]["content"] + "\n\n", messages[1:]
        if rest and rest[0]["role"] == "user":
            return [{"role": "user", "content": system + rest[0]["content"]}, *rest[1:]]
    return messages


def _mistral(messages):
    out = ""
    for m in _fold_system(messages):
        out += f"[INST] {m['content']} [/INST]" if m["role"] == "user" else f"{m['content']}</s>"
    return out


def _gemma(messages):
    turns = "".join(f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{m['content']}<end_of_turn>\n"
                    for m in _fold_system(messages))
    return turns + "<start_of_turn>model\n"


def _phi3(messages):
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


# The Go templates: every message of .Messages, then the assistant's turn opened. A default
# system prompt goes in SYSTEM (Ollama adds it as the first message).
_FOLD = '{{- $system := "" }}'
TEMPLATES = {
    "chatml": Family("chatml", """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
""", _chatml, "<|im_end|>"),
    "llama3": Family("llama3", """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

""", _llama3, "<|eot_id|>"),
    "mistral": Family("mistral", _FOLD + """{{- range .Messages }}
{{- if eq .Role "system" }}{{ $system = .Content }}
{{- else if eq .Role "user" }}[INST] {{ if $system }}{{ $system }}

{{ end }}{{ .Content }} [/INST]{{ $system = "" }}
{{- else }}{{ .Content }}</s>
{{- end }}
{{- end }}""", _mistral, "</s>"),
    "gemma": Family("gemma", _FOLD + """{{- range .Messages }}
{{- if eq .Role "system" }}{{ $system = .Content }}
{{- else }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}
{{ if $system }}{{ $system }}

{{ end }}{{ .Content }}<end_of_turn>
{{ $system = "" }}
{{- end }}
{{- end }}<start_of_turn>model
""", _gemma, "<end_of_turn>"),
    "phi3": Family("phi3", """{{- range .Messages }}<|{{ .Role }}|>
{{ .Content }}<|end|>
{{ end }}<|assistant|>
""", _phi3, "<|end|>"),
}

PROBES = [
    [{"role": "user", "content": "U1"}],
    [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}],
]


def modelfile(merged: Path, gguf_name: str, num_ctx: int | None = None, warn: Callable[[str], None] | None = None) -> str:
    """The Modelfile text for ``gguf_name`` (a file in the same folder), from the merged model's
    tokenizer files; ``num_ctx`` the context length to run it with; ``warn`` is told when the
    template is of no family here (and is left out)."""
    template, config = model_template(merged)
    found = template_family(template, config) if template else None
    lines = [f"FROM ./{gguf_name}", ""]
    stops: list[str] = []
    if found:
        family, system = found
        lines += [f'TEMPLATE """{TEMPLATES[family].go}"""', ""]
        if system:
            lines += [f'SYSTEM """{system}"""', ""]
        stops = [TEMPLATES[family].end_of_turn]
        if family == "chatml":
            stops.append("<|im_start|>")  # the start of another turn
    else:
        lines += [
            "# TEMPLATE: the chat template is of no family overbrainer translates (ChatML, Llama 3,",
            "# Mistral, Gemma, Phi-3), so it is left out; Ollama picks one from the GGUF's tokenizer.chat_template.",
            "",
        ]
        if warn:
            warn("bake: ollama: the chat template is not ChatML, Llama 3, Mistral, Gemma or Phi-3: the Modelfile has "
                 "no TEMPLATE (Ollama falls back on the GGUF's own chat template)")
    eos = _content(config.get("eos_token"))
    if eos and eos not in stops:
        stops.insert(0, eos)
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    if num_ctx:
        lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n"


def template_family(template: str, special_tokens: dict) -> tuple[str, str] | None:
    """(family, default system prompt or "") when the Jinja template lays conversations out as
    one of TEMPLATES does; None otherwise."""
    for name, family in TEMPLATES.items():
        system = _matches(template, family, special_tokens)
        if system is not None:
            return name, system
    return None


def chatml_system(template: str, special_tokens: dict) -> str | None:
    """For a ChatML-style Jinja template: the system prompt it inserts when the conversation
    has none ("" for none). None when the template is not ChatML."""
    return _matches(template, TEMPLATES["chatml"], special_tokens)


def _matches(template: str, family: Family, special_tokens: dict) -> str | None:
    system = None
    for probe in PROBES:
        try:
            plain = render_jinja(template, probe, special_tokens)
            with_system = render_jinja(template, [{"role": "system", "content": "S"}, *probe], special_tokens)
        except Exception:  # a template that needs more than the probe: not this family
            return None
        if with_system != family.layout([{"role": "system", "content": "S"}, *probe]):
            return None
        if plain == family.layout(probe):
            found = ""
        else:  # a default system prompt: the layout with one, where the template put it
            head, _, tail = family.layout([{"role": "system", "content": _SYS}, *probe]).partition(_SYS)
            if not (plain.startswith(head) and plain.endswith(tail) and len(plain) > len(head) + len(tail)):
                return None
            found = plain[len(head): len(plain) - len(tail)]
        if system is not None and found != system:
            return None
        system = found
    return system


def render_jinja(template: str, messages: list[dict], special_tokens: dict) -> str:
    """The template's text for ``messages``, generation prompt opened, as transformers renders
    it (a sandbox, blocks trimmed), without the leading BOS token (llama.cpp adds that)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    tokens = {k: _content(special_tokens.get(k)) or "" for k in ("bos_token", "eos_token")}
    text = env.from_string(template).render(messages=messages, add_generation_prompt=True, **tokens)
    bos = tokens["bos_token"]
    return text[len(bos):] if bos and text.startswith(bos) else text


def model_template(folder: Path) -> tuple[str | None, dict]:
    """A model folder's Jinja chat template (None when it has none) and its tokenizer_config
    (the special tokens the template reads)."""
    config = _read_json(folder / "tokenizer_config.json")
    return _chat_template(folder, config), config


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
