"""Instruction formats: one row of a source, in any accepted format, as normalized messages.

A row (a dict: one JSON object, one Parquet/Arrow row, one CSV record) becomes
``[{"role": str, "content": str}, ...]``. The formats (``format`` of a data entry):

=================== ================================================================
openai              ``{"messages": [{"role": ..., "content": ...}, ...]}``; other keys
                    of a message (``name``, ...) are dropped
sharegpt            ``{"conversations": [{"from": ..., "value": ...}, ...]}``, as Axolotl
                    reads it
prompt_completion   ``{"prompt": ..., "completion": ..., "system": ...}`` (``system``
                    optional): ``[system], user, assistant``
alpaca              ``{"instruction": ..., "input": ..., "output": ..., "system": ...}``
                    (``input`` and ``system`` optional, an empty ``input`` is none): the
                    user turn is the instruction, then a blank line and the input
auto                each row by the keys it has (the default); a row with the keys of
                    two formats is refused as ambiguous
=================== ================================================================

Roles are ``system``, ``user``, ``assistant`` and ``tool``; the ShareGPT names ``human``
and ``gpt`` become ``user`` and ``assistant``, and a message may use either format's keys
(datasets mix them). Every content is a non-blank string, and a conversation ends with an
assistant turn.

``fields`` renames: ``{"messages": "dialog", "role": "speaker", "content": "text"}`` reads the
data's ``dialog`` as ``messages`` and a message's ``speaker``/``text`` as ``role``/``content``.
Its keys are :data:`FIELD_NAMES`.

A bad row raises :class:`BadRow`: what is wrong, and the fix; the reader turns it into a
``DataError`` with the row's ``file:line``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

__all__ = ["FORMATS", "FIELD_NAMES", "BadRow", "Normalizer", "kind_of", "a_kind", "names_of"]

FORMATS = ("auto", "openai", "sharegpt", "prompt_completion", "alpaca")
TOP_FIELDS = (
    "messages", "conversations", "prompt", "completion", "system", "instruction", "input", "output",
)
MESSAGE_FIELDS = ("role", "content", "from", "value")
FIELD_NAMES = TOP_FIELDS + MESSAGE_FIELDS

ROLES = ("system", "user", "assistant", "tool")
_ROLE_NAMES = {role: role for role in ROLES} | {"human": "user", "gpt": "assistant"}
_ROLE_FIX = "use one of those (or the ShareGPT names human/gpt)"
_SHAPES_FIX = (
    'give each row \'messages\' (OpenAI chat: [{"role": ..., "content": ...}]), '
    '\'conversations\' (ShareGPT: [{"from": ..., "value": ...}]), '
    "'prompt' and 'completion', or 'instruction' and 'output' (Alpaca); "
    "or name the columns with the data entry's fields"
)
# the keys that tell each format apart (auto), in the order they are tried
_MARKS = {
    "openai": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
}



class BadRow(Exception):
    """One row is invalid: what is wrong with it, and the fix. Becomes a DataError."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


def a_kind(value: object) -> str:
    """A JSON value's type in JSON's words, with its article: "an array", "a string", "null"."""
    kind = kind_of(value)
    return kind if kind == "null" else ("an " if kind[0] in "aeiou" else "a ") + kind


def kind_of(value: object) -> str:
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


def names_of(keys: object) -> str:
    keys = [str(k) for k in keys]
    if not keys:
        return "no keys"
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


