"""bake.formats: GGUF files that transformers' own GGUF reader loads back close to merged/, an
Ollama Modelfile, the adapter alone, the card's metrics table and loss curve; bad formats are
plan errors before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bake_json, cli

from overbrainer.errors import OverbrainerError
from overbrainer.formats import GGUF_TYPES, PYTHON_GGUF_TYPES, check_formats, python_writer_covers
from overbrainer.formats.gguf import llama_cpp_pre
from overbrainer.formats.llama_cpp import CONVERT_TYPES, QUANTIZE_FTYPES
from overbrainer.formats.ollama import chatml_system, modelfile

# Largest |logit(GGUF) - logit(merged/)| over every position and vocabulary entry of the
# prompts, on the tiny model baked below. Measured: f16 1.8e-4, q8_0 3.5e-3 (f16 keeps 11
# bits of each weight; q8_0 one int8 per weight and one scale per 32).
TOLERANCE = {"f16": 1e-3, "q8_0": 2e-2}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Two plus two is"]
FORMATS = ["safetensors", "gguf-f16", "gguf-q8_0", "ollama", "adapter"]


# --- what may be asked for --------------------------------------------------------------------


def test_python_gguf_types_are_those_gguf_quantizes_in_pure_python():
    from gguf import GGMLQuantizationType, quants

    def numpy_quantizer(t):
        if t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return True  # plain casts, in gguf.quants.quantize itself
        cls = quants._type_traits.get(t)
        return cls is not None and not getattr(cls.quantize_blocks, "__isabstractmethod__", False)

    offered = {t.name.lower() for t in GGMLQuantizationType if numpy_quantizer(t)}
    assert set(PYTHON_GGUF_TYPES) == offered
    # the rest are llama.cpp's: made by its quantizer
    assert set(GGUF_TYPES) - offered == {"q6_k", "q5_k_m", "q4_k_m"}
    assert set(GGUF_TYPES) - set(CONVERT_TYPES) == set(QUANTIZE_FTYPES)


def one_line_error(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_unknown_format_is_a_plan_error(project, tmp_path):
    project.plan["bake"] = {"formats": ["safetensors", "gguf-q3_k_s"]}
    project.write()
    line = one_line_error(cli("bake", str(project.plan_path), check=2))
    assert "plan.json:" in line and "bake.formats.1: unknown format 'gguf-q3_k_s'" in line
    assert "gguf-q8_0" in line  # the supported ones are listed
    assert not (tmp_path / "runs").exists()


def test_ollama_needs_a_gguf(project, tmp_path):
    project.plan["bake"] = {"formats": ["safetensors", "ollama"]}
    project.write()
    line = one_line_error(cli("bake", str(project.plan_path), check=2))
    assert "bake.formats: ollama needs a GGUF file to run; add a gguf format too" in line
    assert not (tmp_path / "runs").exists()


def test_gguf_of_an_architecture_llama_cpp_cannot_convert_is_one_line():
    opt = {"model_type": "opt", "architectures": ["OPTForCausalLM"]}
    with pytest.raises(OverbrainerError) as e:
        check_formats(["safetensors", "gguf-f16"], opt)
    assert str(e.value) == (
        "bake.formats: gguf-f16 is not supported for OPTForCausalLM models: llama.cpp's converter does not "
        "know that architecture (supported: Llama (default and llama3 RoPE), Mistral, Qwen2/2.5, Qwen3, "
        "Gemma 2, Gemma 3, Phi-3, and the others in overbrainer/formats/llama_cpp_architectures.txt); "
        "remove it from bake.formats"
    )
    check_formats(["safetensors", "adapter"], opt)  # no GGUF asked: fine


def test_each_tested_family_passes_the_config_step():
    import transformers
    from tiny import FAMILIES

    for config_cls, model_cls, extra, *_ in FAMILIES.values():
        config = getattr(transformers, config_cls)(**extra).to_dict()
        config["architectures"] = [model_cls]
        check_formats(["gguf-f16", "gguf-q4_k_m"], config)


def test_plain_llama_goes_through_the_python_writer_and_the_rest_through_llama_cpp():
    plain = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "default"}}
    llama3 = {**plain, "rope_parameters": {"rope_type": "llama3", "factor": 32.0}}
    assert python_writer_covers(plain, "q8_0") and not python_writer_covers(plain, "q4_k_m")
    assert not python_writer_covers(llama3, "q8_0") and not python_writer_covers({**plain, "mlp_bias": True}, "f16")
    check_formats(["gguf-q8_0"], llama3)  # llama.cpp's converter carries llama3 RoPE


def test_card_front_matter_names_the_hub_base_its_license_and_datasets():
    from huggingface_hub import ModelCard

    from overbrainer.formats.card import card_data
    from overbrainer.inputs.base_model import BaseSpec, hub_base

    assert hub_base(BaseSpec("alias", "smollm2-135m-instruct", "smollm2-135m-instruct")) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_base(BaseSpec("hub", "Qwen/Qwen2.5-0.5B@main", "Qwen/Qwen2.5-0.5B", "main")) == "Qwen/Qwen2.5-0.5B"
    cached = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123"
    assert hub_base(BaseSpec("folder", cached, cached)) == "Qwen/Qwen3-0.6B"
    assert hub_base(BaseSpec("folder", "./mine", "/work/mine")) is None
    card = {"name": "demo", "base": "smollm2-135m-instruct", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "license": "apache-2.0", "datasets": ["org/chats"], "train": {"adapter": "lora"},
            "result": {"eval_loss": 1.2345678}}
    text = "---\n" + card_data(card, {"demo-q4_k_m.gguf": "gguf-q4_k_m"}).to_yaml() + "\n---\n"
    data = ModelCard(text).data
    assert (data.base_model, data.license, data.datasets) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", ["org/chats"])
    assert data.library_name == "gguf" and data.eval_results[0].dataset_type == "org/chats"
    assert data.eval_results[0].metric_value == 1.234568


def test_adapter_of_a_full_fine_tune_is_refused():
    with pytest.raises(OverbrainerError, match='adapter needs train.adapter "lora"'):
        check_formats(["adapter"], {"model_type": "llama"}, adapter="full")


def _tokenizer(pre: dict | None, vocab: dict) -> dict:
    return {"model": {"type": "BPE", "vocab": vocab}, "pre_tokenizer": pre}


def test_llama_cpp_pre_tokenizer_names():
    gpt2 = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    numbers = {"Ġ12": 0, "a": 1}
    assert llama_cpp_pre(_tokenizer(gpt2, numbers)) == "gpt-2"
    # a vocabulary with digits only alone was learned with them split: SmolLM's
    assert llama_cpp_pre(_tokenizer(gpt2, {"1": 0, "2": 1, "Ġthe": 2})) == "smollm"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, gpt2]}
    assert llama_cpp_pre(_tokenizer(digits, numbers)) == "smollm"
    from overbrainer.formats.gguf import _LLAMA3_SPLIT

    split = {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated"}
    llama3 = {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": False}]}
    assert llama_cpp_pre(_tokenizer(llama3, numbers)) == "llama-bpe"
    with pytest.raises(OverbrainerError, match="no pre-tokenizer known to match"):
        llama_cpp_pre(_tokenizer({"type": "Whitespace"}, numbers))
    with pytest.raises(OverbrainerError, match="byte-level BPE tokenizers, not Unigram"):
        llama_cpp_pre({"model": {"type": "Unigram"}})


def test_tensor_types_follow_llama_cpp():
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from overbrainer.formats.gguf import _tensor_type

    matrix = np.zeros((64, 256), np.float32)
    assert _tensor_type("blk.0.attn_q.weight", matrix, "q4_0") == T.Q4_0
    assert _tensor_type("output.weight", matrix, "q4_0", output=True) == T.Q8_0  # the logits
    assert _tensor_type("output.weight", matrix, "q8_0", output=True) == T.Q8_0
    assert _tensor_type("blk.0.attn_norm.weight", np.zeros(64, np.float32), "q8_0") == T.F32
    assert _tensor_type("blk.0.ffn_down.weight", np.zeros((64, 48), np.float32), "q8_0") == T.F16
    assert _tensor_type("blk.0.ffn_down.weight", matrix, "tq1_0") == T.TQ1_0
    assert _tensor_type("token_embd.weight", matrix, "tq1_0") == T.F16


def test_chatml_templates_and_their_default_system_prompt(tiny_model):
    from tiny import CHATML

    assert chatml_system(CHATML, {}) == ""
    smol = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert chatml_system(smol, {}) == "You are SmolLM"
    llama2 = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    assert chatml_system(llama2, {}) is None
    text = modelfile(tiny_model, "tiny-q8_0.gguf")
    assert text.startswith("FROM ./tiny-q8_0.gguf\n") and "SYSTEM" not in text


# --- a tiny bake in every format ----------------------------------------------------------------


def gguf_files(baked: Path) -> dict[str, Path]:
    return {p.stem.rsplit("-", 1)[1]: p for p in baked.glob("*.gguf")}


def check_gguf_metadata(path: Path, qtype: str, merged: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(path)

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == 2 and field("llama.context_length") == 1024
    assert field("llama.embedding_length") == 32 and field("llama.feed_forward_length") == 64
    assert field("llama.attention.head_count") == 4 and field("llama.attention.head_count_kv") == 2
    assert field("llama.vocab_size") == 400 and field("llama.rope.freq_base") == 10000.0
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert len(field("tokenizer.ggml.tokens")) == 400 and field("tokenizer.ggml.merges")
    assert field("tokenizer.ggml.eos_token_id") == 2 and field("tokenizer.ggml.padding_token_id") == 0
    assert field("tokenizer.ggml.add_bos_token") is False
    assert field("tokenizer.chat_template") == (merged / "chat_template.jinja").read_text()
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType[qtype.upper()]
    assert "output.weight" in types  # the tiny model's head is not tied to its embeddings


def check_gguf_answers_like_merged(baked: Path, merged: Path, qtype: str) -> float:
    """Logits within TOLERANCE of merged/'s, the same tokens and the same greedy answers (but
    at a near-tie, which the format's rounding may flip)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_files(baked)[qtype]
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(baked, gguf_file=path.name, dtype=torch.float32)
    gguf_tokenizer = AutoTokenizer.from_pretrained(baked, gguf_file=path.name)
    worst = 0.0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt")
        # the GGUF's vocabulary, merges and special tokens cut the text the same way
        assert torch.equal(ids["input_ids"], gguf_tokenizer(text, return_tensors="pt")["input_ids"]), prompt
        expected = reference.generate(**ids, max_new_tokens=8, do_sample=False)
        # the logits over the prompt and merged/'s greedy answer to it, from both models
        with torch.no_grad():
            ours_all, theirs_all = model(expected).logits[0], reference(expected).logits[0]
        worst = max(worst, (ours_all - theirs_all).abs().max().item())
        # along that answer, the GGUF picks the same token at every step, except where
        # merged/'s two best logits are within twice the tolerance of each other: a near-tie
        # that the format's rounding (each logit off by up to the tolerance) may flip (a tiny
        # random model has such ties)
        start = ids["input_ids"].shape[1]
        ours, theirs = ours_all[start - 1:-1], theirs_all[start - 1:-1]
        best_two = theirs.topk(2).values
        near_tie = best_two[:, 0] - best_two[:, 1] <= 2 * TOLERANCE[qtype]
        same = ours.argmax(-1) == expected[0, start:]
        assert bool((same | near_tie).all()), (qtype, prompt, same.tolist(), near_tie.tolist())
        assert int(same.sum()) >= len(same) - 1, (qtype, prompt, same.tolist())  # a tie at most
    assert 0 < worst <= TOLERANCE[qtype], (qtype, worst)  # > 0: the GGUF was read, not merged/
    return worst


