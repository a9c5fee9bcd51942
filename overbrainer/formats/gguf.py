"""The merged model as one GGUF file, for llama.cpp and what is built on it (Ollama, LM Studio).

Written from Python with the ``gguf`` package's `GGUFWriter`, from ``merged/`` alone (config,
safetensors, tokenizer): no llama.cpp build, no torch. The file holds what llama.cpp reads for
its ``llama`` architecture, the same keys its own ``convert_hf_to_gguf.py`` writes::

    general.*                 architecture "llama", name, file type, quantization version
    llama.*                   context length, embedding length, block count, feed-forward
                              length, head counts, rope (freq base, dimension count), rms eps,
                              vocab size, key/value length
    tokenizer.ggml.*          model "gpt2" (byte-level BPE), pre-tokenizer, tokens, token types,
                              merges, bos/eos/unk/pad ids, add_bos/add_eos
    tokenizer.chat_template   the merged model's Jinja chat template
    tensors                   llama.cpp's names (token_embd, blk.N.attn_q, ...), q and k rows
                              permuted for its RoPE layout, norms and 1-D tensors in F32

Which tensor gets which type follows llama.cpp's converter and its ``llama-quantize``: 1-D
tensors and norms stay F32; a matrix whose rows do not split into whole blocks of the type
falls back to F16; the ternary types (tq1_0, tq2_0) keep the embedding and output matrices in
F16; the 4- and 5-bit types keep the output matrix (the embedding matrix, when the two are
tied) in Q8_0, where llama-quantize uses Q6_K, or Q8_0 when rows do not split into 256-blocks
(the gguf package cannot make Q6_K in Python). On SmolLM2 every tensor of the f16, bf16, q8_0,
q4_0, q4_1, q5_0 and q5_1 files is byte for byte what llama-quantize makes of the same weights
(bench/check_llamacpp.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import OverbrainerError
from . import check_formats

__all__ = ["write_gguf", "llama_cpp_pre", "file_name"]

# the Llama 3 pre-tokenizer's split pattern, as Llama 3's tokenizer.json spells it
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TERNARY = ("tq1_0", "tq2_0")
_FEW_BITS = ("q5_1", "q5_0", "q4_1", "q4_0", "mxfp4")  # the output matrix goes in Q8_0
_LLAMA_CPP_NAMES = {"f32": "ALL_F32", "mxfp4": "MOSTLY_MXFP4_MOE"}  # the rest: MOSTLY_<TYPE>


def file_name(model_name: str, qtype: str) -> str:
    """``baked/<name>-<type>.gguf``: llama.cpp's own naming, model then type."""
    return f"{model_name}-{qtype}.gguf"


