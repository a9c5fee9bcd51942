"""The split step's data: conversation files in, one validated ``examples.parquet`` out.

Input files (``plan.data``), one conversation per row:

- JSON Lines, ``.jsonl`` or ``.json``: one JSON object per line, blank lines skipped. A
  ``.json`` file whose first character is ``[`` is read as one JSON array of objects, each
  reported at the line where it starts.
- Parquet, ``.parquet``: one conversation per row, in a ``messages``, ``conversations``
  or ``prompt``/``completion`` column.

Each row has one of three shapes, all normalized to ``[{"role", "content"}, ...]``:

- ``{"messages": [{"role": ..., "content": ...}, ...]}``, OpenAI's chat format; other keys
  of a message (``name``, ...) are dropped;
- ``{"conversations": [{"from": ..., "value": ...}, ...]}``, ShareGPT as Axolotl reads it;
- ``{"prompt": ..., "completion": ..., "system": ...}`` (``system`` optional), which
  becomes ``[system], user, assistant``.

Roles are ``system``, ``user``, ``assistant`` and ``tool``; the ShareGPT names ``human``
and ``gpt`` become ``user`` and ``assistant``. Every content is a non-blank string, and a
conversation ends with an assistant turn. The first bad row of a file is reported as a
:class:`~overbrainer.errors.DataError` with its ``file:line``, after the whole file has been
read, so that the message can also say how many more bad rows it holds.

Output, ``examples.parquet``: one row per distinct conversation, in order of first
appearance across the files, written in row groups of :data:`BATCH_ROWS` rows:

========== ================== ====================================================
column     type               what
========== ================== ====================================================
id         string             the first 32 hex digits of the blake3 digest of the
                              conversation's canonical JSON (see :func:`conversation_id`)
split      string             ``"train"`` or ``"validation"``
messages   MESSAGE_TYPE       ``list<struct<role: string, content: string>>``
source     string             ``"<file>:<line>"`` of the conversation's first occurrence
========== ================== ====================================================

Exact duplicates (same id) are dropped. The split depends only on each conversation's
content and the seed (:func:`split_score`), never on its position, so adding conversations
to a file does not move the others between train and validation.

The file is written to a temporary file beside it and moved into place with
``os.replace``; a failed split leaves neither.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import secrets
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from json.encoder import encode_basestring as _encode
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from overbrainer.errors import DataError
from overbrainer.hashing import hash_bytes

__all__ = [
    "MESSAGE_TYPE",
    "SCHEMA",
    "SplitSummary",
    "conversation_id",
    "read_conversations",
    "split_conversations",
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

ROLES = ("system", "user", "assistant", "tool")
_ROLE_NAMES = {role: role for role in ROLES} | {"human": "user", "gpt": "assistant"}
_OPEN = {role: f'{{"role":"{role}","content":' for role in ROLES}  # canonical JSON, up to content
_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_PARQUET_COLUMNS = ("messages", "conversations", "prompt", "completion", "system")
_SHAPES_FIX = (
    'give each row \'messages\' (OpenAI chat: [{"role": ..., "content": ...}]), '
    '\'conversations\' (ShareGPT: [{"from": ..., "value": ...}]) '
    "or 'prompt' and 'completion'"
)
_ROLE_FIX = "use one of those (or the ShareGPT names human/gpt)"
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_STAGE_SCHEMA = pa.schema([SCHEMA.field("id"), SCHEMA.field("messages"), SCHEMA.field("source")])


@dataclass
class SplitSummary:
    """What a split wrote: row counts, and where the conversations came from."""

    rows: int
    train: int
    validation: int
    duplicates: int
    files: dict[str, int]  # display name -> conversations read from it, before dedup
    train_tokens_estimate: int  # sum of len(content) // 4 over the train rows' messages

    def as_dict(self) -> dict:
        return asdict(self)


class _BadRow(Exception):
    """One row is invalid: what is wrong with it, and the fix. Becomes a DataError."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


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
    path: Path, *, display_name: str | None = None
) -> Iterator[tuple[int, list[dict]]]:
    """Yield ``(line_number, messages)`` for each conversation in a JSONL or Parquet file.

    ``line_number`` is 1-based (for Parquet, the 1-based row number); ``messages`` is the
    normalized ``[{"role": str, "content": str}, ...]``. On the first invalid row the file
    is read to its end without yielding more, and a :class:`DataError` for that row is
    raised, ending with " (and N more bad rows in this file)" when there are others. A
    missing, unreadable or empty file, or one of an unknown type, raises DataError too.
    ``display_name`` is how the file is named in errors (default ``str(path)``).
    """
    path = Path(path)
    name = str(path) if display_name is None else display_name
    first: tuple[int, _BadRow] | None = None
    more = 0
    count = 0
    for number, row in _raw_rows(path, name):
        try:
            if isinstance(row, _BadRow):
                raise row
            messages = _normalize(row)
        except _BadRow as bad:
            if first is None:
                first = (number, bad)
            else:
                more += 1
            continue
        if first is None:
            count += 1
            yield number, messages
    if first is not None:
        number, bad = first
        fix = bad.fix
        if more:
            fix += f" (and {more} more bad {'row' if more == 1 else 'rows'} in this file)"
        raise DataError(name, number, bad.what, fix)
    if count == 0:
        raise DataError(
            name,
            None,
            "the file has no conversations",
            "add conversations to it, or remove it from the plan's data",
        )


