"""llama.cpp's own GGUF conversion and quantization, pinned, built once under the cache.

Every family llama.cpp runs is converted by llama.cpp's ``convert_hf_to_gguf.py`` (with the
gguf-py it vendors) and quantized by its ``llama_model_quantize``. Both come from one pinned
release of llama-cpp-python, whose source distribution vendors llama.cpp; its wheel is built
from source (cmake; tens of minutes on 2 cores), once per machine::

    <cache>/tools/llama-cpp-python-0.3.36/
        site/                    llama_cpp (the quantize and load bindings), sentencepiece
                                 and diskcache: ``pip install --target``, put on sys.path
        llama.cpp/               convert_hf_to_gguf.py, conversion/, gguf-py/, from the sdist
        overbrainer-tools.json   written last: versions, how long the build took
    <cache>/tools/llama-cpp-python-0.3.36.lock   held while it is built

``$OVERBRAINER_LLAMA_CPP`` names the folder instead (the tests and CI keep one per checkout
at ``.venv/overbrainer-tools/``). pip reuses a wheel it built before (its own cache), and
looks in ``$OVERBRAINER_WHEELHOUSE`` first when that is set. The tools run in subprocesses of
this Python (``_llama_cpp_run``), with torch, numpy and transformers from this environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import OverbrainerError
from ..folder import cache_root
from ..fsio import build_once

__all__ = ["LLAMA_CPP_PYTHON", "llama_cpp_tools", "convert", "quantize", "site_path", "knows_template", "check_gguf_template"]

LLAMA_CPP_PYTHON = "0.3.36"
# what the converter imports beyond this environment (llama.cpp's requirements-convert_*),
# and llama_cpp's own dependency; torch, numpy, transformers, jinja2 come from here
EXTRA_PACKAGES = ("sentencepiece==0.2.3", "diskcache==5.6.3")
ENV = "OVERBRAINER_LLAMA_CPP"
MARKER = "overbrainer-tools.json"
PIP_TIMEOUT_S = 3 * 3600
_CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class LlamaCppError(OverbrainerError):
    """llama.cpp's tools cannot be built, or a conversion failed."""


def tools_path() -> Path:
    named = os.environ.get(ENV)
    if named:
        return Path(named).expanduser().absolute()
    return cache_root() / "tools" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def site_path(tools: Path) -> Path:
    return tools / "site"


def llama_cpp_tools(say: Callable[[str], None] = print, log: Path | None = None) -> Path:
    """The tools folder, built first (under a lock, once) when it is not whole."""
    tools = tools_path()
    return build_once(tools, MARKER, lambda tmp: _build(tmp, tools, say, log),
                      waiting=lambda: say(f"gguf: waiting for another process building llama.cpp at {tools}"))


def _build(tmp: Path, final: Path, say: Callable[[str], None], log: Path | None) -> None:
    started = time.monotonic()
    say(f"gguf: building llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON}) at {final}, once per machine: "
        "tens of minutes on 2 cores")
    tmp.mkdir()
    wheelhouse = os.environ.get("OVERBRAINER_WHEELHOUSE")
    links = ["--find-links", wheelhouse] if wheelhouse else []
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory(dir=tmp) as download:
        say("gguf: fetching the llama.cpp sources (its converter)")
        _pip([*pip, "download", "--no-deps", "--no-binary", ":all:", *links, "-d", download,
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], "download llama-cpp-python's source", log)
        _extract_converter(next(Path(download).glob("llama_cpp_python-*.tar.gz")), tmp / "llama.cpp")
    say("gguf: compiling llama.cpp (cmake); pip's output goes to the run's log")
    # all cores; no multimodal (mtmd) library, which a bake never loads: 30 % less to compile.
    # $CMAKE_ARGS (a CUDA build's -DGGML_CUDA=on) is kept
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2)),
           "CMAKE_ARGS": " ".join(filter(None, [os.environ.get("CMAKE_ARGS"), "-DLLAVA_BUILD=OFF"]))}
    _pip([*pip, "install", "--no-deps", "--no-compile", "--progress-bar", "off", *links, "--target", str(tmp / "site"),
          f"llama-cpp-python=={LLAMA_CPP_PYTHON}", *EXTRA_PACKAGES], f"build llama-cpp-python {LLAMA_CPP_PYTHON}", log, env)
    marker = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "packages": list(EXTRA_PACKAGES),
        "python": sys.version.split()[0],
        "seconds": round(time.monotonic() - started, 1),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    say(f"gguf: llama.cpp ready in {marker['seconds']:.0f} s")


