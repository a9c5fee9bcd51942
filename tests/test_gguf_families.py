"""GGUF through llama.cpp's own converter and quantizer, for each family, on tiny random
models with real (trained, byte-level BPE) tokenizers: the f16 file's greedy tokens equal
transformers' on the same folder, and the q4_k_m file loads and generates in llama.cpp.

llama.cpp is built for real, once per checkout, at ``.venv/overbrainer-tools/`` (or
``$OVERBRAINER_LLAMA_CPP``): llama-cpp-python 0.3.36 compiled from source, tens of minutes
on 2 cores. These tests are marked ``llama_cpp``: they run where that folder is whole
(CI keeps it in its cache of ``.venv``) or when asked for (``pytest -m llama_cpp`` builds it),
and are skipped, saying so, elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from tiny import FAMILIES, make_tiny_family

from overbrainer.formats import TESTED_ARCHITECTURES, llama_cpp_architectures
from overbrainer.formats import llama_cpp as lc

pytestmark = pytest.mark.llama_cpp
REPO = Path(__file__).resolve().parent.parent
LOCAL_TOOLS = REPO / ".venv" / "overbrainer-tools" / f"llama-cpp-python-{lc.LLAMA_CPP_PYTHON}"
PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tools():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(lc.ENV, os.environ.get(lc.ENV) or str(LOCAL_TOOLS))
        folder = lc.llama_cpp_tools(say=print)
    site = str(lc.site_path(folder))
    if site not in sys.path:
        sys.path.insert(0, site)
    return folder


@pytest.fixture(scope="module")
def baked(tools, tmp_path_factory):
    """family -> (model folder, {qtype: GGUF path}), each made once."""
    made = {}

    def bake(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = make_tiny_family(family, root / family)
            out = root / "baked"
            out.mkdir()
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(lc.ENV, str(tools))
                names = lc.write_ggufs(model, out, "tiny", ["f16", "q4_k_m"], say=print, log=root / "log.txt")
            made[family] = model, dict(zip(["f16", "q4_k_m"], (out / n for n in names)))
        return made[family]

    return bake


def transformers_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the weights an f16 GGUF holds (llama.cpp's converter keeps 1-D ones in f32)
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def llama_cpp_greedy(gguf: Path, ids: list[int], n: int) -> tuple[list[int], object]:
    import llama_cpp

    # the KV cache in f32 (llama.cpp's default is f16): the same arithmetic as transformers', so that
    # a near tie (Phi-3's tiny model has a top-2 gap of 4e-4 at one position) is not broken by rounding
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=128, n_threads=1, verbose=False, type_k=f32, type_v=f32)
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out, llm


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f16_greedy_tokens_equal_transformers_and_q4_k_m_generates(family, baked):
    from transformers import AutoTokenizer

    model, files = baked(family)
    ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    got, llm = llama_cpp_greedy(files["f16"], ids, NEW_TOKENS)
    # the vocabulary and pre-tokenizer came over: llama.cpp cuts the text as transformers does
    assert llm.tokenize(PROMPT.encode(), add_bos=True, special=False) == ids
    assert got == transformers_greedy(model, ids, NEW_TOKENS)
    quantized, qllm = llama_cpp_greedy(files["q4_k_m"], ids, NEW_TOKENS)
    assert len(quantized) == NEW_TOKENS and all(0 <= t < qllm.n_vocab() for t in quantized)
    assert files["q4_k_m"].stat().st_size < files["f16"].stat().st_size


def test_the_llama_cpp_route_agrees_with_the_python_writer_on_plain_llama(baked, tools, tmp_path):
    """Plain Llama f16 goes through formats/gguf.py; llama.cpp's converter gives the same tokens."""
    from transformers import AutoTokenizer

    model, files = baked("llama")
    theirs = tmp_path / "llama-cpp-f16.gguf"
    lc.convert(tools, model, theirs, "f16", "gpt-2")
    ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    assert llama_cpp_greedy(theirs, ids, NEW_TOKENS)[0] == llama_cpp_greedy(files["f16"], ids, NEW_TOKENS)[0]


def test_shipped_architecture_list_is_the_converters(tools):
    sys.path[0:0] = [str(tools / "llama.cpp"), str(tools / "llama.cpp" / "gguf-py")]
    try:
        from conversion import TEXT_MODEL_MAP
    finally:
        del sys.path[0:2]
    assert llama_cpp_architectures() == frozenset(TEXT_MODEL_MAP)
    assert set(TESTED_ARCHITECTURES) <= llama_cpp_architectures()


def test_marker_says_what_was_built(tools):
    marker = json.loads((tools / lc.MARKER).read_text())
    assert marker["llama_cpp_python"] == lc.LLAMA_CPP_PYTHON and marker["seconds"] > 0


# a template of no family llama.cpp knows; its turns end with the tiny model's <|im_end|>
ODD_TEMPLATE = (
    "{% for message in messages %}{{ '### ' + message['role'] + ':\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


def test_llama_cpp_knows_each_familys_template_and_not_an_odd_one(tools):
    for family, (*_, template, _specials, _bos, _eos, _pad) in FAMILIES.items():
        assert lc.knows_template(tools, template), family
    assert not lc.knows_template(tools, ODD_TEMPLATE)


def test_a_template_llama_cpp_does_not_know_is_refused_before_training_unless_ollama_is_asked(tools, project, tmp_path):
    from helpers import bake_json, cli

    (project.root / "odd.jinja").write_text(ODD_TEMPLATE)
    project.plan["chat_template"] = "odd.jinja"
    project.plan["bake"] = {"formats": ["safetensors", "gguf-q4_k_m"]}
    project.write()
    env = {lc.ENV: str(tools)}
    proc = cli("bake", str(project.plan_path), "--foreground", check=2, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "llama.cpp's own chat" in errors[0] and "the plan's chat_template (odd.jinja)" in errors[0]
    assert '"ollama"' in errors[0]
    run = tmp_path / "runs" / "tiny"  # $OVERBRAINER_RUNS
    assert (run / ".stamps" / "split.json").is_file()  # the refusal came at the config step
    assert not (run / "checkpoints").exists() and not (run / ".stamps" / "config.json").exists()

    project.plan["bake"] = {"formats": ["gguf-q4_k_m", "ollama"]}
    project.write(steps=2, save_every=2, eval_every=2)
    report = bake_json(str(project.plan_path), "--foreground", env=env)
    assert report["state"] == "done" and Path(report["folder"]) == run, report
    modelfile = (run / "baked" / "Modelfile").read_text()
    assert "TEMPLATE" not in modelfile.replace("# TEMPLATE", "") and "FROM ./tiny-q4_k_m.gguf" in modelfile
