"""The split step's data: sources of conversations in, one validated ``examples.parquet`` out.

The sources are the plan's ``data`` entries (:mod:`overbrainer.inputs.sources` finds them,
:mod:`overbrainer.inputs.readers` reads their files, :mod:`overbrainer.inputs.formats` turns
each row into ``[{"role", "content"}, ...]``, :mod:`overbrainer.inputs.mixing` picks what the
examples hold). The first bad row of a file is reported as a
:class:`~overbrainer.errors.DataError` with its ``file:line``, after the whole file has been
read, so that the message can also say how many more bad rows it holds.

Output, ``examples.parquet``: one row per example, in order of the conversations' first
appearance across the sources, written in row groups of :data:`BATCH_ROWS` rows:

========== ================== ====================================================
column     type               what
========== ================== ====================================================
id         string             the first 32 hex digits of the blake3 digest of the
                              conversation's canonical JSON (see :func:`conversation_id`)
split      string             ``"train"`` or ``"validation"``
messages   MESSAGE_TYPE       ``list<struct<role: string, content: string>>``
source     string             ``"<file>:<line>"`` of the conversation's first occurrence;
                              a hub file is ``hf://datasets/<org>/<name>@<commit>/<path>``
========== ================== ====================================================

Exact duplicates (same id) are dropped: a conversation belongs to the source it first
appears in. The split depends only on each conversation's content and the seed
(:func:`split_score`), never on its position, so adding conversations or sources does not
move the others between train and validation. Without weights each conversation is one
row; a weight that asks for more examples than a source has repeats its conversations,
each copy a row (with the same id), adjacent.

The file is written to a temporary file beside it and moved into place with
``os.replace``; a failed split leaves neither.
"""

from __future__ import annotations

import os
import secrets
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from json.encoder import encode_basestring as _encode
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError
from ..hashing import hash_bytes
from .formats import ROLES, BadRow, Normalizer
from .mixing import select
from .readers import raw_rows
from .sources import Source, SourceFile

__all__ = [
    "MESSAGE_TYPE",
    "SCHEMA",
    "SplitSummary",
    "conversation_id",
    "read_conversations",
    "split_conversations",
    "split_sources",
    "split_score",
]

MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("split", pa.string()),
        ("messages", MESSAGE_TYPE),
        ("source", pa.string()),
    ]
)
BATCH_ROWS = 4096

_OPEN = {role: f'{{"role":"{role}","content":' for role in ROLES}  # canonical JSON, up to content
_STAGE_SCHEMA = pa.schema([SCHEMA.field("id"), SCHEMA.field("messages"), SCHEMA.field("source")])


@dataclass
class SplitSummary:
    """What a split wrote: row counts, and where the conversations came from.

    ``sources`` has one item per source: ``{"source", "formats": {format: rows}, "read",
    "train", "validation", "tokens"}``: rows read, train examples (copies counted) and
    validation conversations it gave, and the estimated tokens of its train examples.
    """

    rows: int  # rows of examples.parquet (copies counted)
    train: int
    validation: int
    duplicates: int
    files: dict[str, int]  # display name -> conversations read from it, before dedup
    train_tokens_estimate: int  # sum of len(content) // 4 over the train rows' messages
    sources: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# -- ids and scores ------------------------------------------------------------------


def conversation_id(messages: list[dict]) -> str:
    """The first 32 hex digits of blake3 over the canonical JSON of normalized messages.

    Canonical JSON is ``json.dumps(messages, ensure_ascii=False, separators=(",", ":"))``
    encoded as UTF-8, each message written as ``{"role": ..., "content": ...}`` in that
    key order. It is built here from json's own string encoder, the one ``json.dumps``
    uses, which gives the same text twice as fast.
    """
    try:
        # orjson writes these lists byte for byte as json.dumps above does (every code point
        # checked), three times faster; a lone surrogate it refuses takes the path below
        return hash_bytes(orjson.dumps(messages))[:32]
    except TypeError:
        pass
    canonical = ",".join([f"{_OPEN[m['role']]}{_encode(m['content'])}}}" for m in messages])
    return hash_bytes(f"[{canonical}]".encode())[:32]


def _score_int(seed: int, row_id: str) -> int:
    # the first 8 bytes of the digest, big-endian: the first 16 hex digits
    return int(hash_bytes(f"{seed}:{row_id}".encode())[:16], 16)


def split_score(seed: int, row_id: str) -> float:
    """A conversation's place in [0, 1) for the split: blake3(f"{seed}:{id}")'s first 8
    bytes, big-endian, over 2**64. It depends on the content and the seed only."""
    return _score_int(seed, row_id) / 2**64


# -- reading -------------------------------------------------------------------------


