"""The split step's data: reading, validating, deduplicating and splitting conversations."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import blake3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overbrainer.errors import DataError
from overbrainer.inputs import conversations as data
from overbrainer.inputs import formats, readers
from overbrainer.inputs.conversations import (
    MESSAGE_TYPE,
    SCHEMA,
    SplitSummary,
    conversation_id,
    read_conversations,
    split_conversations,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def chat(i: int) -> dict:
    """A distinct valid conversation in the OpenAI shape."""
    return {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i} " + "x" * (i % 13)},
        ]
    }


def write_lines(path: Path, lines: list) -> Path:
    """A JSONL file: dicts are dumped, str and bytes written as they are."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            if isinstance(line, str):
                line = line.encode()
            f.write(line + b"\n")
    return path


def reference_id(messages: list[dict]) -> str:
    """The id as the format specifies it, computed independently of the module."""
    text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return blake3.blake3(text.encode("utf-8")).hexdigest()[:32]


def reference_score(seed: int, row_id: str) -> float:
    digest = blake3.blake3(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "run" / "examples.parquet"


# -- errors --------------------------------------------------------------------------

GOOD = json.dumps(chat(0))

ROW_ERRORS = [
    # (name, the bad line, what the message must say)
    ("bad_json", '{"messages": [', "invalid JSON: Expecting value"),
    ("not_object", "[1, 2]", "the row is a JSON array, not an object"),
    ("string_row", '"hello"', "the row is a JSON string, not an object"),
    (
        "non_utf8",
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        "not valid UTF-8",
    ),
    (
        "unknown_role",
        '{"messages": [{"role": "bot", "content": "hi"}]}',
        "role 'bot' is not one of system, user, assistant, tool; "
        "use one of those (or the ShareGPT names human/gpt)",
    ),
    (
        "missing_role",
        '{"messages": [{"content": "hi"}, {"role": "assistant", "content": "a"}]}',
        "message 1 has no 'role'",
    ),
    (
        "missing_content",
        '{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}',
        "message 1 has no 'content'",
    ),
    (
        "content_not_string",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, '
        '{"role": "assistant", "content": "a"}]}',
        "message 1's 'content' is an array, not a string",
    ),
    (
        "content_null",
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
        "message 2's 'content' is null, not a string",
    ),
    (
        "empty_content",
        '{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]}',
        "message 1's 'content' is empty",
    ),
    (
        "blank_content",
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \\n\\t"}]}',
        "message 2's 'content' is empty",
    ),
    ("no_messages", '{"messages": []}', "the conversation has no messages"),
    ("messages_not_list", '{"messages": "hi"}', "'messages' is a string, not a list"),
    (
        "ends_with_user",
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},'
        ' {"role": "user", "content": "again?"}]}',
        "the conversation ends with a 'user' turn, not an assistant turn",
    ),
    (
        "no_assistant",
        '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}',
        "the conversation has no assistant turn",
    ),
    (
        "unknown_shape",
        '{"text": "hello", "id": 3}',
        "the row has 'text', 'id', which is none of the accepted formats; give each row 'messages'",
    ),
    (
        "sharegpt_bad_role",
        '{"conversations": [{"from": "bot", "value": "hi"}]}',
        "role 'bot' is not one of system, user, assistant, tool",
    ),
    (
        "sharegpt_missing_value",
        '{"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}',
        "message 1 has no 'value'",
    ),
    ("prompt_only", '{"prompt": "q"}', "the row has 'prompt' but no 'completion'"),
    ("prompt_not_string", '{"prompt": 3, "completion": "a"}', "'prompt' is a number"),
    ("empty_completion", '{"prompt": "q", "completion": "  "}', "'completion' is empty"),
]