def _raw_rows(path: Path, name: str) -> Iterator[tuple[int, object]]:
    """``(line, row)`` for each non-blank row; a row that cannot be parsed is a _BadRow."""
    suffix = path.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        yield from _json_rows(path, name)
    elif suffix in _PARQUET_SUFFIXES:
        yield from _parquet_rows(path, name)
    else:
        what = f"unknown file type {suffix!r}" if suffix else "the file name has no extension"
        raise DataError(
            name,
            None,
            what,
            "give conversations as JSON Lines (.jsonl, .json) or Parquet (.parquet)",
        )


def _open_error(name: str, error: OSError) -> DataError:
    if isinstance(error, FileNotFoundError):
        return DataError(
            name,
            None,
            "no such file",
            "check the path in the plan's data (relative to the plan file)",
        )
    if isinstance(error, IsADirectoryError):
        return DataError(
            name, None, "is a folder, not a file", "name the conversation files themselves"
        )
    reason = error.strerror or str(error)
    return DataError(
        name, None, f"cannot read the file ({reason})", "check that it exists and is readable"
    )


def _json_rows(path: Path, name: str) -> Iterator[tuple[int, object]]:
    try:
        f = open(path, "rb")  # bytes: each line is decoded strictly, on its own
    except OSError as error:
        raise _open_error(name, error) from None
    with f:
        try:
            head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
            if path.suffix.lower() == ".json" and head.startswith(b"["):
                f.seek(0)
                yield from _json_array_rows(f.read(), name)
                return
            f.seek(0)
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    # orjson parses what json.loads parses, to the same values, faster; what
                    # it refuses (bad UTF-8, bad JSON, NaN, huge integers, lone surrogates)
                    # goes the way below, which parses it or says what is wrong as json does
                    yield number, orjson.loads(raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw)
                    continue
                except orjson.JSONDecodeError:
                    pass
                try:
                    text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    yield (
                        number,
                        _BadRow(
                            f"the line is not valid UTF-8 (bad byte at position {error.start + 1})",
                            "save the file as UTF-8",
                        ),
                    )
                    continue
                try:
                    yield number, json.loads(text)
                except json.JSONDecodeError as error:
                    yield (
                        number,
                        _BadRow(
                            f"invalid JSON: {error.msg} (column {error.colno})",
                            "write one JSON object per line (JSON Lines)",
                        ),
                    )
        except OSError as error:
            raise _open_error(name, error) from None


