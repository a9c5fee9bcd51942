"""Chat templates: the plan's ``chat_template``, for bases without one or to override theirs.

``chat_template`` is one of:

- a family name, :data:`FAMILIES`: ``chatml`` (``<|im_start|>role\\n...<|im_end|>``),
  ``llama3`` (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``), ``mistral``
  (``[INST] ... [/INST]...</s>``, a system turn put before the first user turn), ``gemma``
  (``<start_of_turn>user|model\\n...<end_of_turn>``, no system turn, as Gemma's own) and
  ``phi3`` (``<|user|>\\n...<|end|>``); each with the token that ends a turn;
- a file (``.jinja``, or any existing path; relative to the plan's folder) holding a Jinja
  template, as Hugging Face tokenizers carry them;
- a Jinja template itself (it has ``{{`` or ``{%``).

A template's end-of-turn token is the family's, or for Jinja of its own the text a rendered
assistant turn ends with, when that text is one of the tokenizer's special tokens (else the
tokenizer's eos). The config step sets it as the eos token, and the pad token to it where the
base has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import OverbrainerError

__all__ = ["FAMILIES", "Template", "resolve_template", "end_of_turn"]

FAMILIES: dict[str, tuple[str, str]] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        "<|im_end|>",
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        "<|eot_id|>",
    ),
    "mistral": (
        "{{ bos_token }}{% set system = '' %}"
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
        "{% set messages = messages[1:] %}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('mistral has no ' + message['role'] + ' turns') }}{% endif %}"
        "{% endfor %}",
        "</s>",
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
        " + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
        "<end_of_turn>",
    ),
    "phi3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
        "<|end|>",
    ),
}


@dataclass(frozen=True)
class Template:
    text: str  # the Jinja template
    origin: str  # the family name, the file as the plan names it, or "jinja"
    end_of_turn: str | None  # the family's; None: found from the tokenizer (end_of_turn)


def resolve_template(value: str, plan_dir: Path) -> Template:
    """The plan's ``chat_template`` as a template; OverbrainerError (one line) if it is none."""
    if value in FAMILIES:
        text, eot = FAMILIES[value]
        return Template(text, value, eot)
    if "{{" in value or "{%" in value:
        return Template(value, "jinja", None)
    path = (plan_dir / value).expanduser()
    if path.is_file():
        try:
            return Template(path.read_text(encoding="utf-8"), value, None)
        except (OSError, UnicodeDecodeError) as e:
            raise OverbrainerError(f"chat_template: cannot read {value!r} ({e}); save it as UTF-8 text") from None
    raise OverbrainerError(
        f"chat_template: {value!r} is not a known family ({', '.join(FAMILIES)}), a file (relative to the "
        "plan) nor a Jinja template; set it to one of those"
    )


def end_of_turn(template: Template, tokenizer) -> str | None:
    """The token that ends an assistant turn under ``template`` (set on ``tokenizer``)."""
    if template.end_of_turn is not None:
        return template.end_of_turn
    probe = [{"role": "user", "content": "zqxU"}, {"role": "assistant", "content": "zqxA"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # told by the config step's check, on a real conversation
        return tokenizer.eos_token
    after = text[text.rfind("zqxA") + 4:].lstrip()
    specials = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True)
    return next((s for s in specials if s and after.startswith(s)), tokenizer.eos_token)