@pytest.mark.parametrize(
    "bad,expected", [c[1:] for c in ROW_ERRORS], ids=[c[0] for c in ROW_ERRORS]
)
def test_a_bad_row_is_reported_at_its_line_and_nothing_is_written(tmp_path, out, bad, expected):
    # blank lines are skipped, but still counted: the bad row is on line 14
    lines = [GOOD] * 5 + [""] + [json.dumps(chat(i)) for i in range(1, 8)] + [bad, GOOD]
    source = write_lines(tmp_path / "chats.jsonl", lines)
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0, display_names={source: "data/chats.jsonl"})
    message = str(caught.value)
    assert message.startswith("data/chats.jsonl:14: "), message
    assert expected in message
    assert "\n" not in message
    assert "more bad row" not in message
    assert (caught.value.path, caught.value.line) == ("data/chats.jsonl", 14)
    assert leftovers(out.parent) == []


def test_the_unknown_role_message_is_exactly_as_documented(tmp_path, out):
    lines = [json.dumps(chat(i)) for i in range(13)] + [
        '{"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "a"}]}'
    ]
    source = write_lines(tmp_path / "chats.jsonl", lines)
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0, display_names={source: "data/chats.jsonl"})
    assert str(caught.value) == (
        "data/chats.jsonl:14: role 'bot' is not one of system, user, assistant, tool; "
        "use one of those (or the ShareGPT names human/gpt)"
    )


def test_the_first_bad_row_is_raised_with_a_count_of_the_others(tmp_path, out):
    lines = [GOOD, "{oops", GOOD, '{"messages": []}', "[]", GOOD]
    source = write_lines(tmp_path / "chats.jsonl", lines)
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0)
    message = str(caught.value)
    assert message.startswith(f"{source}:2: invalid JSON")
    assert message.endswith(" (and 2 more bad rows in this file)")
    assert leftovers(out.parent) == []

    write_lines(source, [GOOD, "{oops", "[]"])
    with pytest.raises(DataError, match=r"\(and 1 more bad row in this file\)$"):
        list(read_conversations(source))


def test_an_error_in_a_later_file_names_that_file(tmp_path, out):
    first = write_lines(tmp_path / "a.jsonl", [GOOD])
    second = write_lines(tmp_path / "b.jsonl", [json.dumps(chat(1)), '{"prompt": "q"}'])
    with pytest.raises(DataError, match=r"^data/b\.jsonl:2: the row has 'prompt' but no"):
        split_conversations(
            [first, second],
            out,
            0.1,
            0,
            display_names={first: "data/a.jsonl", second: "data/b.jsonl"},
        )
    assert leftovers(out.parent) == []


def test_a_failed_split_removes_an_older_output(tmp_path, out):
    good = write_lines(tmp_path / "good.jsonl", [json.dumps(chat(i)) for i in range(10)])
    split_conversations([good], out, 0.2, 0)
    assert out.exists()
    bad = write_lines(tmp_path / "bad.jsonl", ["nope"])
    with pytest.raises(DataError, match="bad.jsonl:1: invalid JSON"):
        split_conversations([bad], out, 0.2, 0)
    assert leftovers(out.parent) == []


def make_parquet(path: Path, table: dict) -> Path:
    pq.write_table(pa.table(table), path)
    return path


FILE_ERRORS = [
    ("missing", lambda d: d / "missing.jsonl", "no such file"),
    ("folder", lambda d: (d / "folder.jsonl").mkdir() or d / "folder.jsonl", "is a folder"),
    ("empty", lambda d: write_lines(d / "empty.jsonl", []), "the file has no conversations"),
    (
        "only_blank_lines",
        lambda d: write_lines(d / "blank.jsonl", ["", "   ", "\t"]),
        "the file has no conversations",
    ),
    (
        "unknown_extension",
        lambda d: write_lines(d / "chats.txt", [GOOD]),
        "unknown file type '.txt'; give conversations as JSON Lines (.jsonl, .json), Parquet (.parquet), CSV",
    ),
    (
        "no_extension",
        lambda d: write_lines(d / "chats", [GOOD]),
        "the file name has no extension",
    ),
    (
        "parquet_wrong_schema",
        lambda d: make_parquet(d / "x.parquet", {"text": ["a", "b"], "label": [1, 2]}),
        "the Parquet columns are 'text', 'label', and none is messages, conversations, prompt or instruction",
    ),
    (
        "parquet_corrupt",
        lambda d: write_lines(d / "x.parquet", [GOOD]),
        "not a readable Parquet file",
    ),
    (
        "parquet_no_rows",
        lambda d: (
            pq.write_table(pa.table({"messages": pa.array([], MESSAGE_TYPE)}), d / "e.parquet")
            or d / "e.parquet"
        ),
        "the file has no conversations",
    ),
]


