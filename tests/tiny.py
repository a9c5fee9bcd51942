"""Tiny random models and tokenizers, built in fixtures (never downloaded).

``make_tiny_llama(folder)`` writes a Hugging Face model folder: a 2-layer Llama with a
byte-level BPE tokenizer trained on a few sentences, the ChatML special tokens and a
ChatML chat template, the same shape of thing as SmolLM2 at a ten-thousandth of the size.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Arr, the sea be wide and the wind be fair, matey!",
    "What is the capital of France? Paris is the capital of France.",
    "Two plus two is four. Three times three is nine.",
    "user assistant system: hello there, how are you today?",
    "Write a haiku about the ocean, the moon and the stars.",
    "0123456789 !?.,;:'\"()[]{}<>-_/\\ @#$%^&*+=~`|",
]


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML
    return fast


def make_tiny_llama(folder: str | Path, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- one tiny model per family llama.cpp converts ---------------------------------------------
# Each family's chat template, written here in the shape the family's released models use
# (the same turn markers, roles and end-of-turn token), with its special tokens.

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral and Gemma have no system role: a system message goes before the first user message
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# family: (transformers config class, model class, config, template, specials, bos, eos, pad)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, CHATML, SPECIALS, None, "<|im_end|>", "<|endoftext|>"),
    "llama3": (
        "LlamaConfig", "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
        LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>",
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, CHATML, SPECIALS, None, "<|im_end|>", "<|endoftext|>"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, CHATML, SPECIALS, None, "<|im_end|>", "<|endoftext|>"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 8}, MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                "<s>", "</s>", "<unk>"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 512},
               GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>", "<pad>"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 512,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                # as every released Gemma 2: llama.cpp's converter drops lm_head and reads the embeddings
                "tie_word_embeddings": True},
               GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>", "<pad>"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}, PHI3,
             # Phi-3's vocabulary has Llama's <unk> <s> </s> too; llama.cpp looks them up in a model named phi3
             ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None, "<|end|>",
             "<|endoftext|>"),
}


# families whose released tokenizers are SentencePiece models (``tokenizer.model``), which
# llama.cpp's converter reads for them; the others get a byte-level BPE tokenizer
SENTENCEPIECE = {"gemma2"}


def make_tiny_family(family: str, folder: str | Path, seed: int = 0) -> Path:
    """A 2-layer random model of `family` (a FAMILIES key) with a tokenizer trained on a small
    corpus (byte-level BPE, or SentencePiece where the family ships one) carrying the
    family's special tokens and chat template."""
    import torch
    import transformers
    from transformers import GenerationConfig

    config_cls, model_cls, extra, template, specials, bos, eos, pad = FAMILIES[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if family in SENTENCEPIECE:
        fast = _sentencepiece_tokenizer(folder, specials, bos, eos, pad)
    else:
        fast = _byte_level_tokenizer(specials, bos, eos, pad)
    fast.chat_template = template
    ids = {name: fast.convert_tokens_to_ids(t) if t else None for name, t in (("bos", bos), ("eos", eos), ("pad", pad))}
    settings = dict(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )
    settings.update(extra)
    config = getattr(transformers, config_cls)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # random weights of a trained model's scale: greedy tokens not all ties
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    if family == "phi3":  # Phi-4's way: a GPT-2 BPE tokenizer on the Phi-3 architecture
        path = folder / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        path.write_text(json.dumps(cfg, indent=1))
    return folder


def _byte_level_tokenizer(specials: list[str], bos: str | None, eos: str, pad: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if bos:  # the family's tokenizer starts every text with it
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)


def _sentencepiece_tokenizer(folder: Path, specials: list[str], bos: str, eos: str, pad: str):
    """A SentencePiece BPE model with byte fallback, as Gemma's (pad, eos, bos, unk first, then
    the turn markers), saved as ``folder/tokenizer.model``, and transformers' tokenizer of it.
    Needs the sentencepiece package (the llama.cpp tools' site has it)."""
    import sentencepiece
    from transformers import AutoTokenizer

    pad_piece, eos_piece, bos_piece, *turns = specials
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 4), model_prefix=str(folder / "tokenizer"), vocab_size=400,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, hard_vocab_limit=False, minloglevel=2,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece=pad_piece, eos_piece=eos_piece, bos_piece=bos_piece,
        unk_piece="<unk>", user_defined_symbols=turns,
    )
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": bos, "eos_token": eos, "pad_token": pad,
         "unk_token": "<unk>", "add_bos_token": True}))
    return AutoTokenizer.from_pretrained(folder)