def _json_array_rows(data: bytes, name: str) -> Iterator[tuple[int, object]]:
    """The elements of a file that is one JSON array, each with the line it starts on."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            name, line, "the file is not valid UTF-8", "save the file as UTF-8"
        ) from None
    fix = "write the file as JSON Lines, one object per line, or as one valid JSON array"
    decoder = json.JSONDecoder()
    line, counted = 1, 0  # the line number of position `counted`

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    pos = _WHITESPACE.match(text, text.index("[") + 1).end()
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            try:
                row, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as error:
                raise DataError(
                    name, error.lineno, f"invalid JSON: {error.msg} (column {error.colno})", fix
                ) from None
            yield line_at(pos), row
            pos = _WHITESPACE.match(text, end).end()
            if text.startswith(",", pos):
                pos = _WHITESPACE.match(text, pos + 1).end()
            elif text.startswith("]", pos):
                pos += 1
                break
            else:
                raise DataError(
                    name,
                    line_at(pos),
                    "invalid JSON: expected ',' or ']' after an array element",
                    fix,
                )
    pos = _WHITESPACE.match(text, pos).end()
    if pos < len(text):
        raise DataError(name, line_at(pos), "invalid JSON: extra data after the array", fix)


def _parquet_rows(path: Path, name: str) -> Iterator[tuple[int, object]]:
    try:
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except OSError as error:
        if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise _open_error(name, error) from None
        raise DataError(
            name,
            None,
            f"not a readable Parquet file ({error})",
            "write it with pyarrow or pandas .to_parquet()",
        ) from None
    except pa.ArrowException as error:
        raise DataError(
            name,
            None,
            f"not a readable Parquet file ({error})",
            "write it with pyarrow or pandas .to_parquet()",
        ) from None
    columns = parquet.schema_arrow.names
    if not any(c in columns for c in ("messages", "conversations", "prompt")):
        raise DataError(
            name,
            None,
            f"the Parquet columns are {_names(columns)}, and none is messages, conversations or prompt",
            "store conversations in a 'messages' (list of role/content), 'conversations' "
            "(ShareGPT) or 'prompt' and 'completion' column",
        )
    number = 0
    try:
        for batch in parquet.iter_batches(
            batch_size=BATCH_ROWS,
            columns=[c for c in _PARQUET_COLUMNS if c in columns],
            use_threads=False,  # no read-ahead: see _add_split
        ):
            for row in batch.to_pylist():
                number += 1
                # a null cell is an absent key: a file may hold several shapes' columns
                yield number, {k: v for k, v in row.items() if v is not None}
    except (OSError, pa.ArrowException) as error:
        raise DataError(
            name, number + 1, f"cannot read this row group ({error})", "rewrite the Parquet file"
        ) from None


def _names(keys: object) -> str:
    keys = [str(k) for k in keys]
    if not keys:
        return "no keys"
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _kind(value: object) -> str:
    """A JSON value's type in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _normalize(row: object) -> list[dict]:
    """One row of any accepted shape as ``[{"role", "content"}, ...]``, or _BadRow."""
    if not isinstance(row, dict):
        raise _BadRow(
            f"the row is a JSON {_kind(row)}, not an object",
            'write each conversation as an object such as {"messages": [...]}',
        )
    if "messages" in row:
        messages = _turns(row["messages"], "messages", ("role", "content"), ("from", "value"))
    elif "conversations" in row:
        messages = _turns(
            row["conversations"], "conversations", ("from", "value"), ("role", "content")
        )
    elif "prompt" in row or "completion" in row:
        messages = _prompt_completion(row)
    else:
        raise _BadRow(
            f"the row has {_names(row)}, which is none of the accepted shapes", _SHAPES_FIX
        )

    last = messages[-1]["role"]
    if last != "assistant":
        if not any(m["role"] == "assistant" for m in messages):
            raise _BadRow(
                "the conversation has no assistant turn",
                "add the assistant reply the model should learn",
            )
        raise _BadRow(
            f"the conversation ends with a {last!r} turn, not an assistant turn",
            "end each conversation with an assistant reply, or drop the turns after it",
        )
    return messages


def _turns(items: object, key: str, keys: tuple[str, str], other: tuple[str, str]) -> list[dict]:
    """A messages/conversations list, normalized. ``keys`` are the shape's own role and
    content keys; ``other`` the other shape's, accepted too (datasets mix them)."""
    if not isinstance(items, (list, tuple)):
        raise _BadRow(
            f"{key!r} is a {_kind(items)}, not a list of messages",
            f'give {key!r} as a list such as [{{"{keys[0]}": "user", "{keys[1]}": "..."}}, ...]',
        )
    if not items:
        raise _BadRow(
            "the conversation has no messages", "give at least a user and an assistant turn"
        )
    role_key, content_key = keys
    messages = []
    for index, item in enumerate(items, 1):
        # the common case, without a function call: this loop runs for every message
        try:
            role = _ROLE_NAMES[item[role_key]]
            content = item[content_key]
            if content.__class__ is str and content and not content.isspace():
                messages.append({"role": role, "content": content})
                continue
        except (KeyError, TypeError, IndexError):
            pass
        messages.append(_message(item, index, keys, other))
    return messages


