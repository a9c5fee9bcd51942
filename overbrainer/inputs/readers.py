"""Reading: the rows of one data file, each with the line (or row number) it is at.

File types, by suffix:

- JSON Lines, ``.jsonl`` or ``.json``: one JSON object per line, blank lines skipped. A
  ``.json`` file whose first character is ``[`` is read as one JSON array of objects, each
  reported at the line where it starts.
- Parquet, ``.parquet``: one row per conversation; a null cell is an absent key.
- CSV, ``.csv``, and TSV, ``.tsv``: a header line of column names, then one record per
  conversation; every cell is text, an empty cell is an absent key. A record is numbered
  as pyarrow counts it, the header being 1: that is its line, unless a quoted cell above
  it spans lines. A record with more or fewer cells than the header is a bad row.
- Arrow, ``.arrow``: the Arrow IPC stream files ``datasets.save_to_disk`` writes (and the
  Hugging Face hub serves), one row per conversation.

:func:`raw_rows` yields ``(number, row)``; a row that cannot be parsed is yielded as a
:class:`~overbrainer.inputs.formats.BadRow` in its place, so that the caller can go on and
count the others. A file that cannot be read at all raises ``DataError`` at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow as pa

from ..errors import DataError
from .formats import BadRow, names_of

__all__ = ["BATCH_ROWS", "raw_rows", "open_error"]

BATCH_ROWS = 4096
_WHITESPACE = re.compile(r"[ \t\r\n]*")


def raw_rows(path: Path, name: str, names: set[str] | None = None) -> Iterator[tuple[int, object]]:
    """``(number, row)`` for each non-blank row of ``path``. ``names`` are the keys a
    columnar file is read by (the others are not read); ``name`` is how errors name it."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _json_rows(path, name)
    elif suffix == ".parquet":
        yield from _parquet_rows(path, name, names)
    elif suffix in (".csv", ".tsv"):
        yield from _csv_rows(path, name, names, "\t" if suffix == ".tsv" else ",")
    elif suffix == ".arrow":
        yield from _arrow_rows(path, name, names)
    else:
        what = f"unknown file type {suffix!r}" if suffix else "the file name has no extension"
        raise DataError(
            name,
            None,
            what,
            "give conversations as JSON Lines (.jsonl, .json), Parquet (.parquet), CSV (.csv, "
            ".tsv) or Arrow (.arrow, a datasets.save_to_disk folder)",
        )


def open_error(name: str, error: OSError) -> DataError:
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
        raise open_error(name, error) from None
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
                        BadRow(
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
                        BadRow(
                            f"invalid JSON: {error.msg} (column {error.colno})",
                            "write one JSON object per line (JSON Lines)",
                        ),
                    )
        except OSError as error:
            raise open_error(name, error) from None


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


def _columns(name: str, kind: str, columns: list[str], names: set[str] | None) -> list[str]:
    """The columns to read; DataError when none holds conversations."""
    wanted = names if names is not None else set(columns)
    chosen = [c for c in columns if c in wanted]
    if not chosen:
        raise DataError(
            name,
            None,
            f"the {kind} columns are {names_of(columns)}, and none is messages, conversations, "
            "prompt or instruction",
            "store conversations in a 'messages' (list of role/content), 'conversations' "
            "(ShareGPT), 'prompt' and 'completion', or 'instruction' and 'output' (Alpaca) "
            "column, or name the columns with the data entry's fields",
        )
    return chosen


def _unreadable(name: str, kind: str, error: Exception, fix: str) -> DataError:
    return DataError(name, None, f"not a readable {kind} file ({error})", fix)


