"""Tools a trainer runs in an environment of its own: Axolotl, pinned, built once and cached.

Axolotl pins its own transformers, peft and trl, so it cannot share the project's
environment. Its environment is built on first use, under the shared cache::

    <cache>/tools/axolotl-0.19.0/            a virtual environment: torch 2.13.0 (the CPU
                                             build when there is no NVIDIA GPU), then
                                             axolotl 0.19.0; about 3.7 GB, half a minute
                                             with uv (a dependency), 6 to 7 with pip
        overbrainer-tools.json               written last: what it holds, how long it took,
                                             and Axolotl's config keys (to refuse typos)
    <cache>/tools/axolotl-0.19.0.lock        held while it is built: two bakes build it once
    <cache>/tools/.axolotl-0.19.0.tmp-*/     a build in progress, renamed into place when
                                             whole; a killed build's is removed by the next

(``<cache>`` is ``$OVERBRAINER_CACHE``, default ``~/.cache/overbrainer``.) An environment
without ``overbrainer-tools.json`` is never used as one of ours.

``$OVERBRAINER_AXOLOTL_VENV`` names the environment instead: used as it is when it has a
``bin/python`` (one you made with ``pip install axolotl==0.19.0`` does), built there the
same way when the folder does not exist yet (the tests and CI build one per checkout).

The environment is only ever run as ``<env>/bin/python -m ...``; its ``bin/`` scripts are
rewritten to the final path when the build is renamed into place, so they work by hand too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import OverbrainerError
from ..folder import cache_root
from ..fsio import build_once
from ..portable import script
from ..portable.common import now

__all__ = ["AXOLOTL_VERSION", "TORCH_VERSION", "ToolsError", "axolotl_env", "axolotl_keys", "axolotl_python"]

AXOLOTL_VERSION = "0.19.0"
TORCH_VERSION = "2.13.0"  # what axolotl 0.19.0 accepts (>=2.11, <=2.13), installed first
VENV_ENV = "OVERBRAINER_AXOLOTL_VENV"
MARKER = "overbrainer-tools.json"
# torch's CPU wheels when no local one is found (as scripts/setup does); a bare torch
# requirement from PyPI is the multi-GB CUDA build
TORCH_CPU_INDEX = os.environ.get("OVERBRAINER_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
PIP_TIMEOUT_S = 3600
# the environment of every process run in the tools env: no telemetry (without it, Axolotl
# finishes training, then hangs at exit retrying its telemetry host)
QUIET_ENV = {"AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


class ToolsError(OverbrainerError):
    """The tools environment cannot be built or used."""


def axolotl_python(env: Path | None = None) -> Path:
    """The python of the Axolotl environment (where it is or will be built)."""
    return (env or _env_path()) / "bin" / "python"


def _env_path() -> Path:
    named = os.environ.get(VENV_ENV)
    if named:
        return Path(named).expanduser().absolute()
    return cache_root() / "tools" / f"axolotl-{AXOLOTL_VERSION}"


def axolotl_env(say: Callable[[str], None] = print, log: Path | None = None) -> Path:
    """The Axolotl environment, built first if it is not there. `say` gets a line per
    phase; pip's own output is appended to `log` (the run's log.txt) when given."""
    env, named = _env_path(), bool(os.environ.get(VENV_ENV))
    if (env / MARKER).is_file() or (named and (env / "bin" / "python").exists()):
        return env  # ours, whole; or named by the user, used as it is
    if named and env.exists():
        raise ToolsError(
            f"{VENV_ENV}={env} has no bin/python; point it at a virtual environment with "
            f"axolotl {AXOLOTL_VERSION}, or at a folder that does not exist yet to build one there"
        )
    # not there, or a folder without the marker (not ours): built, under the lock
    return _build_locked(env, say, log)


def _build_locked(env: Path, say: Callable[[str], None], log: Path | None) -> Path:
    return build_once(env, MARKER, lambda folder: build(folder, env, say, log),
                      waiting=lambda: say(f"tools: waiting for another process building the Axolotl environment at {env}"))


def build(tmp: Path, final: Path, say: Callable[[str], None] = print, log: Path | None = None) -> None:
    """Build the environment in `tmp`, ready to be renamed to `final`."""
    started = time.monotonic()
    say(f"tools: building the Axolotl {AXOLOTL_VERSION} environment at {final} (once per machine: a minute or a few, about 3.7 GB)")
    _run([sys.executable, "-m", "venv", str(tmp)], "create the virtual environment", log)
    python = str(tmp / "bin" / "python")
    # --no-compile: pip would byte-compile all of its 4 GB here, at the temporary path; Python
    # compiles what Axolotl imports, once, at the final path
    pip = ["-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", "--no-compile"]
    if _has_nvidia_gpu():
        say(f"tools: installing torch {TORCH_VERSION} (CUDA build)")
        _run([python, *pip, f"torch=={TORCH_VERSION}"], f"install torch {TORCH_VERSION}", log)
    else:
        say(f"tools: installing torch {TORCH_VERSION} (CPU build)")
        # a CPU wheel on this machine (pip's find-links) first, else torch's CPU index; its
        # own dependencies come with Axolotl's below, where torch is named again
        if _run([python, *pip, "--no-index", "--no-deps", f"torch=={TORCH_VERSION}"], "", log, check=False) != 0:
            _run([python, *pip, f"torch=={TORCH_VERSION}", "--index-url", TORCH_CPU_INDEX], f"install torch {TORCH_VERSION}", log)
    # torch named again so that the one just installed is kept
    wanted = [f"axolotl=={AXOLOTL_VERSION}", f"torch=={TORCH_VERSION}"]
    uv = _uv()
    if uv:
        # uv resolves and installs Axolotl's ~240 packages in parallel: about 30 s where
        # pip takes 6 to 7 minutes (2 cores); pip's own index settings go along
        say(f"tools: installing axolotl {AXOLOTL_VERSION} and its dependencies (uv)")
        if _run([uv, "pip", "install", "--python", python, *_pip_indexes_for_uv(), *wanted],
                "", log, check=False) == 0:
            return finish(tmp, final, started, say, installer="uv")
        say(f"tools: uv could not install it{f' (its output is in {log})' if log else ''}; trying pip")
    say(f"tools: installing axolotl {AXOLOTL_VERSION} and its dependencies (pip)")
    _run([python, *pip, *wanted], f"install axolotl {AXOLOTL_VERSION}", log)
    finish(tmp, final, started, say, installer="pip")


def _uv() -> str | None:
    """uv's program: the one the `uv` package installed beside overbrainer, else on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _pip_indexes_for_uv() -> list[str]:
    """pip's index settings from the environment, as uv's flags (uv reads its own
    UV_* variables, not pip's)."""
    flags = []
    for variable, flag in (("PIP_INDEX_URL", "--index-url"), ("PIP_EXTRA_INDEX_URL", "--extra-index-url"),
                           ("PIP_FIND_LINKS", "--find-links")):
        for value in os.environ.get(variable, "").split():
            flags += [flag, value]
    return flags