class Normalizer:
    """Rows of one source → messages, in its ``format`` with its ``fields``.

    Calling it on a row returns the messages or raises :class:`BadRow`; ``seen`` counts the
    rows of each format (what ``auto`` detected).
    """

    def __init__(self, format: str = "auto", fields: Mapping[str, str] | None = None):
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}")
        fields = dict(fields or {})
        self.format = format
        self._seen: Counter[str] = Counter()
        self.plain_rows = 0
        self._found: set[str] = set()  # the renamed names some row had
        # the data's name of each top-level key that is renamed
        self._renames = [(fields[k], k) for k in TOP_FIELDS if k in fields and fields[k] != k]
        self._openai_keys = (fields.get("role", "role"), fields.get("content", "content"))
        self._sharegpt_keys = (fields.get("from", "from"), fields.get("value", "value"))
        self._plain = format in ("auto", "openai") and not fields
        self._parse: dict[str, Callable[[dict], list[dict]]] = {
            "openai": self._openai,
            "sharegpt": self._sharegpt,
            "prompt_completion": _prompt_completion,
            "alpaca": _alpaca,
        }

    def data_names(self) -> set[str]:
        """The top-level names this source's rows are read by (its renames applied)."""
        renamed = dict((canon, name) for name, canon in self._renames)
        return {renamed.get(k, k) for k in TOP_FIELDS}

    @property
    def seen(self) -> dict[str, int]:
        """Rows read of each format: what ``auto`` detected."""
        seen = Counter(self._seen)
        if self.plain_rows:
            seen["openai"] += self.plain_rows
        return {k: seen[k] for k in _MARKS if seen[k]}

    def unseen(self) -> list[tuple[str, str]]:
        """``(key, data name)`` of each rename no row read so far had."""
        return [(canon, name) for name, canon in self._renames if name not in self._found]

    def __call__(self, row: object) -> list[dict]:
        if row.__class__ is dict and self._plain and "messages" in row and (len(row) == 1 or not (
            "conversations" in row or "prompt" in row or "completion" in row
            or "instruction" in row or "output" in row
        )):
            # the common case (an OpenAI row, format auto or openai, nothing renamed) in as
            # few calls as can be: this runs for every row
            messages = _turns(row["messages"], "messages", ("role", "content"), ("from", "value"))
            self.plain_rows += 1  # seen["openai"], counted apart: cheaper
            if messages[-1]["role"] == "assistant":
                return messages
            return _ends_with_assistant(messages)
        return self._any(row)

    def _any(self, row: object) -> list[dict]:
        if not isinstance(row, dict):
            raise BadRow(
                f"the row is a JSON {kind_of(row)}, not an object",
                'write each conversation as an object such as {"messages": [...]}',
            )
        if self._renames:
            row = dict(row)
            for name, canon in self._renames:
                if name in row:
                    row[canon] = row.pop(name)
                    self._found.add(name)
        format = self.format if self.format != "auto" else _detect(row)
        messages = self._parse[format](row)
        self._seen[format] += 1
        return _ends_with_assistant(messages)

    def _openai(self, row: dict) -> list[dict]:
        if "messages" not in row:
            raise _missing(row, "messages", "openai")
        return _turns(row["messages"], "messages", self._openai_keys, self._sharegpt_keys)

    def _sharegpt(self, row: dict) -> list[dict]:
        if "conversations" not in row:
            raise _missing(row, "conversations", "sharegpt")
        return _turns(row["conversations"], "conversations", self._sharegpt_keys, self._openai_keys)