def write_gguf(merged: Path, dest: Path, qtype: str, model_name: str) -> None:
    """Write the HF model folder ``merged`` as a GGUF file of type ``qtype`` (``"q8_0"``)."""
    import gguf

    config = json.loads((merged / "config.json").read_text())
    check_formats([f"gguf-{qtype}"], config)
    tokenizer = json.loads((merged / "tokenizer.json").read_text(encoding="utf-8"))
    pre = llama_cpp_pre(tokenizer, qtype)  # before the slow part: fail fast

    file_type = getattr(gguf.LlamaFileType, _LLAMA_CPP_NAMES.get(qtype, f"MOSTLY_{qtype.upper()}"))
    writer = gguf.GGUFWriter(str(dest), arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_name)
    _add_hyperparameters(writer, config, file_type)
    _add_tokenizer(writer, merged, tokenizer, config, pre)
    for name, data, tensor_type in _tensors(merged, config, qtype):
        writer.add_tensor(name, data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _add_hyperparameters(writer, config: dict, file_type) -> None:
    import gguf

    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    # transformers 5 keeps rope_theta in rope_parameters; older configs at the top level
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# --- tensors --------------------------------------------------------------------------------


def _tensors(merged: Path, config: dict, qtype: str):
    """(GGUF name, data, GGML type) for every weight of the merged model, quantized."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads") or n_head
    tied = config.get("tie_word_embeddings", False)
    output = "token_embd.weight" if tied else "output.weight"  # the matrix that makes the logits
    for part in _weight_files(merged):
        with safe_open(str(part), framework="numpy") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
                    continue  # recomputed by llama.cpp / the embedding matrix read twice
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise OverbrainerError(
                        f"bake.formats: gguf-{qtype}: the merged model has a tensor llama.cpp's "
                        f"llama architecture does not know ({hf_name}); remove gguf-{qtype} from bake.formats"
                    )
                data = f.get_tensor(hf_name).astype(np.float32, copy=False)
                if name.startswith("blk.") and ".attn_q." in name:
                    data = _rope_permute(data, n_head)
                elif name.startswith("blk.") and ".attn_k." in name:
                    data = _rope_permute(data, n_kv_head)
                tensor_type = _tensor_type(name, data, qtype, output=name == output)
                yield name, gguf.quants.quantize(data, tensor_type), tensor_type


def _weight_files(merged: Path) -> list[Path]:
    index = merged / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text())["weight_map"].values()
        return [merged / s for s in sorted(set(shards))]
    return [merged / "model.safetensors"]


def _rope_permute(w, n_head: int):
    """Reorder the rows of a q or k projection (weight or bias) from transformers' RoPE layout
    to llama.cpp's.

    transformers rotates dimension i with i + head_dim/2 ("rotate half"); llama.cpp rotates
    neighbours 2i and 2i+1. Within each head, the rows [x0 .. x(h/2-1), y0 .. y(h/2-1)] become
    [x0, y0, x1, y1, ...]. transformers' GGUF reader applies the inverse when it loads the file.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_type(name: str, data, qtype: str, output: bool = False):
    """The GGML type one tensor is stored as, in a file of type ``qtype``; ``output`` when it is
    the matrix that makes the logits."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return GGMLQuantizationType.F32  # llama.cpp reads norms and vectors in F32 only
    if qtype in _TERNARY and name in ("token_embd.weight", "output.weight"):
        return GGMLQuantizationType.F16  # ternary embeddings would lose the vocabulary
    if qtype in _FEW_BITS and output:
        qtype = "q8_0"  # every logit goes through it: 4 bits there cost the most
    wanted = GGMLQuantizationType[qtype.upper()]
    block, _ = GGML_QUANT_SIZES[wanted]
    if data.shape[-1] % block:
        return GGMLQuantizationType.F16  # rows that do not split into whole blocks
    return wanted


# --- tokenizer ------------------------------------------------------------------------------


def _add_tokenizer(writer, merged: Path, tokenizer: dict, config: dict, pre: str) -> None:
    import gguf

    vocab_size = config["vocab_size"]
    tokens, types = _vocabulary(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, bos/eos/unk/pad ids and the chat template, read as llama.cpp reads them
    special = gguf.SpecialVocab(merged, load_merges=True, n_vocab=vocab_size)
    # whether to add bos/eos is what the HF tokenizer does, stated outright: llama.cpp's
    # default for a file that is silent differs between versions
    add_bos, add_eos = _adds_specials(merged, special.special_token_ids)
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    special.add_to_gguf(writer, quiet=True)


def _vocabulary(tokenizer: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every token by id, as llama.cpp lists them: the byte-level spelling for BPE tokens,
    added tokens as written; ids the tokenizer does not use are ``[PAD<id>]`` placeholders."""
    from gguf import TokenType

    by_id: dict[int, str] = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    types = {i: TokenType.NORMAL for i in by_id}
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        special = added.get("special") or _looks_special(added["content"])
        types[added["id"]] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    if by_id and max(by_id) >= vocab_size:
        raise OverbrainerError(
            f"bake.formats: the tokenizer has token id {max(by_id)}, past the model's vocab_size "
            f"{vocab_size}; fix the base model, or remove the gguf formats from bake.formats"
        )
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    return tokens, [int(types.get(i, TokenType.UNUSED)) for i in range(vocab_size)]


def _looks_special(token: str) -> bool:
    # added tokens some models forget to mark special ("<|im_end|>" and the like)
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def _adds_specials(merged: Path, ids: dict[str, int]) -> tuple[bool, bool]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(merged / "tokenizer.json"))
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if full == plain or not full:
        return False, False
    return full[0] == ids.get("bos", -1), full[-1] == ids.get("eos", -1)


def llama_cpp_pre(tokenizer: dict, qtype: str = "f16") -> str:
    """The name llama.cpp gives this tokenizer's pre-tokenizer (``tokenizer.ggml.pre``).

    llama.cpp's converter names it by hashing how the tokenizer cuts a probe text and looking
    the hash up. The same choice is made here from the tokenizer's own definition:

    - the GPT-2 split (``ByteLevel`` with its regex) is "gpt-2"; with every digit split off on
      its own first, "smollm". A vocabulary that never joins a digit to anything was learned
      with digits split (SmolLM's, whose ``Digits`` step a GGUF round trip drops): "smollm",
      as llama.cpp's converter names it;
    - Llama 3's split pattern, then ``ByteLevel`` without regex: "llama-bpe".
    """
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise OverbrainerError(
            f"bake.formats: gguf-{qtype} supports byte-level BPE tokenizers, not "
            f"{model.get('type') or 'this'} ones; remove gguf-{qtype} from bake.formats"
        )
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]

    def byte_level(step: dict, regex: bool) -> bool:
        return step.get("type") == "ByteLevel" and bool(step.get("use_regex", True)) == regex

    if len(steps) == 1 and byte_level(steps[0], True):
        return "smollm" if _digits_stand_alone(model.get("vocab") or {}) else "gpt-2"
    if len(steps) == 2 and byte_level(steps[1], True) and steps[0].get("type") == "Digits":
        if steps[0].get("individual_digits"):
            return "smollm"
    if len(steps) == 2 and byte_level(steps[1], False) and steps[0].get("type") == "Split":
        if (steps[0].get("pattern") or {}).get("Regex") == _LLAMA3_SPLIT:
            return "llama-bpe"
    shown = "+".join(str(s.get("type")) for s in steps) or "none"
    raise OverbrainerError(
        f"bake.formats: gguf-{qtype}: llama.cpp has no pre-tokenizer known to match this "
        f"tokenizer's ({shown}; supported: GPT-2, SmolLM and Llama 3 byte-level BPE); "
        f"remove gguf-{qtype} from bake.formats"
    )


_DIGIT = re.compile(r"[0-9]")


def _digits_stand_alone(vocab: dict[str, int]) -> bool:
    return not any(len(token) > 1 and _DIGIT.search(token) for token in vocab)