@pytest.mark.parametrize(
    "make,expected", [c[1:] for c in FILE_ERRORS], ids=[c[0] for c in FILE_ERRORS]
)
def test_a_bad_file_is_reported_by_name_and_nothing_is_written(tmp_path, out, make, expected):
    source = make(tmp_path)
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0, display_names={source: "data/the-file"})
    assert str(caught.value).startswith(f"data/the-file: {expected}"), str(caught.value)
    assert caught.value.line is None
    assert leftovers(out.parent) == []


def test_an_unreadable_file_is_reported(tmp_path, out, monkeypatch):
    source = write_lines(tmp_path / "locked.jsonl", [GOOD])

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(readers, "open", refuse, raising=False)  # chmod 0 does not stop root
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0)
    assert str(caught.value) == (
        f"{source}: cannot read the file (Permission denied); check that it exists and is readable"
    )
    assert leftovers(out.parent) == []


def test_an_error_after_some_batches_were_written_leaves_nothing(tmp_path, out, monkeypatch):
    monkeypatch.setattr(data, "BATCH_ROWS", 2)
    for validation in (0.5, 2):
        source = write_lines(tmp_path / "chats.jsonl", [chat(i) for i in range(11)] + ["{"])
        with pytest.raises(DataError, match=r"chats\.jsonl:12: invalid JSON"):
            split_conversations([source], out, validation, 0)
        assert leftovers(out.parent) == []


def test_a_bad_parquet_row_is_reported_at_its_row_number(tmp_path, out):
    messages = [chat(i)["messages"] for i in range(5)]
    messages[2] = [{"role": "bot", "content": "x"}]
    messages[4] = []
    source = make_parquet(
        tmp_path / "chats.parquet", {"messages": pa.array(messages, MESSAGE_TYPE)}
    )
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, 0.1, 0)
    assert str(caught.value).startswith(f"{source}:3: role 'bot' is not one of")
    assert str(caught.value).endswith("(and 1 more bad row in this file)")
    assert leftovers(out.parent) == []


@pytest.mark.parametrize("validation", [10, 11, 100])
def test_a_validation_count_that_leaves_no_training_rows_is_refused(tmp_path, out, validation):
    lines = [json.dumps(chat(i)) for i in range(10)] + [json.dumps(chat(3))]  # 10 distinct
    source = write_lines(tmp_path / "chats.jsonl", lines)
    with pytest.raises(DataError) as caught:
        split_conversations([source], out, validation, 0)
    message = str(caught.value)
    assert "split.validation" in message
    assert "has only 10 distinct conversations" in message
    assert "set split.validation to at most 9" in message
    assert leftovers(out.parent) == []
    assert split_conversations([source], out, 9, 0).train == 1


def test_a_validation_fraction_that_leaves_no_training_rows_is_refused(tmp_path, out):
    rows = [chat(i) for i in range(2)]
    highest = max(reference_score(0, reference_id(r["messages"])) for r in rows)
    assert highest < 0.999999
    source = write_lines(tmp_path / "chats.jsonl", rows)
    with pytest.raises(DataError, match=r"split\.validation 0\.999999 puts all 2 conversations"):
        split_conversations([source], out, 0.999999, 0)
    assert leftovers(out.parent) == []


@pytest.mark.parametrize("validation", [-1, 1.0, 1.5, -0.1, float("nan"), True, "0.1", None])
def test_an_invalid_validation_setting_is_refused(tmp_path, out, validation):
    source = write_lines(tmp_path / "chats.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"split\.validation is .*neither a fraction in \[0, 1\)"):
        split_conversations([source], out, validation, 0)
    assert leftovers(out.parent) == []


# -- shapes --------------------------------------------------------------------------

OPENAI = {"messages": [dict(m, name="someone") for m in CHAT], "id": 7}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "What is 2+2?"},
        {"from": "gpt", "value": "4", "weight": 1},
    ]
}
PROMPT = {"system": "You are terse.", "prompt": "What is 2+2?", "completion": "4"}