def _detect(row: dict) -> str:
    found = [name for name, marks in _MARKS.items() if any(m in row for m in marks)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise BadRow(f"the row has {names_of(row)}, which is none of the accepted formats", _SHAPES_FIX)
    keys = ", ".join(repr(next(m for m in _MARKS[f] if m in row)) for f in found)
    raise BadRow(
        f"the row is ambiguous: it has {keys}, the keys of {' and '.join(found)}",
        f"set the data entry's format to one of {', '.join(found)}",
    )


def _missing(row: dict, key: str, format: str) -> BadRow:
    return BadRow(
        f"the row has no {key!r} (format {format}; it has {names_of(row)})",
        "fix the row, set the data entry's format to the right one (or auto), "
        f"or name the column with fields: {{\"{key}\": ...}}",
    )


def _ends_with_assistant(messages: list[dict]) -> list[dict]:
    last = messages[-1]["role"]
    if last != "assistant":
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow(
                "the conversation has no assistant turn",
                "add the assistant reply the model should learn",
            )
        raise BadRow(
            f"the conversation ends with a {last!r} turn, not an assistant turn",
            "end each conversation with an assistant reply, or drop the turns after it",
        )
    return messages


def _turns(items: object, key: str, keys: tuple[str, str], other: tuple[str, str]) -> list[dict]:
    """A messages/conversations list, normalized. ``keys`` are the format's own role and
    content keys; ``other`` the other format's, accepted too (datasets mix them)."""
    if isinstance(items, str) and items[:1] == "[":
        items = _json_cell(items, key)  # a CSV cell holding the list as JSON
    if not isinstance(items, (list, tuple)):
        raise BadRow(
            f"{key!r} is {a_kind(items)}, not a list of messages",
            f'give {key!r} as a list such as [{{"{keys[0]}": "user", "{keys[1]}": "..."}}, ...]',
        )
    if not items:
        raise BadRow(
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


def _json_cell(text: str, key: str) -> object:
    import orjson

    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise BadRow(f"{key!r} is text that is not valid JSON ({error})", f"write {key!r} as a JSON list") from None


def _message(item: object, index: int, keys: tuple[str, str], other: tuple[str, str]) -> dict:
    """One message the fast path did not take: the other format's keys, or a BadRow."""
    if not isinstance(item, dict):
        raise BadRow(
            f"message {index} is {a_kind(item)}, not an object",
            f'write each message as {{"{keys[0]}": ..., "{keys[1]}": ...}}',
        )
    role_key, content_key = keys if keys[0] in item or other[0] not in item else other
    role = item.get(role_key)
    if role is None:
        raise BadRow(
            f"message {index} has no {role_key!r}",
            f"give each message a {role_key!r}: one of system, user, assistant, tool",
        )
    normal = _ROLE_NAMES.get(role) if isinstance(role, str) else None
    if normal is None:
        raise BadRow(f"role {role!r} is not one of system, user, assistant, tool", _ROLE_FIX)
    return {"role": normal, "content": _content(item, content_key, f"message {index}")}


def _content(item: dict, key: str, where: str) -> str:
    if key not in item:
        raise BadRow(f"{where} has no {key!r}", f"give each message its text as {key!r}")
    content = item[key]
    if not isinstance(content, str):
        raise BadRow(
            f"{where}'s {key!r} is {a_kind(content)}, not a string",
            f"give {key!r} as text (lists of content parts are not supported)",
        )
    if not content or content.isspace():
        raise BadRow(f"{where}'s {key!r} is empty", "give it text, or drop the message")
    return content


def _pair(row: dict, first: str, second: str) -> None:
    for key in (first, second):
        if key not in row:
            other = second if key == first else first
            raise BadRow(f"the row has {other!r} but no {key!r}", f"give both {first!r} and {second!r}")


def _system(row: dict) -> list[dict]:
    if row.get("system") is None:
        return []
    return [{"role": "system", "content": _content(row, "system", "the row")}]


def _prompt_completion(row: dict) -> list[dict]:
    _pair(row, "prompt", "completion")
    return [
        *_system(row),
        {"role": "user", "content": _content(row, "prompt", "the row")},
        {"role": "assistant", "content": _content(row, "completion", "the row")},
    ]


def _alpaca(row: dict) -> list[dict]:
    _pair(row, "instruction", "output")
    user = _content(row, "instruction", "the row")
    extra = row.get("input")
    if extra is not None and not (isinstance(extra, str) and not extra.strip()):
        user = f"{user}\n\n{_content(row, 'input', 'the row')}"
    return [
        *_system(row),
        {"role": "user", "content": user},
        {"role": "assistant", "content": _content(row, "output", "the row")},
    ]
