"""The Modelfile's TEMPLATE, per template family: the model's own Jinja chat template is
recognised, and the Go template written for Ollama renders a sample conversation to the same
text. The ``ollama`` binary is not installable here, so the Go template is rendered by
tests/gotemplate.py (the subset of Go's text/template the templates use)."""

from __future__ import annotations

import json

import pytest
from gotemplate import render
from tiny import CHATML, FAMILIES, GEMMA, LLAMA3, MISTRAL, PHI3

from overbrainer.formats.ollama import TEMPLATES, modelfile, render_jinja, template_family

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Arr, matey!"}, {"role": "user", "content": "Where be the sea?\nTell me."}],
]
TINY = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA, "phi3": PHI3}
SPECIALS = {"chatml": "llama", "llama3": "llama3", "mistral": "mistral", "gemma": "gemma3", "phi3": "phi3"}


def tokens_of(family: str) -> dict:
    *_, bos, eos, _pad = FAMILIES[SPECIALS[family]]
    return {"bos_token": bos, "eos_token": eos}


def go(family: str, messages: list[dict]) -> str:
    return render(TEMPLATES[family].go, {"Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]})


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_go_template_renders_what_the_jinja_template_does(family):
    template, tokens = TINY[family], tokens_of(family)
    assert template_family(template, tokens) == (family, "")
    for messages in CONVERSATIONS:
        assert go(family, messages) == render_jinja(template, messages, tokens)


def test_a_default_system_prompt_goes_in_system():
    smol = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert template_family(smol, {}) == ("chatml", "You are SmolLM")
    # Ollama puts SYSTEM first in .Messages: the Go template then renders what Jinja does unasked
    messages = CONVERSATIONS[0]
    assert go("chatml", [{"role": "system", "content": "You are SmolLM"}, *messages]) == render_jinja(smol, messages, {})


def test_a_template_of_no_family_is_left_out_with_a_warning(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    warned = []
    text = modelfile(tmp_path, "m-q4_k_m.gguf", num_ctx=256, warn=warned.append)
    assert "TEMPLATE" not in text.replace("# TEMPLATE", "") and len(warned) == 1 and "no TEMPLATE" in warned[0]
    assert 'PARAMETER stop "</s>"' in text and "PARAMETER num_ctx 256" in text


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_modelfile_has_the_family_template_stops_and_context(family, tmp_path):
    tokens = tokens_of(family)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokens))
    (tmp_path / "chat_template.jinja").write_text(TINY[family])
    text = modelfile(tmp_path, "tiny-q4_k_m.gguf", num_ctx=512)
    assert text.startswith("FROM ./tiny-q4_k_m.gguf\n")
    assert f'TEMPLATE """{TEMPLATES[family].go}"""' in text
    stops = [json.loads(line.split(" ", 2)[2]) for line in text.splitlines() if line.startswith("PARAMETER stop")]
    assert TEMPLATES[family].end_of_turn in stops and tokens["eos_token"] in stops
    assert text.rstrip().endswith("PARAMETER num_ctx 512")