def _extract_converter(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        prefix = f"{tar.getmembers()[0].name.split('/')[0]}/vendor/llama.cpp/"
        for member in tar.getmembers():
            rel = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and rel.startswith(_CONVERTER) and (member.isfile() or member.isdir()):
                member.name = rel
                tar.extract(member, dest, filter="data")


def _pip(cmd: list[str], what: str, log: Path | None, env: dict | None = None) -> None:
    out = open(log, "a") if log else subprocess.DEVNULL
    try:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True,
                              env=env, timeout=PIP_TIMEOUT_S)
    finally:
        if log:
            out.close()
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] if not log else [f"see {log}"]
        raise LlamaCppError(f"gguf: could not {what} (pip exited {proc.returncode}: {' '.join(tail)}); "
                            "check the network or $OVERBRAINER_WHEELHOUSE, then bake again")


def _run(args: list[str], tools: Path, what: str, log: Path | None) -> None:
    proc = subprocess.run([sys.executable, "-m", "overbrainer.formats._llama_cpp_run", *args], env=_tools_env(tools),
                          capture_output=True, text=True)
    if log:
        with open(log, "a") as f:
            f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        raise LlamaCppError(f"gguf: llama.cpp could not {what}: {lines[-1] if lines else f'exit {proc.returncode}'}")


def _tools_env(tools: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site_path(tools)), _package_root(),
                                                                      os.environ.get("PYTHONPATH")]))}
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, never another
    return env


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def convert(tools: Path, merged: Path, dest: Path, outtype: str, pre: str, log: Path | None = None,
            model_name: str | None = None) -> None:
    """merged/ -> ``dest``, a GGUF of ``outtype`` (f32, f16, bf16, q8_0, tq1_0, tq2_0, auto);
    ``general.name`` is ``model_name`` (else the folder's name)."""
    named = ["--model-name", model_name] if model_name else []
    _run(["convert", str(tools / "llama.cpp"), pre, "--", str(merged), "--outtype", outtype, "--outfile", str(dest), *named],
         tools, f"convert {merged.name}/ to {outtype}", log)


def quantize(tools: Path, src: Path, dest: Path, ftype: str, log: Path | None = None) -> None:
    """A 16- or 32-bit GGUF -> ``dest`` quantized to ``ftype`` (llama.cpp's LLAMA_FTYPE_<ftype>)."""
    _run(["quantize", str(src), str(dest), ftype, str(os.cpu_count() or 1)], tools, f"quantize to {ftype}", log)


