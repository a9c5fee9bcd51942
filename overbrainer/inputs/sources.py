"""Sources: the plan's ``data`` entries, found on disk or in the Hugging Face cache.

An entry's ``path`` is, in the order tried:

- a glob (``data/*.jsonl``): the matching files with a data suffix, sorted;
- a file (see :mod:`overbrainer.inputs.readers` for the types);
- a folder written by ``datasets.save_to_disk``: a ``Dataset`` (``state.json`` listing its
  ``.arrow`` files) or a ``DatasetDict`` (``dataset_dict.json`` naming its splits, one such
  folder each; ``split`` picks one);
- any other folder: every data file under it, sorted by path;
- a Hugging Face dataset id ``org/name[@revision][:config]``: the repository's snapshot in the
  hub cache (``$HF_HUB_CACHE``, laid out by ``huggingface_hub``: ``datasets--org--name/
  refs/<branch>`` holding a commit, ``snapshots/<commit>/...``), downloaded there with
  ``huggingface_hub.snapshot_download`` when online. The files of its config and ``split``
  are those ``datasets`` resolves (the README's ``configs:``, else its file-name
  conventions). What it resolved for a commit is remembered in
  ``<overbrainer cache>/hub-datasets/<commit>.json`` (``{"<config>": {"<split>": [paths
  relative to the snapshot]}}``): a commit never changes, and a rebake imports no
  ``datasets``.

A hub source is pinned by its commit (``revision``) and the content hash of its files; a
file, folder or glob by the content hash of its files. Problems are one line naming the
plan's field (``data[1]``) and the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OverbrainerError
from ..folder import cache_root
from ..fsio import write_atomic
from ..hashing import HashCache, hash_bytes

__all__ = ["SUFFIXES", "SourceFile", "Source", "resolve_sources", "pin_sources"]

_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+?))?(?::(?P<config>[\w.-]+))?$"
)
# the data file types inputs/readers.py reads
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_GLOB = re.compile(r"[*?[]")


@dataclass(frozen=True)
class SourceFile:
    path: Path  # where it is read
    shown: str  # how errors name it: relative to where the command runs, or hf://...
    name: str  # how the examples' source column names it: the same wherever the bake runs


@dataclass
class Source:
    """One data entry, resolved: its files and how they are read and mixed."""

    entry: str  # the path as the plan writes it
    field: str  # the plan's field, for errors: data[1]
    kind: str  # file, glob, folder, disk (save_to_disk) or hub
    files: list[SourceFile]
    format: str = "auto"
    fields: dict = field(default_factory=dict)
    split: str = "train"
    weight: float | None = None
    rows: int | None = None
    revision: str | None = None  # hub: the commit
    config: str | None = None  # hub: the config resolved

    def as_json(self) -> dict:
        """This source as JSON (a compiled bake handed to the run's own process)."""
        data = dataclasses.asdict(self)
        data["files"] = [{"path": str(f.path), "shown": f.shown, "name": f.name} for f in self.files]
        return data

    @classmethod
    def from_json(cls, data: dict) -> Source:
        files = [SourceFile(Path(f["path"]), f["shown"], f["name"]) for f in data["files"]]
        return cls(**{**data, "files": files})


def resolve_sources(entries: list[dict], plan_dir: Path, shown_plan: str) -> list[Source]:
    """The plan's ``data`` (its JSON form: ``plan.DataSource`` dumps) as sources; raises
    OverbrainerError (one line: the plan file, the field, the fix) for one that is not there."""
    sources = []
    for i, entry in enumerate(entries):
        where = f"{shown_plan}: data[{i}]"
        source = _resolve(entry, plan_dir, where)
        source.field = f"data[{i}]"
        if source.kind not in ("hub", "disk") and source.split != "train":
            raise OverbrainerError(
                f"{where}: {entry['path']!r} is a {source.kind}, which has no splits; remove split"
            )
        sources.append(source)
    return sources


def _settings(entry: dict) -> dict:
    return {k: entry[k] for k in ("format", "fields", "split", "weight", "rows") if entry.get(k) is not None}


def _resolve(entry: dict, plan_dir: Path, where: str) -> Source:
    rel = entry["path"]
    path = Path(os.path.abspath((plan_dir / rel).expanduser()))
    settings = _settings(entry)

    def local(p: Path) -> SourceFile:
        return SourceFile(p, _shown(p), _relative(p, plan_dir))

    if _GLOB.search(rel) and not path.exists():
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file() and p.suffix.lower() in SUFFIXES]
        if not files:
            raise OverbrainerError(
                f"{where}: {rel!r} matches no data file ({', '.join(SUFFIXES)}); fix the pattern "
                "(paths are relative to the plan file)"
            )
        return Source(rel, "", "glob", [local(p) for p in files], **settings)
    if path.is_file():
        return Source(rel, "", "file", [local(path)], **settings)
    if path.is_dir():
        disk = _save_to_disk_files(path, settings.get("split", "train"), where, rel)
        if disk is not None:
            return Source(rel, "", "disk", [local(p) for p in disk], **settings)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise OverbrainerError(
                f"{where}: the folder {rel!r} holds no data file ({', '.join(SUFFIXES)}); "
                "put the conversation files in it, or name them"
            )
        return Source(rel, "", "folder", [local(p) for p in files], **settings)
    special = _special_kind(path)
    if special:
        via = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise OverbrainerError(
            f"{where}: {rel!r}{via} is {special}, not a regular file; give a file of conversations "
            "(a stream or device would be read without end)"
        )
    hub = _HUB_ID.match(rel)
    if hub and not rel.startswith((".", "/", "~")) and Path(rel).suffix.lower() not in SUFFIXES:
        return _hub(rel, hub["repo"], hub["revision"], hub["config"], settings, where)
    raise OverbrainerError(
        f"{where}: {rel!r} no such file (paths are relative to the plan file); fix the path, "
        "or give a Hugging Face dataset id such as org/name"
    )