def test_the_three_shapes_normalize_to_the_same_messages(tmp_path, out):
    source = write_lines(tmp_path / "mixed.jsonl", [OPENAI, SHAREGPT, PROMPT])
    read = list(read_conversations(source))
    assert read == [(1, CHAT), (2, CHAT), (3, CHAT)]

    summary = split_conversations([source], out, 0.0, 0)
    assert (summary.rows, summary.duplicates) == (1, 2)
    (row,) = rows_of(out)
    assert row["messages"] == CHAT
    assert row["id"] == reference_id(CHAT)
    assert row["source"] == f"{source}:1"


def test_shapes_without_a_system_turn_and_mixed_key_names(tmp_path):
    source = write_lines(
        tmp_path / "chats.jsonl",
        [
            {"prompt": "q", "completion": "a", "system": None},
            {"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]},
            {"messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]},
        ],
    )
    expected = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert [m for _, m in read_conversations(source)] == [expected] * 3


def test_parquet_input_in_each_shape(tmp_path, out):
    openai = make_parquet(
        tmp_path / "openai.parquet",
        {"messages": pa.array([CHAT, chat(1)["messages"]], MESSAGE_TYPE)},
    )
    sharegpt = make_parquet(
        tmp_path / "sharegpt.parquet", {"conversations": [SHAREGPT["conversations"]]}
    )
    prompt = make_parquet(
        tmp_path / "prompt.parquet",
        # nulls are absent cells: a file may hold more than one shape's columns
        {
            "prompt": ["What is 2+2?", "q"],
            "completion": ["4", "a"],
            "system": ["You are terse.", None],
        },
    )
    assert list(read_conversations(openai)) == [(1, CHAT), (2, chat(1)["messages"])]
    assert list(read_conversations(sharegpt)) == [(1, CHAT)]
    assert [m for _, m in read_conversations(prompt)] == [
        CHAT,
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    summary = split_conversations(
        [openai, sharegpt, prompt], out, 0.0, 0, display_names={sharegpt: "sg.parquet"}
    )
    assert (summary.rows, summary.duplicates) == (3, 2)
    assert summary.files == {str(openai): 2, "sg.parquet": 1, str(prompt): 2}
    assert [r["source"] for r in rows_of(out)] == [f"{openai}:1", f"{openai}:2", f"{prompt}:2"]


def test_a_json_file_may_be_json_lines_or_one_array(tmp_path):
    lines = write_lines(tmp_path / "lines.json", [chat(1), "", chat(2)])
    assert [n for n, _ in read_conversations(lines)] == [1, 3]

    array = tmp_path / "array.json"
    array.write_text(json.dumps([chat(1), chat(2), {"text": "x"}], indent=2))
    text = array.read_text().splitlines()
    starts = [i + 1 for i, line in enumerate(text) if line == "  {"]
    with pytest.raises(DataError) as caught:
        list(read_conversations(array))
    assert caught.value.line == starts[2]
    assert "none of the accepted formats" in str(caught.value)

    array.write_text(json.dumps([chat(1), chat(2)], indent=2))
    assert [n for n, _ in read_conversations(array)] == starts[:2]

    array.write_text('[\n  {"prompt": "q", "completion": "a"},\n  {"prompt": \n]')
    with pytest.raises(DataError, match=r"array\.json:4: invalid JSON: Expecting value"):
        list(read_conversations(array))


def test_a_byte_order_mark_and_windows_line_endings_are_accepted(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_bytes(
        b"\xef\xbb\xbf" + json.dumps(chat(1)).encode() + b"\r\n\r\n" + GOOD.encode() + b"\r\n"
    )
    assert list(read_conversations(source)) == [(1, chat(1)["messages"]), (3, chat(0)["messages"])]


# -- output, dedup and split ---------------------------------------------------------


def test_the_output_layout(tmp_path, out):
    first = write_lines(tmp_path / "a.jsonl", [chat(1), chat(2), chat(1)])
    second = write_lines(tmp_path / "b.jsonl", [chat(2), "", chat(3)])
    summary = split_conversations(
        [first, second], out, 0.0, 0, display_names={first: "data/a.jsonl", second: "data/b.jsonl"}
    )
    table = pq.read_table(out)
    assert table.schema == SCHEMA
    assert table.schema.field("messages").type == MESSAGE_TYPE
    rows = table.to_pylist()
    assert [r["messages"] for r in rows] == [chat(i)["messages"] for i in (1, 2, 3)]
    assert [r["id"] for r in rows] == [reference_id(chat(i)["messages"]) for i in (1, 2, 3)]
    assert [r["source"] for r in rows] == ["data/a.jsonl:1", "data/a.jsonl:2", "data/b.jsonl:3"]
    assert {r["split"] for r in rows} == {"train"}
    assert summary == SplitSummary(
        rows=3,
        train=3,
        validation=0,
        duplicates=2,
        files={"data/a.jsonl": 3, "data/b.jsonl": 2},
        train_tokens_estimate=sum(
            len(m["content"]) // 4 for i in (1, 2, 3) for m in chat(i)["messages"]
        ),
        sources=[
            {"source": "data/a.jsonl", "formats": {"openai": 3}, "read": 3, "train": 2, "validation": 0,
             "tokens": sum(len(m["content"]) // 4 for i in (1, 2) for m in chat(i)["messages"])},
            {"source": "data/b.jsonl", "formats": {"openai": 2}, "read": 2, "train": 1, "validation": 0,
             "tokens": sum(len(m["content"]) // 4 for m in chat(3)["messages"])},
        ],
    )
    assert summary.as_dict()["files"] == {"data/a.jsonl": 3, "data/b.jsonl": 2}
    assert json.loads(json.dumps(summary.as_dict()))["duplicates"] == 2
    assert leftovers(out.parent) == ["examples.parquet"]


def test_only_exact_duplicates_are_dropped(tmp_path, out):
    variants = [
        CHAT,
        CHAT[1:],  # no system turn
        [CHAT[0], CHAT[1], dict(CHAT[2], content="4 ")],  # a trailing space
        [CHAT[0], dict(CHAT[1], content="what is 2+2?"), CHAT[2]],  # case
    ]
    source = write_lines(tmp_path / "chats.jsonl", [{"messages": v} for v in variants] * 3)
    summary = split_conversations([source], out, 0.0, 0)
    assert (summary.rows, summary.duplicates) == (4, 8)
    assert [r["messages"] for r in rows_of(out)] == variants


def test_the_split_follows_the_documented_score(tmp_path, out):
    source = write_lines(tmp_path / "chats.jsonl", [chat(i) for i in range(300)])
    summary = split_conversations([source], out, 0.25, 42)
    rows = rows_of(out)
    for row in rows:
        expected = "validation" if reference_score(42, row["id"]) < 0.25 else "train"
        assert row["split"] == expected
    validation = sum(r["split"] == "validation" for r in rows)
    assert summary.validation == validation and summary.train == 300 - validation
    assert 40 < validation < 110  # about a quarter of 300
    assert summary.train_tokens_estimate == sum(
        len(m["content"]) // 4 for r in rows if r["split"] == "train" for m in r["messages"]
    )
    assert data.split_score(42, rows[0]["id"]) == reference_score(42, rows[0]["id"])


def test_the_split_is_deterministic_and_depends_on_the_seed(tmp_path):
    source = write_lines(tmp_path / "chats.jsonl", [chat(i) for i in range(200)])
    first, again, other = tmp_path / "1.parquet", tmp_path / "2.parquet", tmp_path / "3.parquet"
    for validation in (0.2, 30):
        split_conversations([source], first, validation, 7)
        split_conversations([source], again, validation, 7)
        split_conversations([source], other, validation, 8)
        assert first.read_bytes() == again.read_bytes()
        splits = [r["split"] for r in rows_of(first)]
        assert splits != [r["split"] for r in rows_of(other)]


def test_adding_rows_never_moves_old_rows_with_a_fraction(tmp_path):
    old = [chat(i) for i in range(0, 400, 2)]
    new = [chat(i) for i in range(400)]  # the old rows, with new ones between them
    before = split_conversations(
        [write_lines(tmp_path / "old.jsonl", old)], tmp_path / "old.parquet", 0.3, 1
    )
    after = split_conversations(
        [write_lines(tmp_path / "new.jsonl", new)], tmp_path / "new.parquet", 0.3, 1
    )
    old_split = {r["id"]: r["split"] for r in rows_of(tmp_path / "old.parquet")}
    new_split = {r["id"]: r["split"] for r in rows_of(tmp_path / "new.parquet")}
    assert {i: new_split[i] for i in old_split} == old_split
    assert before.validation > 0 and after.validation > before.validation


def test_a_count_takes_exactly_the_lowest_scores(tmp_path, out):
    source = write_lines(tmp_path / "chats.jsonl", [chat(i) for i in range(100)] + [chat(5)])
    summary = split_conversations([source], out, 17, 3)
    rows = rows_of(out)
    assert (summary.rows, summary.train, summary.validation) == (100, 83, 17)
    lowest = sorted(rows, key=lambda r: reference_score(3, r["id"]))[:17]
    assert {r["id"] for r in rows if r["split"] == "validation"} == {r["id"] for r in lowest}
    assert summary.train_tokens_estimate == sum(
        len(m["content"]) // 4 for r in rows if r["split"] == "train" for m in r["messages"]
    )
    assert [r["messages"] for r in rows] == [chat(i)["messages"] for i in range(100)]
    assert leftovers(out.parent) == ["examples.parquet"]  # no staging file left


def test_adding_rows_with_a_count_only_moves_validation_to_train(tmp_path):
    split_conversations(
        [write_lines(tmp_path / "old.jsonl", [chat(i) for i in range(50)])],
        tmp_path / "old.parquet",
        10,
        0,
    )
    split_conversations(
        [write_lines(tmp_path / "new.jsonl", [chat(i) for i in range(200)])],
        tmp_path / "new.parquet",
        10,
        0,
    )
    old_split = {r["id"]: r["split"] for r in rows_of(tmp_path / "old.parquet")}
    new_split = {r["id"]: r["split"] for r in rows_of(tmp_path / "new.parquet")}
    moved = {i for i in old_split if old_split[i] != new_split[i]}
    assert all(old_split[i] == "validation" and new_split[i] == "train" for i in moved)
    assert sum(s == "validation" for s in new_split.values()) == 10


@pytest.mark.parametrize("validation", [0, 0.0])
def test_zero_means_no_validation_rows(tmp_path, out, validation):
    source = write_lines(tmp_path / "chats.jsonl", [chat(i) for i in range(20)])
    summary = split_conversations([source], out, validation, 0)
    assert (summary.train, summary.validation) == (20, 0)
    assert {r["split"] for r in rows_of(out)} == {"train"}


@pytest.mark.parametrize("validation", [0.3, 9])
def test_many_batches_give_the_same_rows(tmp_path, monkeypatch, validation):
    source = write_lines(tmp_path / "chats.jsonl", [chat(i % 60) for i in range(75)])
    whole = split_conversations([source], tmp_path / "whole.parquet", validation, 5)
    monkeypatch.setattr(data, "BATCH_ROWS", 7)
    batched = split_conversations([source], tmp_path / "batched.parquet", validation, 5)
    assert batched == whole
    assert pq.ParquetFile(tmp_path / "batched.parquet").metadata.num_row_groups == 9
    assert rows_of(tmp_path / "batched.parquet") == rows_of(tmp_path / "whole.parquet")


# -- properties ----------------------------------------------------------------------

text = st.text(min_size=1, max_size=12).filter(lambda s: not s.isspace())
turn = st.tuples(
    st.sampled_from(["user", "system", "tool"]), st.sampled_from(["a", "b", " c", "ü😀"])
)


@st.composite
def conversations(draw) -> tuple[list[dict], dict]:
    """A valid conversation in a random shape: (its normalized messages, the row as written)."""
    shape = draw(st.sampled_from(["messages", "conversations", "prompt"]))
    answer = draw(st.sampled_from(["yes", "no", "ok\n"]))
    if shape == "prompt":
        prompt = draw(st.sampled_from(["q1", "q2"]))
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return messages, {"prompt": prompt, "completion": answer}
    turns = draw(st.lists(turn, max_size=2))
    messages = [{"role": r, "content": c} for r, c in turns]
    messages.append({"role": "assistant", "content": answer})
    if shape == "messages":
        return messages, {"messages": messages}
    names = {"user": "human", "assistant": "gpt"}
    return messages, {
        "conversations": [
            {"from": names.get(m["role"], m["role"]), "value": m["content"]} for m in messages
        ]
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(conversations(), min_size=1, max_size=40),
    validation=st.one_of(st.floats(0, 0.5), st.integers(0, 3)),
    seed=st.integers(0, 2**32),
)
def test_property_rows_are_the_distinct_conversations(rows, validation, seed):
    distinct: dict[tuple, list[dict]] = {}
    for messages, _ in rows:
        distinct.setdefault(tuple((m["role"], m["content"]) for m in messages), messages)
    if isinstance(validation, int) and validation >= len(distinct):
        validation = 0
    with tempfile.TemporaryDirectory() as folder:
        source = write_lines(Path(folder) / "chats.jsonl", [row for _, row in rows])
        out = Path(folder) / "examples.parquet"
        try:
            summary = split_conversations([source], out, validation, seed)
        except DataError as error:  # a fraction may, by chance, leave no train row
            assert "leaves none to train on" in str(error)
            assert not out.exists()
            return
        written = rows_of(out)
    assert summary.rows == len(distinct) == len(written)
    assert summary.train + summary.validation == summary.rows
    assert summary.duplicates == len(rows) - len(distinct)
    assert [r["messages"] for r in written] == list(distinct.values())
    assert summary.validation == sum(r["split"] == "validation" for r in written)
    if isinstance(validation, int):
        assert summary.validation == validation


@given(st.lists(st.tuples(st.sampled_from(formats.ROLES), text), min_size=1, max_size=4))
def test_property_the_id_is_blake3_of_the_canonical_json(turns):
    messages = [{"role": r, "content": c} for r, c in turns]
    assert conversation_id(messages) == reference_id(messages)


@pytest.mark.parametrize(
    "content",
    ["\x00\x08\x1f\x7f", "\u2028\u2029\ufeff", 'quotes " and \\ and /', "😀 é 中"],
    ids=["control", "separators", "escapes", "non-ascii"],
)
def test_the_id_is_the_canonical_json_whichever_encoder_writes_it(content):
    """orjson writes the id's canonical JSON, byte for byte what json.dumps writes."""
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": content[::-1]}]
    assert conversation_id(messages) == reference_id(messages)


def test_orjson_and_json_read_a_line_to_the_same_values(tmp_path):
    lines = [
        '{"messages": [{"role": "user", "content": "\\u00e9 \\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}]}',
        '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "lone"}]}',
        '{"messages": [{"role": "user", "content": "big"}, {"role": "assistant", "content": "n"}], "n": 123456789012345678901234567890}',
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\ufeff" + "\n".join(lines) + "\n")
    read = [messages for _, messages in data.read_conversations(path)]
    assert read == [json.loads(line)["messages"] for line in lines]


def test_a_lone_surrogate_is_a_clear_error(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(chat(0)) + "\n" + '{"messages": [{"role": "user", "content": "\\ud800"}, '
                    '{"role": "assistant", "content": "x"}]}\n')
    out = tmp_path / "run" / "examples.parquet"
    with pytest.raises(DataError) as e:
        split_conversations([path], out, validation=0, seed=0, display_names={path: "chats.jsonl"})
    assert str(e.value).startswith("chats.jsonl:2: the text holds a lone UTF-16 surrogate") and "\n" not in str(e.value)
    assert not out.exists() and leftovers(out.parent) == []