def read_conversations(
    path: Path,
    *,
    display_name: str | None = None,
    normalizer: Normalizer | None = None,
) -> Iterator[tuple[int, list[dict]]]:
    """Yield ``(line_number, messages)`` for each conversation in one data file.

    ``line_number`` is 1-based (for Parquet and Arrow, the 1-based row number; for CSV, the
    record number counting the header); ``messages`` is the normalized ``[{"role": str,
    "content": str}, ...]``, read by ``normalizer`` (default: format auto, no renames). On
    the first invalid row the file is read to its end without yielding more, and a
    :class:`DataError` for that row is raised, ending with " (and N more bad rows in this
    file)" when there are others. A missing, unreadable or empty file, or one of an unknown
    type, raises DataError too. ``display_name`` is how the file is named in errors
    (default ``str(path)``).
    """
    path = Path(path)
    name = str(path) if display_name is None else display_name
    normalize = normalizer or Normalizer()
    first: tuple[int, BadRow] | None = None
    bad = 0
    count = 0
    for number, row in raw_rows(path, name, normalize.data_names()):
        try:
            if isinstance(row, BadRow):
                raise row
            messages = normalize(row)
        except BadRow as error:
            bad += 1
            if first is None or number < first[0]:  # a CSV reports its ragged records last
                first = (number, error)
            continue
        if first is None:
            count += 1
            yield number, messages
    unseen = normalize.unseen()
    if unseen and (first is not None or count):
        # a name the data does not have: every row would be "bad", the name is the mistake
        canon, data_name = unseen[0]
        raise DataError(
            name, None, f"fields.{canon} names {data_name!r}, which is in none of its rows",
            "fix the name in the data entry's fields (it is the data's name for that key)",
        )
    if first is not None:
        number, error = first
        fix = error.fix
        more = bad - 1
        if more:
            fix += f" (and {more} more bad {'row' if more == 1 else 'rows'} in this file)"
        raise DataError(name, number, error.what, fix)
    if count == 0:
        raise DataError(
            name,
            None,
            "the file has no conversations",
            "add conversations to it, or remove it from the plan's data",
        )


# -- splitting -----------------------------------------------------------------------


def split_conversations(
    files: list[Path],
    out: Path,
    validation: float | int,
    seed: int,
    display_names: dict[Path, str] | None = None,
    source_names: dict[Path, str] | None = None,
) -> SplitSummary:
    """:func:`split_sources` with each file a source of its own, read as it is.

    ``display_names`` maps a path to how errors name it (default ``str(path)``);
    ``source_names`` to how the ``source`` column names it (default: as errors do).
    """
    display_names = display_names or {}
    source_names = source_names or {}
    sources = []
    for f in files:
        shown = display_names.get(f) or display_names.get(Path(f)) or str(f)
        name = source_names.get(f) or source_names.get(Path(f)) or shown
        sources.append(Source(name, name, "file", [SourceFile(Path(f), shown, name)]))
    return split_sources(sources, out, validation, seed)