def knows_template(tools: Path, template: str) -> bool:
    """Whether llama.cpp's own chat (llama_chat_apply_template: llama-cli, and llama-server
    without --jinja) recognises the Jinja ``template``; the GGUF carries it either way."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat_template.jinja"
        path.write_text(template, encoding="utf-8")
        proc = subprocess.run([sys.executable, "-m", "overbrainer.formats._llama_cpp_run", "template", str(path)],
                              env=_tools_env(tools), capture_output=True, text=True)
    if proc.returncode not in (0, 3):
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        raise LlamaCppError(f"gguf: llama.cpp could not read the chat template: {lines[-1] if lines else proc.returncode}")
    return proc.returncode == 0


def check_gguf_template(formats: list[str], template: str | None, special_tokens: dict, origin: str,
                        say: Callable[[str], None]) -> None:
    """Before training, when ``bake.formats`` asks for a GGUF: llama.cpp's own chat must know
    the chat template the model will carry (``origin`` names it: "the base model's chat
    template"). A template of one of the families formats/ollama.py knows is known to llama.cpp
    too; any other is asked of llama.cpp itself (its tools built first, once). One it does not know is refused in one line,
    unless ``ollama`` is asked for: then a warning, and the Modelfile has no TEMPLATE."""
    from . import gguf_types
    from .ollama import template_family

    if not gguf_types(formats) or not template:
        return
    if template_family(template, special_tokens):
        return
    if knows_template(llama_cpp_tools(say), template):
        return
    unknown = f"llama.cpp's own chat (llama-cli, and llama-server without --jinja) does not know {origin}"
    if "ollama" in formats:
        say(f"warning: bake.formats: {unknown}; the GGUF carries it, and the Modelfile is written without a TEMPLATE")
        return
    raise OverbrainerError(
        f'bake.formats: {unknown}; set "chat_template" to chatml, llama3, mistral, gemma or phi3, or add "ollama" '
        "to bake.formats to bake the GGUF with this template anyway (the Modelfile then has no TEMPLATE)"
    )


# the types llama.cpp's converter writes itself; the rest are quantized from a 16-bit file
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0")
QUANTIZE_FTYPES = {
    "q6_k": "MOSTLY_Q6_K", "q5_k_m": "MOSTLY_Q5_K_M", "q4_k_m": "MOSTLY_Q4_K_M", "q5_1": "MOSTLY_Q5_1",
    "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0", "mxfp4": "MOSTLY_MXFP4_MOE",
}


def write_ggufs(merged: Path, folder: Path, name: str, qtypes: list[str], say: Callable[[str], None] = print,
                log: Path | None = None) -> list[str]:
    """Write ``<name>-<type>.gguf`` into ``folder`` for each type, in order; the file names.

    Plain Llama models in the types the gguf package quantizes go through formats/gguf.py (no
    llama.cpp build; faster, bench/bake.py); every other model and type through llama.cpp:
    converted, then quantized from the 16-bit file the plan asked for, or from one made for
    the purpose (``auto``: bf16 for a bf16 model, else f16) and removed after."""
    from . import python_writer_covers
    from .gguf import file_name, llama_cpp_pre, write_gguf

    config = json.loads((merged / "config.json").read_text())
    names, tools, source = {}, None, None
    scratch = folder.parent / f".{folder.name}-gguf"
    try:
        # the converted types first: a quantized one is made from the 16-bit file among them
        for qtype in sorted(qtypes, key=lambda t: t not in CONVERT_TYPES):
            dest = folder / file_name(name, qtype)
            say(f"bake: {dest.name}")
            if python_writer_covers(config, qtype):
                write_gguf(merged, dest, qtype, name)
                names[qtype] = dest.name
                continue
            if tools is None:
                tools = llama_cpp_tools(say, log)
                pre = _pre(merged, qtype, llama_cpp_pre)
            if qtype in CONVERT_TYPES:
                convert(tools, merged, dest, qtype, pre, log, model_name=name)
            else:
                if source is None:
                    made = [folder / file_name(name, t) for t in ("f32", "bf16", "f16") if t in qtypes]
                    source = next((p for p in made if p.is_file()), None)
                if source is None:
                    scratch.mkdir(exist_ok=True)
                    source = scratch / "source.gguf"
                    convert(tools, merged, source, "auto", pre, log, model_name=name)
                quantize(tools, source, dest, QUANTIZE_FTYPES[qtype], log)
            names[qtype] = dest.name
    finally:
        if scratch.exists():
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    return [names[t] for t in qtypes]


def _pre(merged: Path, qtype: str, llama_cpp_pre) -> str:
    """The pre-tokenizer name to fall back on when llama.cpp does not know the tokenizer's hash
    ("" when the tokenizer's definition does not tell either; llama.cpp then refuses)."""
    try:
        return llama_cpp_pre(json.loads((merged / "tokenizer.json").read_text(encoding="utf-8")), qtype)
    except (OSError, ValueError, OverbrainerError):
        return ""
