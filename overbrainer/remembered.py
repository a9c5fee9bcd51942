"""A validated plan, remembered, so that checking what is up to date needs no pydantic.

Validating a plan takes pydantic, whose import alone (about 120 ms) costs more than the
whole up-to-date check of a finished run. So once a plan file has been validated for a
run folder, what pydantic made of it is remembered there, in ``.plan.json``, keyed by the
plan file's bytes, its path and the code of ``overbrainer/plan.py`` (whose defaults shape
the result). While none of them changed, `load` gives that data back as a `Remembered`
plan: the same values, read by attribute as the models are. Anything else (a new plan, an
edit, another overbrainer) is validated again by ``overbrainer.plan``, with its errors told
there, and remembered anew.

A remembered plan is for reading. A step that runs work asks for the models themselves
(`validated`), so nothing that trains or writes a model ever depends on this shortcut.

``.plan.json``::

    {"key": "<blake3 of plan.py, the plan's path and its bytes>", "plan": {...model_dump...}}
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from .folder import PLAN_MEMO, default_name
from .fsio import write_atomic

__all__ = ["Remembered", "load", "validated", "FILE"]

FILE = PLAN_MEMO
_PLAN_CODE = Path(__file__).with_name("plan.py")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class Remembered:
    """Settings read back from their JSON form, by attribute (``plan.train.adapter``);
    ``model_dump()`` gives the JSON form, as the models' ``model_dump(mode="json")`` does."""

    __slots__ = ("_data",)

    def __init__(self, data: dict):
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name: str):
        try:
            value = self._data[name]
        except KeyError:
            raise AttributeError(name) from None
        return Remembered(value) if isinstance(value, dict) else value

    def __setattr__(self, name, value):
        raise AttributeError("a remembered plan is read-only")

    def model_dump(self, mode: str = "json", exclude: set[str] | None = None) -> dict:
        return copy.deepcopy({k: v for k, v in self._data.items() if k not in (exclude or ())})

    @property
    def data_files(self) -> list[str]:
        data = self._data["data"]  # a list of {"path": ..., ...} (plan.DataSource)
        return [e["path"] for e in data]


def _key(path: Path, raw: bytes) -> str:
    from blake3 import blake3

    h = blake3(_PLAN_CODE.read_bytes())
    h.update(b"\0" + str(path).encode() + b"\0")
    h.update(raw)
    return h.hexdigest()


def _name_of(path: Path, raw: bytes) -> str | None:
    """The run's name from the plan's bytes, without validating them; None if unclear."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name", default_name(path))
    return name if isinstance(name, str) and _NAME.match(name) else None


def load(path: Path, runs: Path):
    """The plan at `path` (absolute) and the bytes it was read from: remembered by its run
    folder under `runs` when that still holds, else validated (PlanError with every
    problem) and remembered."""
    try:
        raw = path.read_bytes()
    except OSError:
        raw = None
    if raw is not None:
        name = _name_of(path, raw)
        if name is not None:
            key = _key(path, raw)
            try:
                memo = json.loads((runs / name / FILE).read_bytes())
            except (OSError, ValueError):
                memo = None
            if isinstance(memo, dict) and memo.get("key") == key and isinstance(memo.get("plan"), dict):
                return Remembered(memo["plan"]), raw
    plan = validated(path, raw)
    if raw is not None:
        remember(path, raw, plan, runs / plan.name)
    return plan, raw


def validated(path: Path, raw: bytes | None = None):
    """The plan's models, validated now (``overbrainer.plan``), from `raw` when given."""
    from .plan import load_plan

    return load_plan(path, raw)


def remember(path: Path, raw: bytes, plan, folder: Path) -> None:
    """Keep what `plan` (the models, validated from `raw`) is in `folder`, for the next
    `load`; only in a run folder that exists (a plan never baked leaves nothing behind)."""
    if not folder.is_dir():
        return
    try:
        memo = {"key": _key(path, raw), "plan": plan.model_dump(mode="json")}
        write_atomic(folder / FILE, json.dumps(memo), durable=False)
    except OSError:
        pass  # a read-only folder: the next check validates again, that is all