def split_sources(sources: list[Source], out: Path, validation: float | int, seed: int) -> SplitSummary:
    """Validate ``sources``, drop exact duplicates, cap, split, mix, and write ``out``.

    ``validation`` is either a fraction in [0, 1), a conversation is then in validation
    when its :func:`split_score` is below it, or a count ``k >= 0``: the ``k``
    conversations with the smallest scores. Either way a conversation's split depends only
    on its content and ``seed``. With a fraction, adding conversations never moves old
    ones between train and validation. With a count, adding conversations can only move
    old ones from validation to train (a new one may take their place), never the other
    way. ``0`` (or ``0.0``) means no validation rows. Caps (``rows``) and weights are
    applied as :mod:`overbrainer.inputs.mixing` says.

    One pass reads every file, validating it and writing the distinct conversations in
    record batches; only ids, scores and counts stay in memory. With a count, caps or
    weights, what each row becomes is known only at the end, so that pass writes a staging
    file without the split column, which a second pass copies, adding it (and the copies).
    Everything is written to temporary files beside ``out``, moved into place with
    ``os.replace``. On any error neither ``out`` (not even an older one) nor a temporary
    file is left. Raises :class:`DataError` for a bad file or row, and for a
    ``split.validation`` that leaves no conversation to train on.
    """
    out = Path(out)
    where = ", ".join(s.entry for s in sources) if sources else str(out)
    count = _check_validation(validation, where)
    if not sources:
        raise DataError(
            where,
            None,
            "no conversation files to split",
            "list at least one file in the plan's data",
        )
    weighted = [s.weight for s in sources]
    weights = weighted if any(w is not None for w in weighted) else None
    if weights is not None and None in weights:
        raise DataError(where, None, "some sources have a weight and some do not",
                        "give every data entry a weight, or none")
    caps = [s.rows for s in sources]
    direct = not count and weights is None and all(c is None for c in caps)

    out.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp = out.with_name(f".{out.name}.{token}.tmp")
    stage = out.with_name(f".{out.name}.{token}.stage.tmp")
    try:
        if direct:  # a fraction, nothing capped or weighted: each row's split is known at once
            summary = _write_rows(sources, tmp, SCHEMA, seed, fraction=float(validation))
        else:
            summary, kept = _write_rows(sources, stage, _STAGE_SCHEMA, seed, fraction=None)
            if count and count >= summary.rows:
                raise DataError(
                    where,
                    None,
                    f"split.validation asks for {count} validation conversations but the data "
                    f"has only {summary.rows} distinct {_plural(summary.rows)}, which would leave "
                    "none to train on",
                    f"set split.validation to at most {summary.rows - 1}, or to a fraction such "
                    "as 0.1, or add conversations",
                )
            copies, in_validation = select(
                kept.source, kept.scores, kept.mix, len(sources),
                fraction=None if count else float(validation), count=count,
                caps=caps, weights=weights,
            )
            _check_shares(sources, kept, copies, in_validation, weights)
            _add_split(stage, tmp, copies, in_validation, kept, summary)
            stage.unlink()
        if summary.train == 0:
            raise DataError(
                where,
                None,
                f"split.validation {validation} puts all {summary.rows} "
                f"{_plural(summary.rows)} in validation, which leaves none to train on",
                "set split.validation to a smaller fraction, or add conversations",
            )
        from ..portable import faults

        faults.point("split:before-rename")
        os.replace(tmp, out)
    except BaseException:
        for leftover in (tmp, stage, out):
            leftover.unlink(missing_ok=True)
        raise
    return summary


def _plural(n: int) -> str:
    return "conversation" if n == 1 else "conversations"


def _check_validation(validation: float | int, where: str) -> int | None:
    """The count, or None for a fraction; DataError naming split.validation if invalid."""
    if isinstance(validation, bool) or not isinstance(validation, (int, float)):
        ok = False
    elif isinstance(validation, int):
        if validation >= 0:
            return validation
        ok = False
    else:
        ok = 0.0 <= validation < 1.0  # also False for NaN
    if not ok:
        raise DataError(
            where,
            None,
            f"split.validation is {validation!r}, neither a fraction in [0, 1) nor a count >= 0",
            "set split.validation to a fraction such as 0.1, or a number of conversations such as 100",
        )
    return None


@dataclass
class _Kept:
    """Per distinct conversation, in order: its source, scores and token estimate."""

    source: array = field(default_factory=lambda: array("H"))
    scores: array = field(default_factory=lambda: array("Q"))
    mix: array = field(default_factory=lambda: array("Q"))
    tokens: array = field(default_factory=lambda: array("q"))