def check_adapter_is_the_final_one(baked: Path, merged: Path, tiny_model: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in (baked / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, baked / "adapter")
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    ids = torch.tensor([[1, 30, 31, 32, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)


def check_card_and_curve(baked: Path, folder: Path) -> None:
    png = (baked / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert int.from_bytes(png[16:20], "big") == 700 and int.from_bytes(png[20:24], "big") == 400
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if "step" in m]  # other lines mark stages of the job
    card = (baked / "README.md").read_text()
    assert "| step | loss | eval_loss | lr | phase |" in card and "](loss.png)" in card
    rows = [line for line in card.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    by_step = {m["step"]: m for m in metrics}
    assert [int(r.split("|")[1]) for r in rows] == [4, 8]  # the eval steps; 8 is also the last
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        m = by_step[int(cells[0])]
        assert cells[1:] == [f"{m['loss']:.4f}", f"{m['eval_loss']:.4f}", f"{m['lr']:.2e}", m["phase"]]
    for name in ("tiny-f16.gguf", "tiny-q8_0.gguf", "Modelfile", "adapter/", "ollama create"):
        assert name in card, name
    # the Hub's front matter, read back with huggingface_hub: no local path as base_model
    from huggingface_hub import ModelCard

    data = ModelCard.load(baked / "README.md").data
    assert data.base_model is None and data.license is None and "tiny-llama" not in card.split("---")[1]
    assert data.pipeline_tag == "text-generation" and data.library_name == "transformers"
    assert data.tags == ["overbrainer", "lora", "gguf", "ollama"]
    (result,) = data.eval_results
    last_eval = [m["eval_loss"] for m in metrics if m.get("eval_loss") is not None][-1]
    assert result.metric_type == "loss" and result.metric_value == round(last_eval, 6)


def test_bake_in_every_format(baked_copy, tiny_model):
    project = baked_copy()  # a finished bake of the tiny plan, in safetensors only
    project.plan["bake"] = {"formats": FORMATS}
    project.write()
    report = bake_json(str(project.plan_path))
    assert report["state"] == "done"
    assert report["ran"] == ["resolve", "bake"]  # the formats are the bake step's alone
    folder = Path(report["folder"])
    baked, merged = folder / "baked", folder / "merged"
    assert sorted(gguf_files(baked)) == ["f16", "q8_0"]
    assert (baked / "model.safetensors").samefile(merged / "model.safetensors")

    for qtype in ("f16", "q8_0"):
        check_gguf_metadata(gguf_files(baked)[qtype], qtype, merged)
        print(f"{qtype}: largest logit difference {check_gguf_answers_like_merged(baked, merged, qtype):.2e}")

    assert (baked / "Modelfile").read_text() == (
        "FROM ./tiny-f16.gguf\n"  # the first GGUF listed
        "\n"
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n'
        "{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n"
        '"""\n'
        "\n"
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|im_start|>"\n'
        f'PARAMETER num_ctx {project.plan["train"]["sequence_len"]}\n'  # what it was trained on
    )
    check_adapter_is_the_final_one(baked, merged, tiny_model)
    check_card_and_curve(baked, folder)

    # a rerun does nothing; dropping a format rebakes only baked/
    assert bake_json(str(project.plan_path))["ran"] == []
    project.plan["bake"] = {"formats": ["gguf-q8_0"]}
    project.write()
    again = bake_json(str(project.plan_path))
    assert again["ran"] == ["resolve", "bake"]
    assert sorted(p.name for p in baked.iterdir()) == ["README.md", "loss.png", "tiny-q8_0.gguf"]


def test_gguf_of_an_unsupported_model_fails_before_training(project, tmp_path):
    import torch
    from tiny import make_tiny_tokenizer
    from transformers import OPTConfig, OPTForCausalLM

    tokenizer = make_tiny_tokenizer()
    config = OPTConfig(
        vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=1024,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(project.root / "opt")
    tokenizer.save_pretrained(project.root / "opt")
    project.plan.update(base="./opt", bake={"formats": ["safetensors", "gguf-q4_k_m"]})
    project.write()
    line = one_line_error(cli("bake", str(project.plan_path), check=2))
    assert "bake.formats: gguf-q4_k_m is not supported for OPTForCausalLM models: llama.cpp's converter" in line
    assert not list((tmp_path / "runs").glob("*/checkpoints/step-*"))


def test_base_license_is_read_from_the_base_cards_front_matter(tmp_path):
    from overbrainer.inputs.base_model import base_license

    assert base_license(tmp_path) is None  # no card
    (tmp_path / "README.md").write_text("---\nlanguage: en\nlicense: 'apache-2.0'  # the card's\ntags: [x]\n---\n# m\nlicense: mit\n")
    assert base_license(tmp_path) == "apache-2.0"
    (tmp_path / "README.md").write_text("# no front matter\nlicense: mit\n")
    assert base_license(tmp_path) is None
