"""Tiny random models and tokenizers, built in fixtures (never downloaded).

``make_tiny_llama(folder)`` writes a Hugging Face model folder: a 2-layer Llama with a
byte-level BPE tokenizer trained on a few sentences, the ChatML special tokens and a
ChatML chat template, the same shape of thing as SmolLM2 at a ten-thousandth of the size.
"""

from __future__ import annotations

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
