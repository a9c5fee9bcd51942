"""Stamps: the record that a step finished, and the source of truth for what is up to date.

A stamp is a small JSON file, ``<run>/.stamps/<step>.json``, written last and atomically
(temp file + ``os.replace``) by the step that made its outputs::

    {
      "step": "train",
      "version": 1,                    # the step's code version, part of the fingerprint
      "fingerprint": "9f2c...",        # hash of everything the step read (see `fingerprint`)
      "inputs": {...},                 # what went into the fingerprint, readable ("why")
      "root": "",                      # where the outputs' paths start: "" is the run
                                       # folder (so a moved or restored run still matches),
                                       # "branches/300" a branch in it; else absolute (the cache)
      "outputs": [{"path": "checkpoints/step-000010/adapter_model.safetensors",
                   "size": 1234, "mtime_ns": 1700000000000000000, "hash": "ab12..."}],
      "summary": {...},                # what the step wants to tell (counts, losses)
      "finished": "2026-12-02T14:00:00+00:00"
    }

A step is up to date when its stamp has the current fingerprint and every output still
matches the manifest. Matching is by ``size`` and ``mtime_ns`` first (a stat, no read);
only a file whose mtime changed is hashed, once (the hash cache keeps the answer).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fsio import write_atomic
from .hashing import HashCache, hash_bytes
from .portable.common import now

__all__ = [
    "Stamp", "fingerprint", "read_stamp", "write_stamp", "manifest", "verify", "outputs_digest",
    "diff_inputs", "input_changes", "short",
]


@dataclass
class Stamp:
    step: str
    version: int
    fingerprint: str
    inputs: dict
    root: str
    outputs: list[dict]
    summary: dict = field(default_factory=dict)
    finished: str = ""


def fingerprint(step: str, version: int, inputs: dict) -> str:
    """The identity of a step's work: its name, code version and every input it reads."""
    return hash_bytes(canonical_json({"step": step, "version": version, "inputs": inputs}))


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def read_stamp(path: str | os.PathLike) -> Stamp | None:
    """The stamp at `path`, or None when it is missing or unreadable (a torn or altered
    stamp means "not done", never a crash)."""
    try:
        data = json.loads(Path(path).read_text())
        stamp = Stamp(**data)
        if not isinstance(stamp.outputs, list) or not isinstance(stamp.fingerprint, str):
            return None
        return stamp
    except (OSError, ValueError, TypeError):
        return None


def write_stamp(path: str | os.PathLike, stamp: Stamp) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp.finished = stamp.finished or now()
    write_atomic(path, json.dumps(asdict(stamp), indent=1).encode(), fault="stamp:before-replace")


def manifest(root: str | os.PathLike, entries: list[str], hashes: HashCache) -> list[dict]:
    """Size, mtime and hash of every file under the given entries (files or folders,
    relative to `root`), sorted by path. Hidden temp files are left out."""
    root = Path(root)
    files: list[Path] = []
    for entry in entries:
        p = root / entry
        if p.is_dir():
            files.extend(q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".tmp"))
        elif p.is_file():
            files.append(p)
    out = []
    for p in sorted(set(files)):
        st = p.stat()
        out.append(
            {
                "path": p.relative_to(root).as_posix(),
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "hash": hashes.hash(p, st),
            }
        )
    return out


def verify(stamp: Stamp, hashes: HashCache, run_dir: str | os.PathLike) -> str | None:
    """None when every output still matches the stamp; else why not, in a few words.

    A file with the manifest's size and mtime_ns is taken as unchanged, whatever its inode
    (a run folder restored from a cache). One whose mtime changed is hashed, and the new
    stat remembered by the hash cache, so that it is read once, not on every rerun.
    """
    root = Path(run_dir) / stamp.root  # "" is the run folder; a branch's is relative to it, the cache's absolute
    for entry in stamp.outputs:
        p = root / entry["path"]
        try:
            st = p.stat()
        except OSError:
            return f"{entry['path']} is missing"
        if st.st_size != entry["size"]:
            return f"{entry['path']} changed size"
        if st.st_mtime_ns == entry["mtime_ns"]:
            continue
        if hashes.hash(p, st) != entry["hash"]:
            return f"{entry['path']} changed"
    return None


def outputs_digest(stamp: Stamp, under: str | None = None) -> str:
    """One hash for the content of a stamp's outputs (optionally only those under a path):
    what a downstream step's fingerprint takes from it."""
    items = [
        f"{e['path']}:{e['hash']}"
        for e in stamp.outputs
        if under is None or e["path"] == under or e["path"].startswith(under.rstrip("/") + "/")
    ]
    return hash_bytes("\n".join(items).encode())


def _flatten(value, prefix: str = "") -> dict[str, object]:
    """Leaves by dotted path. A list of dicts is flattened too, each item keyed by its
    ``path`` when it has one (``data[chats.jsonl].hash``), else by its index; a list of
    plain values stays one value (``train.lora_target_modules``)."""
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        base = prefix.rstrip(".")
        for i, item in enumerate(value):
            path = item.get("path")
            if isinstance(path, str):
                rest = {k: v for k, v in item.items() if k != "path"}
                out.update(_flatten(rest, f"{base}[{path}].") or {f"{base}[{path}]": path})
            else:
                out.update(_flatten(item, f"{base}[{i}]."))
        return out
    return {prefix.rstrip("."): value}


def input_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """What changed between two fingerprints' inputs: (field, old, new), sorted by field;
    a field one side lacks is ``"(none)"`` there."""
    before, after = _flatten(old or {}), _flatten(new)
    changes = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, "(none)"), after.get(key, "(none)")
        if a != b:
            changes.append((key, a, b))
    return changes


def diff_inputs(old: dict, new: dict) -> list[str]:
    """What changed between two fingerprints' inputs, as "field: old → new" lines."""
    return [f"{key}: {short(a)} → {short(b)}" for key, a, b in input_changes(old, new)]


def short(value) -> str:
    """A value as a why-line shows it: hashes cut to 12 digits, long values to 60 characters."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12]  # a hash
    return text if len(text) <= 60 else text[:57] + "..."