def _parquet_rows(path: Path, name: str, names: set[str] | None) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    fix = "write it with pyarrow or pandas .to_parquet()"
    try:
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except OSError as error:
        if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise open_error(name, error) from None
        raise _unreadable(name, "Parquet", error, fix) from None
    except pa.ArrowException as error:
        raise _unreadable(name, "Parquet", error, fix) from None
    columns = _columns(name, "Parquet", parquet.schema_arrow.names, names)
    batches = parquet.iter_batches(
        batch_size=BATCH_ROWS,
        columns=columns,
        use_threads=False,  # no read-ahead: it holds many row groups in memory
    )
    yield from _batch_rows(batches, name, "rewrite the Parquet file")


def _batch_rows(batches, name: str, fix: str, first: int = 0) -> Iterator[tuple[int, dict]]:
    number = first
    try:
        for batch in batches:
            if not any(column.null_count for column in batch.columns):
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
                continue
            for row in batch.to_pylist():
                number += 1
                # a null cell is an absent key: a file may hold several formats' columns
                yield number, {k: v for k, v in row.items() if v is not None}
    except (OSError, pa.ArrowException) as error:
        raise DataError(name, number + 1, f"cannot read these rows ({error})", fix) from None


def _arrow_rows(path: Path, name: str, names: set[str] | None) -> Iterator[tuple[int, object]]:
    fix = "write it again with datasets' save_to_disk"
    try:
        source = pa.memory_map(str(path))
    except OSError as error:
        if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise open_error(name, error) from None
        raise _unreadable(name, "Arrow", error, fix) from None
    with source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowException:
            try:  # the file format (with a footer), which pyarrow and the hub write too
                reader = pa.ipc.open_file(source)
            except pa.ArrowException as error:
                raise _unreadable(name, "Arrow", error, fix) from None
        columns = _columns(name, "Arrow", reader.schema.names, names)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches = (reader.get_batch(i).select(columns) for i in range(reader.num_record_batches))
        else:
            batches = (b.select(columns) for b in reader)
        yield from _batch_rows(batches, name, fix)


def _csv_rows(path: Path, name: str, names: set[str] | None, delimiter: str) -> Iterator[tuple[int, object]]:
    import pyarrow.csv as csv

    ragged: list[tuple[int, BadRow]] = []

    def refuse(row) -> str:  # a record whose cells do not match the header: kept to report
        ragged.append((
            row.number,
            BadRow(
                f"the record has {row.actual_columns} cells, the header {row.expected_columns}",
                "give every record as many cells as the header has columns (quote cells "
                "that hold the delimiter)",
            ),
        ))
        return "skip"

    def open_csv(convert):
        try:
            return csv.open_csv(
                path,
                # one thread: row numbers are only known when records are parsed in order
                read_options=csv.ReadOptions(use_threads=False, block_size=1 << 22),
                parse_options=csv.ParseOptions(
                    delimiter=delimiter, newlines_in_values=True, invalid_row_handler=refuse
                ),
                convert_options=convert,
            )
        except OSError as error:
            if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
                raise open_error(name, error) from None
            raise _unreadable(name, "CSV", error, "save it as CSV with a header line") from None
        except pa.ArrowException as error:
            if "Empty CSV file" in str(error):
                raise DataError(name, None, "the file has no conversations",
                                "add conversations to it, or remove it from the plan's data") from None
            raise _unreadable(name, "CSV", error, "save it as CSV with a header line") from None

    header = open_csv(csv.ConvertOptions()).schema.names  # reads the first block only
    ragged.clear()
    columns = _columns(name, "CSV", header, names)
    # every cell is text, as written ("007" stays "007"): no type inference
    reader = open_csv(csv.ConvertOptions(
        column_types={c: pa.string() for c in columns}, include_columns=columns,
        strings_can_be_null=False, quoted_strings_can_be_null=False,
    ))

    number = 1  # the header
    for number, row in _batch_rows(reader, name, "save it as CSV", first=1):
        # a row number is exact until the first ragged record, which pyarrow skips; a
        # ragged record before it has the smaller number, so the first bad row is right
        yield number + len([r for r in ragged if r[0] <= number]), {
            k: v for k, v in row.items() if v != ""
        }
    yield from ragged