def _write_rows(
    sources: list[Source], target: Path, schema: pa.Schema, seed: int, fraction: float | None
) -> SplitSummary | tuple[SplitSummary, _Kept]:
    """The pass over the input: validate, dedupe, score, and write ``target`` in batches.

    With a fraction the rows carry their split and a SplitSummary is returned. Without
    (``fraction=None``) the split column is left out, and each row's source, scores and
    token estimate are returned too, in row order, for :func:`_add_split`.
    """
    seen: set[str] = set()
    kept = _Kept()
    files_read: dict[str, int] = {}
    per_source: list[dict] = []
    duplicates = train = validation = train_tokens = 0
    ids: list[str] = []
    splits: list[str] = []
    offsets: list[int] = [0]
    roles: list[str] = []
    contents: list[str] = []
    names: list[str] = []
    limit = fraction * 2**64 if fraction is not None else 0.0

    # a staging file is read back once, at once: written without compression or dictionaries
    options = {} if fraction is not None else {"compression": "none", "use_dictionary": False}
    with pq.ParquetWriter(target, schema, **options) as writer:

        def flush() -> None:
            arrays = [pa.array(ids, pa.string())]
            if fraction is not None:
                arrays.append(pa.array(splits, pa.string()))
            values = pa.StructArray.from_arrays(
                [pa.array(roles, pa.string()), pa.array(contents, pa.string())],
                fields=list(MESSAGE_TYPE.value_type),
            )
            arrays.append(
                pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=MESSAGE_TYPE)
            )
            arrays.append(pa.array(names, pa.string()))
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
            for column in (ids, splits, roles, contents, names):
                column.clear()
            del offsets[1:]

        for k, source in enumerate(sources):
            normalizer = Normalizer(source.format, source.fields)
            stats = {"source": source.entry, "formats": {}, "read": 0,
                     "train": 0, "validation": 0, "tokens": 0}
            per_source.append(stats)
            before = (train, validation, train_tokens)
            for file in source.files:
                read = 0
                for number, messages in read_conversations(
                    file.path, display_name=file.shown, normalizer=normalizer
                ):
                    read += 1
                    try:
                        row_id = conversation_id(messages)
                    except UnicodeEncodeError:
                        raise DataError(
                            file.shown, number,
                            "the text holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                            "which is not Unicode text",
                            "remove it, or write the character it was meant to be",
                        ) from None
                    if row_id in seen:
                        duplicates += 1
                        continue
                    seen.add(row_id)
                    scored = hash_bytes(f"{seed}:{row_id}".encode())
                    score = int(scored[:16], 16)  # as split_score
                    estimate = 0
                    for m in messages:
                        roles.append(m["role"])
                        contents.append(m["content"])
                        estimate += len(m["content"]) // 4
                    offsets.append(len(roles))
                    ids.append(row_id)
                    names.append(f"{file.name}:{number}")
                    if fraction is None:
                        kept.source.append(k)
                        kept.scores.append(score)
                        kept.mix.append(int(scored[16:32], 16))  # the mix score (mixing.py)
                        kept.tokens.append(estimate)
                    elif score < limit:  # score / 2**64 < fraction, exactly
                        splits.append("validation")
                        validation += 1
                    else:
                        splits.append("train")
                        train += 1
                        train_tokens += estimate
                    if len(ids) == BATCH_ROWS:
                        flush()
                files_read[file.shown] = files_read.get(file.shown, 0) + read
                stats["read"] += read
            stats["formats"] = normalizer.seen
            stats["train"], stats["validation"], stats["tokens"] = (
                train - before[0], validation - before[1], train_tokens - before[2])
        if ids:
            flush()

    summary = SplitSummary(
        rows=len(seen),
        train=train,
        validation=validation,
        duplicates=duplicates,
        files=files_read,
        train_tokens_estimate=train_tokens,
        sources=per_source,
    )
    if fraction is not None:
        return summary
    return summary, kept


def _check_shares(sources: list[Source], kept: _Kept, copies: array, in_validation: bytearray,
                  weights: list[float] | None) -> None:
    """A weighted source must have a conversation to train on."""
    if weights is None:
        return
    train = [0] * len(sources)
    for k, n, v in zip(kept.source, copies, in_validation):
        if n and not v:
            train[k] += n
    for k, source in enumerate(sources):
        if train[k] == 0:
            raise DataError(
                source.entry, None,
                f"weight {source.weight:g} gives this source no training example (its conversations "
                "are in validation, or its share rounds to none)",
                "raise its weight, give it more conversations, or lower split.validation",
            )


def _add_split(
    stage: Path, target: Path, copies: array, in_validation: bytearray, kept: _Kept,
    summary: SplitSummary,
) -> None:
    """Copy the staging file to ``target`` in batches, each row ``copies`` times (a row no
    source keeps is left out), adding the split column, and fill in the summary's counts."""
    position = 0
    summary.rows = summary.train = summary.validation = summary.train_tokens_estimate = 0
    for stats in summary.sources:
        stats.update(train=0, validation=0, tokens=0)
    with pq.ParquetWriter(target, SCHEMA) as writer:
        # no pre-buffering, no threads: both read ahead, holding many row groups in memory
        batches = pq.ParquetFile(stage, pre_buffer=False).iter_batches(
            batch_size=BATCH_ROWS, use_threads=False
        )
        for batch in batches:
            take: list[int] = []
            split: list[str] = []
            for i in range(batch.num_rows):
                p = position + i
                n, valid = copies[p], in_validation[p]
                if not n:
                    continue
                stats = summary.sources[kept.source[p]]
                take.extend([i] * n)
                split.extend(["validation" if valid else "train"] * n)
                if valid:
                    stats["validation"] += n
                else:
                    stats["train"] += n
                    stats["tokens"] += n * kept.tokens[p]
            position += batch.num_rows
            if not take:
                continue
            rows = batch.take(pa.array(take, pa.int32()))
            writer.write_batch(
                pa.RecordBatch.from_arrays(
                    [rows.column("id"), pa.array(split, pa.string()), rows.column("messages"), rows.column("source")],
                    schema=SCHEMA,
                )
            )
    summary.train = sum(s["train"] for s in summary.sources)
    summary.validation = sum(s["validation"] for s in summary.sources)
    summary.rows = summary.train + summary.validation
    summary.train_tokens_estimate = sum(s["tokens"] for s in summary.sources)