def _special_kind(path: Path) -> str | None:
    """What a path that exists but is neither a file nor a folder is, in words; None otherwise."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, words in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return None


def _shown(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _relative(path: Path, plan_dir: Path) -> str:
    try:
        return Path(os.path.relpath(path, plan_dir)).as_posix()
    except ValueError:
        return str(path)


# -- save_to_disk folders ----------------------------------------------------------------


def _save_to_disk_files(folder: Path, split: str, where: str, rel: str) -> list[Path] | None:
    """The .arrow files of a save_to_disk folder at ``split``; None for another folder."""
    splits_file = folder / "dataset_dict.json"
    if splits_file.is_file():
        splits = _read_json(splits_file, where).get("splits") or []
        if split not in splits:
            raise OverbrainerError(
                f"{where}: the dataset {rel!r} has no split {split!r} (it has {', '.join(map(str, splits))}); "
                "set split to one of those"
            )
        folder = folder / split
    elif split != "train":
        if (folder / "state.json").is_file():
            raise OverbrainerError(
                f"{where}: {rel!r} is one Dataset saved with save_to_disk, which has no splits; remove split"
            )
        return None
    state_file = folder / "state.json"
    if not state_file.is_file():
        if splits_file.is_file():
            raise OverbrainerError(f"{where}: {folder} has no state.json; save the dataset again with save_to_disk")
        return None
    names = [f.get("filename") for f in _read_json(state_file, where).get("_data_files") or []]
    files = [folder / n for n in names if isinstance(n, str)]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or not files:
        raise OverbrainerError(
            f"{where}: the save_to_disk folder {rel!r} lists {'missing files: ' + ', '.join(missing) if missing else 'no data files'}; "
            "save the dataset again with save_to_disk"
        )
    return files


def _read_json(path: Path, where: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OverbrainerError(f"{where}: cannot read {path} ({e}); save the dataset again") from None
    return value if isinstance(value, dict) else {}


# -- Hugging Face datasets ---------------------------------------------------------------


def _hub_cache() -> Path:
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return Path(env)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface")
    return Path(home) / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub(entry: str, repo: str, revision: str | None, config: str | None, settings: dict, where: str) -> Source:
    snapshot = _snapshot(repo, revision, where, entry)
    commit = snapshot.name
    split = settings.get("split", "train")
    configs = _data_files(repo, snapshot, where, entry)
    if config is None:
        config = "default" if "default" in configs or len(configs) != 1 else next(iter(configs))
    if config not in configs:
        raise OverbrainerError(
            f"{where}: the dataset {repo} has no config {config!r} (it has {', '.join(configs)}); "
            f"write {repo}:<config> with one of those"
        )
    splits = configs[config]
    if split not in splits:
        raise OverbrainerError(
            f"{where}: the dataset {repo}:{config} has no split {split!r} (it has {', '.join(splits)}); "
            "set split to one of those"
        )
    files = []
    for rel in splits[split]:
        url = f"hf://datasets/{repo}@{commit}/{rel}"
        files.append(SourceFile(snapshot / rel, url, url))
    unread = [f.path.name for f in files if f.path.suffix.lower() not in SUFFIXES]
    if unread:
        raise OverbrainerError(
            f"{where}: {repo}:{config} is stored as {', '.join(unread[:3])}, a type that is not read "
            f"({', '.join(SUFFIXES)} are); pick another config, or convert it to Parquet"
        )
    return Source(entry, "", "hub", files, revision=commit, config=config, **settings)


def _snapshot(repo: str, revision: str | None, where: str, entry: str) -> Path:
    """The snapshot folder of ``repo`` at ``revision`` (a branch, tag or commit)."""
    folder = _hub_cache() / f"datasets--{repo.replace('/', '--')}"
    wanted = revision or "main"
    if _COMMIT.match(wanted) and (folder / "snapshots" / wanted).is_dir():
        return folder / "snapshots" / wanted
    if _offline():
        ref = folder / "refs" / wanted
        if ref.is_file():
            commit = ref.read_text().strip()
            if (folder / "snapshots" / commit).is_dir():
                return folder / "snapshots" / commit
        raise OverbrainerError(
            f"{where}: the dataset {entry!r} is not in the Hugging Face cache ({_hub_cache()}) and "
            f"HF_HUB_OFFLINE is set; run `hf download {repo} --repo-type dataset"
            f"{f' --revision {revision}' if revision else ''}` where there is network (or unset "
            "HF_HUB_OFFLINE), or point HF_HUB_CACHE at the cache that has it"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=wanted, cache_dir=_hub_cache(),
                                      etag_timeout=10))
    except Exception as e:  # no network, no such repo or revision, gated...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OverbrainerError(
            f"{where}: cannot get the dataset {entry!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{reason[:160]}); check the id and revision (and HF_TOKEN for a private one), or "
            "download it elsewhere and give its local path"
        ) from None


def _data_files(repo: str, snapshot: Path, where: str, entry: str) -> dict[str, dict[str, list[str]]]:
    """``{config: {split: [files relative to the snapshot]}}`` as ``datasets`` resolves them."""
    memo = cache_root() / "hub-datasets" / f"{snapshot.name}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    try:
        import datasets
        from datasets.utils.logging import disable_progress_bar, set_verbosity_error
    except ImportError:
        raise OverbrainerError(
            f"{where}: reading the Hugging Face dataset {entry!r} needs the datasets package; pip install datasets"
        ) from None
    disable_progress_bar()
    set_verbosity_error()
    resolved: dict[str, dict[str, list[str]]] = {}
    try:
        names = datasets.get_dataset_config_names(str(snapshot))
        for name in names:
            builder = datasets.load_dataset_builder(str(snapshot), name)
            splits = builder.config.data_files or {}
            resolved[name] = {
                str(split): [Path(os.path.relpath(str(f), snapshot)).as_posix() for f in files]
                for split, files in splits.items()
            }
    except Exception as e:  # a repo datasets cannot make sense of (a loading script, ...)
        raise OverbrainerError(
            f"{where}: the datasets package cannot read {repo} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}); give a config with data files, or a local copy"
        ) from None
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(memo, json.dumps(resolved, indent=1).encode())
    return resolved


# -- pins --------------------------------------------------------------------------------


def pin_sources(sources: list[Source], hashes: HashCache) -> list[dict]:
    """What plan.json and the split's fingerprint record of each source: as the plan writes
    it, its settings, its commit (hub), and one content hash over its files."""
    pins = []
    for source in sources:
        if len(source.files) == 1 and source.kind == "file":
            digest = hashes.hash(source.files[0].path)
        else:
            lines = [f"{f.name}:{hashes.hash(f.path)}" for f in source.files]
            digest = hash_bytes("\n".join(lines).encode())
        pin = {"path": source.entry, "hash": digest}
        # how it is read and mixed, where not the default: a changed weight shows in `why`
        pin.update({k: v for k, v in (("format", source.format), ("fields", source.fields),
                                      ("split", source.split), ("weight", source.weight),
                                      ("rows", source.rows))
                    if v not in (None, "auto", "train", {})})
        if source.kind == "hub":
            pin.update(revision=source.revision, config=source.config)
        if source.kind != "file":
            pin["files"] = len(source.files)
        pins.append(pin)
    return pins