def _message(item: object, index: int, keys: tuple[str, str], other: tuple[str, str]) -> dict:
    """One message the fast path did not take: the other shape's keys, or a _BadRow."""
    if not isinstance(item, dict):
        raise _BadRow(
            f"message {index} is a {_kind(item)}, not an object",
            f'write each message as {{"{keys[0]}": ..., "{keys[1]}": ...}}',
        )
    role_key, content_key = keys if keys[0] in item or other[0] not in item else other
    role = item.get(role_key)
    if role is None:
        raise _BadRow(
            f"message {index} has no {role_key!r}",
            f"give each message a {role_key!r}: one of system, user, assistant, tool",
        )
    normal = _ROLE_NAMES.get(role) if isinstance(role, str) else None
    if normal is None:
        raise _BadRow(f"role {role!r} is not one of system, user, assistant, tool", _ROLE_FIX)
    return {"role": normal, "content": _content(item, content_key, f"message {index}")}


def _content(item: dict, key: str, where: str) -> str:
    if key not in item:
        raise _BadRow(f"{where} has no {key!r}", f"give each message its text as {key!r}")
    content = item[key]
    if not isinstance(content, str):
        raise _BadRow(
            f"{where}'s {key!r} is a {_kind(content)}, not a string",
            f"give {key!r} as text (lists of content parts are not supported)",
        )
    if not content or content.isspace():
        raise _BadRow(f"{where}'s {key!r} is empty", "give it text, or drop the message")
    return content


def _prompt_completion(row: dict) -> list[dict]:
    for key in ("prompt", "completion"):
        if key not in row:
            other = "completion" if key == "prompt" else "prompt"
            raise _BadRow(
                f"the row has {other!r} but no {key!r}", "give both 'prompt' and 'completion'"
            )
    messages = []
    if row.get("system") is not None:
        messages.append({"role": "system", "content": _content(row, "system", "the row")})
    messages.append({"role": "user", "content": _content(row, "prompt", "the row")})
    messages.append({"role": "assistant", "content": _content(row, "completion", "the row")})
    return messages


# -- splitting -----------------------------------------------------------------------