def finish(tmp: Path, final: Path, started: float, say: Callable[[str], None] = print, installer: str = "pip") -> None:
    """Point the environment's scripts at `final`, record Axolotl's config keys, and write
    the marker, last."""
    for program in (tmp / "bin").iterdir():
        if program.is_file() and not program.is_symlink():
            try:
                text = program.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if str(tmp) in text:
                program.write_text(text.replace(str(tmp), str(final)))
    say("tools: checking that Axolotl imports, and reading its config keys")
    keys = _read_keys(tmp / "bin" / "python")
    marker = {
        "axolotl": AXOLOTL_VERSION,
        "torch": TORCH_VERSION,
        "python": sys.version.split()[0],
        "built": now(),
        "installer": installer,
        "seconds": round(time.monotonic() - started, 1),
        "config_keys": keys,
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    say(f"tools: Axolotl environment ready in {marker['seconds']:.0f} s")


def axolotl_keys(env: Path) -> dict[str, list[str]]:
    """Axolotl's config keys: ``{"config": top-level keys, "dataset": keys of a datasets
    entry}``, from the environment's marker, else read from Axolotl itself (slow: an import)."""
    try:
        return json.loads((env / MARKER).read_text())["config_keys"]
    except (OSError, ValueError, KeyError):
        return _read_keys(env / "bin" / "python")


def _read_keys(python: Path) -> dict[str, list[str]]:
    done = subprocess.run(
        [str(python), *script("axolotl_plugin", "keys")],
        capture_output=True, text=True, env={**os.environ, **QUIET_ENV}, timeout=600,
    )
    if done.returncode != 0:
        raise ToolsError(f"the Axolotl environment at {python.parent.parent} does not import axolotl: {_last_line(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(command: list[str], what: str, log: Path | None, check: bool = True) -> int:
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        if log:
            out.write(f"--- tools: {' '.join(command)}\n".encode())
            out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                              stdin=subprocess.DEVNULL, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolsError(f"cannot {what}: no end in {PIP_TIMEOUT_S} s; set {VENV_ENV} to an environment with axolotl {AXOLOTL_VERSION}") from None
    finally:
        if log:
            out.close()
    if check and done.returncode != 0:
        why = _last_line(log.read_text(errors="replace")) if log else _last_line((done.stderr or b"").decode(errors="replace"))
        where = f"; pip's output is in {log}" if log else ""
        raise ToolsError(
            f"cannot {what} ({why[:200]}){where}; where there is no network, build it elsewhere "
            f"and set {VENV_ENV} to it"
        )
    return done.returncode


def nvidia_gpus() -> int:
    """How many NVIDIA GPUs this machine has (nvidia-smi's count; no torch import)."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def _has_nvidia_gpu() -> bool:
    return nvidia_gpus() > 0


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