def split_conversations(
    files: list[Path],
    out: Path,
    validation: float | int,
    seed: int,
    display_names: dict[Path, str] | None = None,
    source_names: dict[Path, str] | None = None,
) -> SplitSummary:
    """Validate ``files``, drop exact duplicates, split, and write ``out`` (Parquet).

    ``validation`` is either a fraction in [0, 1), a conversation is then in validation
    when its :func:`split_score` is below it, or a count ``k >= 0``: the ``k``
    conversations with the smallest scores. Either way a conversation's split depends only
    on its content and ``seed``. With a fraction, adding conversations never moves old
    ones between train and validation. With a count, adding conversations can only move
    old ones from validation to train (a new one may take their place), never the other
    way. ``0`` (or ``0.0``) means no validation rows.

    One pass reads every file, validating it and writing the distinct conversations in
    record batches; only ids, scores and counts stay in memory. With a count the split is
    known only at the end, so that pass writes a staging file without the split column,
    which a second pass copies, adding it. Everything is written to temporary files beside
    ``out``, moved into place with ``os.replace``. On any error neither ``out`` (not even
    an older one) nor a temporary file is left.

    ``source_names`` maps a path to how the ``source`` column names it (default: as errors
    do); a name that does not depend on where the command runs keeps the file the same
    from wherever it is made.
    ``display_names`` maps a path to how errors and ``source`` name it (default
    ``str(path)``). Raises :class:`DataError` for a bad file or row, and for a
    ``split.validation`` that leaves no conversation to train on.
    """
    out = Path(out)
    display_names = display_names or {}
    names = [display_names.get(f) or display_names.get(Path(f)) or str(f) for f in files]
    where = ", ".join(names) if names else str(out)
    source_names = source_names or {}
    sources = [source_names.get(f) or source_names.get(Path(f)) or name for f, name in zip(files, names, strict=True)]
    count = _check_validation(validation, where)
    if not files:
        raise DataError(
            where,
            None,
            "no conversation files to split",
            "list at least one file in the plan's data",
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp = out.with_name(f".{out.name}.{token}.tmp")
    stage = out.with_name(f".{out.name}.{token}.stage.tmp")
    try:
        if not count:  # a fraction (or no validation at all): each row's split is known at once
            summary = _write_rows(files, names, sources, tmp, SCHEMA, seed, fraction=float(validation))
        else:
            summary, scores, tokens = _write_rows(
                files, names, sources, stage, _STAGE_SCHEMA, seed, fraction=None
            )
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
            _add_split(stage, tmp, _smallest(scores, count), tokens, summary)
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


def _write_rows(
    files: list[Path],
    names: list[str],
    source_names: list[str],
    target: Path,
    schema: pa.Schema,
    seed: int,
    fraction: float | None,
) -> SplitSummary | tuple[SplitSummary, array, array]:
    """The pass over the input: validate, dedupe, score, and write ``target`` in batches.

    With a fraction the rows carry their split and a SplitSummary is returned. Without
    (``fraction=None``, a count) the split column is left out, and each row's score and
    token estimate are returned too, in row order, for :func:`_add_split`.
    """
    seen: set[str] = set()
    scores = array("Q")
    tokens = array("q")
    files_read: dict[str, int] = {}
    duplicates = train = validation = train_tokens = 0
    ids: list[str] = []
    splits: list[str] = []
    offsets: list[int] = [0]
    roles: list[str] = []
    contents: list[str] = []
    sources: list[str] = []
    limit = fraction * 2**64 if fraction is not None else 0.0

    with pq.ParquetWriter(target, schema) as writer:

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
            arrays.append(pa.array(sources, pa.string()))
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
            for column in (ids, splits, roles, contents, sources):
                column.clear()
            del offsets[1:]

        for path, name, source in zip(files, names, source_names, strict=True):
            read = 0
            for number, messages in read_conversations(Path(path), display_name=name):
                read += 1
                try:
                    row_id = conversation_id(messages)
                except UnicodeEncodeError:
                    raise DataError(
                        name, number,
                        "the text holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                        "which is not Unicode text",
                        "remove it, or write the character it was meant to be",
                    ) from None
                if row_id in seen:
                    duplicates += 1
                    continue
                seen.add(row_id)
                score = _score_int(seed, row_id)
                estimate = 0
                for m in messages:
                    roles.append(m["role"])
                    contents.append(m["content"])
                    estimate += len(m["content"]) // 4
                offsets.append(len(roles))
                ids.append(row_id)
                sources.append(f"{source}:{number}")
                if fraction is None:
                    scores.append(score)
                    tokens.append(estimate)
                elif score < limit:  # score / 2**64 < fraction, exactly
                    splits.append("validation")
                    validation += 1
                else:
                    splits.append("train")
                    train += 1
                    train_tokens += estimate
                if len(ids) == BATCH_ROWS:
                    flush()
            files_read[name] = files_read.get(name, 0) + read
        if ids:
            flush()

    summary = SplitSummary(
        rows=len(seen),
        train=train,
        validation=validation,
        duplicates=duplicates,
        files=files_read,
        train_tokens_estimate=train_tokens,
    )
    if fraction is not None:
        return summary
    return summary, scores, tokens


def _smallest(scores: array, count: int) -> bytearray:
    """A mask of the ``count`` rows with the smallest scores (a tie at the boundary, which
    needs two equal 64-bit scores, goes to the earlier row)."""
    mask = bytearray(len(scores))
    if not count:
        return mask
    threshold = (
        heapq.nsmallest(count, scores)[-1]
        if count < len(scores) // 8
        else sorted(scores)[count - 1]
    )
    below = sum(1 for s in scores if s < threshold)
    ties = count - below  # rows at the threshold that still fit
    for position, s in enumerate(scores):
        if s < threshold:
            mask[position] = 1
        elif s == threshold and ties:
            mask[position] = 1
            ties -= 1
    return mask


def _add_split(
    stage: Path, target: Path, mask: bytearray, tokens: array, summary: SplitSummary
) -> None:
    """Copy the staging file to ``target`` in batches, adding the split column from
    ``mask``, and fill in the summary's train/validation counts."""
    position = 0
    with pq.ParquetWriter(target, SCHEMA) as writer:
        # no pre-buffering, no threads: both read ahead, holding many row groups in memory
        batches = pq.ParquetFile(stage, pre_buffer=False).iter_batches(
            batch_size=BATCH_ROWS, use_threads=False
        )
        for batch in batches:
            chunk = mask[position : position + batch.num_rows]
            split = pa.array(["validation" if v else "train" for v in chunk], pa.string())
            writer.write_batch(
                pa.RecordBatch.from_arrays(
                    [batch.column("id"), split, batch.column("messages"), batch.column("source")],
                    schema=SCHEMA,
                )
            )
            position += batch.num_rows
    summary.validation = sum(mask)
    summary.train = summary.rows - summary.validation
    summary.train_tokens_estimate = sum(t for t, v in zip(tokens, mask, strict=True) if not v)
