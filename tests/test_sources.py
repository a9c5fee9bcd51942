"""Data as users have it: sources (CSV, save_to_disk folders, the Hugging Face cache),
formats (Alpaca, field mapping, detection), and mixing (weights, caps) in the split."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import cli

from overbrainer.errors import DataError, OverbrainerError, PlanError
from overbrainer.inputs.conversations import read_conversations, split_sources
from overbrainer.inputs.formats import Normalizer
from overbrainer.inputs.mixing import shares
from overbrainer.inputs.sources import pin_sources, resolve_sources
from overbrainer.plan import load_plan


def chat(i: int, tag: str = "") -> dict:
    return {"messages": [{"role": "user", "content": f"q{tag} {i}"}, {"role": "assistant", "content": f"a{tag} {i}"}]}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def entries(*items) -> list[dict]:
    return [{"path": i} if isinstance(i, str) else i for i in items]


def sources(tmp_path: Path, *items):
    return resolve_sources(entries(*items), tmp_path, "plan.json")


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# -- formats -------------------------------------------------------------------------


def test_alpaca_rows_become_system_user_assistant(tmp_path):
    path = jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add", "input": "2 and 2", "output": "4"},
        {"instruction": "Greet", "input": "", "output": "Ahoy", "system": "Be a pirate."},
    ])
    normalizer = Normalizer()
    assert [m for _, m in read_conversations(path, normalizer=normalizer)] == [
        [{"role": "user", "content": "Add\n\n2 and 2"}, {"role": "assistant", "content": "4"}],
        [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": "Greet"},
         {"role": "assistant", "content": "Ahoy"}],
    ]
    assert normalizer.seen == {"alpaca": 2}


def test_csv_and_tsv_rows_are_read_as_text(tmp_path):
    (tmp_path / "a.csv").write_text('instruction,input,output\nSay,,007\n"Two\nlines",x,"a, b"\n')
    (tmp_path / "a.tsv").write_text("prompt\tcompletion\nq\t12\n")
    assert [m for _, m in read_conversations(tmp_path / "a.csv")] == [
        [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "007"}],
        [{"role": "user", "content": "Two\nlines\n\nx"}, {"role": "assistant", "content": "a, b"}],
    ]
    assert [n for n, _ in read_conversations(tmp_path / "a.tsv")] == [2]


def test_a_ragged_csv_record_is_reported_at_its_line(tmp_path):
    (tmp_path / "r.csv").write_text("prompt,completion\nq,a\nq2\nq3,a3\nq4,a4,extra\n")
    with pytest.raises(DataError) as caught:
        list(read_conversations(tmp_path / "r.csv"))
    assert str(caught.value).startswith("%s:3: the record has 1 cells, the header 2" % (tmp_path / "r.csv"))
    assert str(caught.value).endswith("(and 1 more bad row in this file)")


def test_fields_rename_columns_and_message_keys(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [
        {"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "ahoy"}]},
    ])
    normalizer = Normalizer("openai", {"messages": "dialog", "role": "speaker", "content": "text"})
    assert [m for _, m in read_conversations(path, normalizer=normalizer)] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ahoy"}]
    ]


def test_a_fields_name_not_in_the_data_is_one_line(tmp_path, ):
    path = jsonl(tmp_path / "d.jsonl", [chat(1), chat(2)])
    with pytest.raises(DataError) as caught:
        list(read_conversations(path, normalizer=Normalizer("auto", {"messages": "dialog"})))
    message = str(caught.value)
    assert message.startswith(f"{path}: fields.messages names 'dialog', which is in none of its rows")
    assert "\n" not in message


def test_an_ambiguous_row_names_its_line_and_the_formats(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [chat(1), {**chat(2), "instruction": "x", "output": "y"}])
    with pytest.raises(DataError) as caught:
        list(read_conversations(path))
    assert str(caught.value) == (
        f"{path}:2: the row is ambiguous: it has 'messages', 'instruction', the keys of openai and alpaca; "
        "set the data entry's format to one of openai, alpaca"
    )
    # with the format named, the same row is read
    assert len(list(read_conversations(path, normalizer=Normalizer("openai")))) == 2


def test_a_wrong_format_names_the_row(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [chat(1)])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the row has no 'conversations' \(format sharegpt"):
        list(read_conversations(path, normalizer=Normalizer("sharegpt")))


# -- the plan ------------------------------------------------------------------------


def plan_file(tmp_path: Path, data) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "p", "base": "./m", "data": data}, indent=2))
    return path


def test_data_entries_in_the_plan(tmp_path):
    plan = load_plan(plan_file(tmp_path, ["a.jsonl", {"path": "b.csv", "format": "alpaca", "rows": 5}]))
    assert [s.path for s in plan.data] == ["a.jsonl", "b.csv"]
    assert (plan.data[1].weight, plan.data[1].format, plan.data[1].rows) == (None, "alpaca", 5)
    assert load_plan(plan_file(tmp_path, "a.jsonl")).data_files == ["a.jsonl"]


@pytest.mark.parametrize("weight", [0, -1])
def test_a_weight_of_zero_or_less_is_a_plan_error_at_its_line(tmp_path, weight):
    path = plan_file(tmp_path, [{"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": weight}])
    with pytest.raises(PlanError) as caught:
        load_plan(path)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if f'"weight": {weight}' in text)
    assert str(caught.value) == f"{path}:{line}: data.1.weight: should be greater than 0"


def test_weights_are_given_to_every_source_or_none(tmp_path):
    with pytest.raises(PlanError, match=r"data\[1\] has no weight while others have one"):
        load_plan(plan_file(tmp_path, [{"path": "a.jsonl", "weight": 1}, "b.jsonl"]))


# -- mixing --------------------------------------------------------------------------


def test_shares_sum_to_the_total_by_largest_remainder():
    assert shares([1, 1, 1], 10) == [4, 3, 3]
    assert shares([2, 1], 9) == [6, 3]
    assert sum(shares([0.3, 0.3, 0.4], 7)) == 7


def test_weights_set_each_sources_share_of_the_train_examples(tmp_path):
    jsonl(tmp_path / "a.jsonl", [chat(i, "a") for i in range(60)])
    jsonl(tmp_path / "b.jsonl", [chat(i, "b") for i in range(20)])
    out = tmp_path / "examples.parquet"
    summary = split_sources(
        sources(tmp_path, {"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 3}), out, 0.0, 7
    )
    rows = rows_of(out)
    by_source = Counter(r["source"].split(":")[0] for r in rows)
    # 80 train conversations: a's share 20 (of its 60, once each), b's 60 (its 20, three times each)
    assert by_source == {"a.jsonl": 20, "b.jsonl": 60}
    assert [s["train"] for s in summary.sources] == [20, 60]
    assert summary.train == 80 == len(rows)
    b_copies = Counter(r["id"] for r in rows if r["source"].startswith("b.jsonl"))
    assert set(b_copies.values()) == {3}
    # deterministic: the same bytes again; another seed samples other rows of a
    again = tmp_path / "again.parquet"
    split_sources(sources(tmp_path, {"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 3}), again, 0.0, 7)
    assert rows_of(again) == rows
    split_sources(sources(tmp_path, {"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 3}), again, 0.0, 8)
    assert {r["id"] for r in rows_of(again)} != {r["id"] for r in rows}


def test_a_weight_that_asks_more_than_a_source_has_repeats_it_evenly(tmp_path):
    jsonl(tmp_path / "a.jsonl", [chat(i, "a") for i in range(10)])
    jsonl(tmp_path / "b.jsonl", [chat(i, "b") for i in range(4)])
    out = tmp_path / "examples.parquet"
    split_sources(sources(tmp_path, {"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 1}), out, 0.0, 0)
    b = Counter(r["id"] for r in rows_of(out) if r["source"].startswith("b.jsonl"))
    assert sum(b.values()) == 7 and sorted(b.values()) == [1, 2, 2, 2]


def test_rows_caps_a_source_with_a_sample_that_grows_with_the_cap(tmp_path):
    jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(50)])
    out = tmp_path / "examples.parquet"
    split_sources(sources(tmp_path, {"path": "a.jsonl", "rows": 10}), out, 0.0, 0)
    ten = {r["id"] for r in rows_of(out)}
    split_sources(sources(tmp_path, {"path": "a.jsonl", "rows": 20}), out, 0.0, 0)
    twenty = {r["id"] for r in rows_of(out)}
    assert len(ten) == 10 and len(twenty) == 20 and ten < twenty
    # a sample, not the first rows
    assert {r["source"] for r in rows_of(out)} != {f"a.jsonl:{i}" for i in range(1, 21)}


def test_adding_a_source_moves_no_conversation_between_train_and_validation(tmp_path):
    jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(200)])
    jsonl(tmp_path / "b.jsonl", [chat(i, "b") for i in range(100)])
    out = tmp_path / "examples.parquet"
    split_sources(sources(tmp_path, "a.jsonl"), out, 0.2, 3)
    before = {r["id"]: r["split"] for r in rows_of(out)}
    split_sources(sources(tmp_path, {"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": 1}), out, 0.2, 3)
    after = {r["id"]: r["split"] for r in rows_of(out)}
    assert all(after[i] == s for i, s in before.items() if i in after)
    assert {i for i, s in before.items() if s == "validation"} <= set(after)  # validation is never sampled


def test_an_empty_source_is_one_line_and_nothing_is_written(tmp_path):
    jsonl(tmp_path / "a.jsonl", [chat(1)])
    (tmp_path / "empty.csv").write_text("prompt,completion\n")
    out = tmp_path / "run" / "examples.parquet"
    with pytest.raises(DataError, match="empty.csv: the file has no conversations"):
        split_sources(sources(tmp_path, "a.jsonl", "empty.csv"), out, 0.0, 0)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


# -- sources on disk -----------------------------------------------------------------


def test_a_glob_and_a_folder_are_their_data_files_sorted(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    jsonl(tmp_path / "d" / "b.jsonl", [chat(1)])
    jsonl(tmp_path / "d" / "sub" / "a.jsonl", [chat(2)])
    (tmp_path / "d" / "notes.txt").write_text("not data")
    (glob,) = sources(tmp_path, "d/*.jsonl")
    (folder,) = sources(tmp_path, "d")
    assert [f.name for f in glob.files] == ["d/b.jsonl"]
    assert [f.name for f in folder.files] == ["d/b.jsonl", "d/sub/a.jsonl"]
    with pytest.raises(OverbrainerError, match=r"plan.json: data\[0\]: 'x/\*.csv' matches no data file"):
        sources(tmp_path, "x/*.csv")


def test_save_to_disk_folders_are_read_by_split(tmp_path):
    import datasets
    rows = [{"instruction": f"i{i}", "output": f"o{i}"} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(rows[:20]), "test": datasets.Dataset.from_list(rows[20:]),
    }).save_to_disk(str(tmp_path / "dict"))
    out = tmp_path / "examples.parquet"
    summary = split_sources(sources(tmp_path, "one", {"path": "dict", "split": "test"}), out, 0.0, 0)
    assert [s["read"] for s in summary.sources] == [30, 10]
    assert [s["formats"] for s in summary.sources] == [{"alpaca": 30}, {"alpaca": 10}]
    assert rows_of(out)[0]["source"] == "one/data-00000-of-00001.arrow:1"
    with pytest.raises(OverbrainerError, match=r"has no split 'validation' \(it has train, test\); set split"):
        sources(tmp_path, {"path": "dict", "split": "validation"})


# -- the Hugging Face cache ----------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"
README = b"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.jsonl
  - split: test
    path: data/test.jsonl
- config_name: tiny
  data_files: tiny.csv
---
# a dataset
"""


def hub_cache(root: Path, repo: str = "org/pirates", commit: str = COMMIT) -> Path:
    """A dataset in the hub cache as huggingface_hub lays it out: blobs named by their
    sha256, snapshots/<commit>/ of symlinks to them, refs/main holding the commit."""
    folder = root / f"datasets--{repo.replace('/', '--')}"
    files = {
        "README.md": README,
        "data/train-00000.jsonl": "".join(json.dumps(chat(i)) + "\n" for i in range(12)).encode(),
        "data/test.jsonl": json.dumps(chat(99)).encode() + b"\n",
        "tiny.csv": b"instruction,output\nSing,Yo ho\n",
    }
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for rel, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_a_hub_dataset_in_the_cache_is_read_and_pinned_by_its_commit(tmp_path, hub):
    hub_cache(hub)
    from overbrainer.hashing import HashCache

    (train,) = sources(tmp_path, "org/pirates")
    assert (train.kind, train.revision, train.config) == ("hub", COMMIT, "default")
    assert [f.name for f in train.files] == [f"hf://datasets/org/pirates@{COMMIT}/data/train-00000.jsonl"]
    (tiny,) = sources(tmp_path, "org/pirates:tiny")
    (test,) = sources(tmp_path, {"path": f"org/pirates@{COMMIT}", "split": "test"})
    out = tmp_path / "examples.parquet"
    summary = split_sources([train, tiny, test], out, 0.0, 0)
    assert [s["read"] for s in summary.sources] == [12, 1, 1]
    assert [s["formats"] for s in summary.sources] == [{"openai": 12}, {"alpaca": 1}, {"openai": 1}]
    pins = pin_sources([train], HashCache(tmp_path / "hashes"))
    assert pins[0]["revision"] == COMMIT and pins[0]["config"] == "default" and len(pins[0]["hash"]) == 64


def test_a_hub_config_that_does_not_exist_is_one_line(tmp_path, hub):
    hub_cache(hub)
    with pytest.raises(OverbrainerError) as caught:
        sources(tmp_path, "org/pirates:huge")
    assert str(caught.value) == (
        "plan.json: data[0]: the dataset org/pirates has no config 'huge' (it has default, tiny); "
        "write org/pirates:<config> with one of those"
    )


def test_a_hub_dataset_offline_without_a_cached_copy_is_one_line_with_the_fix(tmp_path, hub):
    with pytest.raises(OverbrainerError) as caught:
        sources(tmp_path, "tatsu-lab/alpaca")
    message = str(caught.value)
    assert message.startswith("plan.json: data[0]: the dataset 'tatsu-lab/alpaca' is not in the Hugging Face cache")
    assert "`hf download tatsu-lab/alpaca --repo-type dataset`" in message and "\n" not in message


# -- through the bake ----------------------------------------------------------------


def test_a_weight_change_reruns_the_split_and_why_shows_it(tmp_path, tiny_model):
    from overbrainer.graph.driver import compile_bake, run_bake

    project = tmp_path / "project"
    project.mkdir()
    (project / "tiny").symlink_to(tiny_model)
    jsonl(project / "a.jsonl", [chat(i, "a") for i in range(30)])
    (project / "b.csv").write_text("instruction,output\n" + "".join(f"do {i},done {i}\n" for i in range(10)))
    plan = {"name": "mix", "base": "./tiny", "split": {"validation": 0.1},
            "data": [{"path": "a.jsonl", "weight": 1}, {"path": "b.csv", "weight": 1}]}
    path = project / "plan.json"
    path.write_text(json.dumps(plan))
    bake = compile_bake(path)
    for task in ("train:split", "train:resolve"):
        outcome = run_bake(bake, task)
        assert outcome.code == 0, outcome.error
    pinned = json.loads(bake.folder.plan_json.read_text())["resolved"]["data"]
    assert [p["weight"] for p in pinned] == [1, 1]

    plan["data"][1]["weight"] = 2
    path.write_text(json.dumps(plan))
    why = json.loads(cli("why", str(path), "split", "--json").stdout)["steps"][0]
    assert "data[b.csv].weight: 1.0 → 2.0" in why["why"]
    printed = cli("split", str(path))  # what a bake prints of the split, without training
    lines = [line for line in printed.stdout.splitlines() if line.startswith("split: b.csv")]
    assert lines and lines[0].startswith("split: b.csv: alpaca; ") and "(67%)" in lines[0]


# -- the chat template ---------------------------------------------------------------


def templateless(tiny_model: Path, folder: Path) -> Path:
    """The tiny model as a base model without a chat template."""
    import shutil

    shutil.copytree(tiny_model, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def split_of(tmp_path: Path, rows: list[dict]) -> Path:
    jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "examples.parquet"
    split_sources(sources(tmp_path, "chats.jsonl"), out, 0.0, 0)
    return out


def test_a_named_template_is_checked_on_every_conversation(tmp_path, tiny_model):
    from overbrainer.inputs.templates import resolve_template
    from overbrainer.steps.config import check_chat_template

    base = templateless(tiny_model, tmp_path / "base")
    examples = split_of(tmp_path, [chat(i) for i in range(5)])
    tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    with pytest.raises(OverbrainerError, match=r"^config: the base model base has no chat template; set \"chat_template\""):
        check_chat_template(examples, base, None, tokens)
    got, counts = check_chat_template(examples, base, resolve_template("chatml", tmp_path), tokens)
    assert got == tokens and list(counts) == ["chats.jsonl"] and counts["chats.jsonl"] > 0
    with pytest.raises(OverbrainerError, match=r"chat_template llama3 ends a turn with '<\|eot_id\|>', which the base"):
        check_chat_template(examples, base, resolve_template("llama3", tmp_path), tokens)


def test_a_template_that_fails_on_a_row_names_it(tmp_path, tiny_model):
    from overbrainer.inputs.templates import FAMILIES, resolve_template
    from overbrainer.steps.config import check_chat_template

    rows = [chat(i) for i in range(3)]
    rows.append({"messages": [{"role": "system", "content": "s"}, *chat(9)["messages"]]})
    examples = split_of(tmp_path, rows)
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}"
    (tmp_path / "strict.jinja").write_text(strict + FAMILIES["chatml"][0])
    template = resolve_template("strict.jinja", tmp_path)
    with pytest.raises(OverbrainerError) as caught:
        check_chat_template(examples, tiny_model, template, {"eos_token": "<|im_end|>"})
    assert str(caught.value).startswith(
        "config: the chat template (strict.jinja) fails on chats.jsonl:4 (row 4 of examples.parquet): no system turns here;"
    )


def test_a_base_without_a_template_stops_before_training_and_chatml_trains_it(tmp_path, tiny_model):
    from helpers import DEMO_DATA, TINY_PLAN

    project = tmp_path / "project"
    project.mkdir()
    templateless(tiny_model, project / "tiny")
    (project / "chats.jsonl").write_text("\n".join(DEMO_DATA.read_text().splitlines()[:20]) + "\n")
    plan = json.loads(json.dumps(TINY_PLAN))
    plan["train"]["steps"] = 2
    path = project / "plan.json"
    path.write_text(json.dumps(plan))
    proc = cli("bake", str(path), "--foreground", check=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: config: the base model tiny has no chat template; set \"chat_template\"")
    run = tmp_path / "runs" / "tiny"
    assert not (run / "checkpoints").exists()

    plan["chat_template"] = "chatml"
    path.write_text(json.dumps(plan))
    cli("bake", str(path), "--foreground")
    from overbrainer.inputs.templates import FAMILIES

    assert (run / "merged" / "chat_template.jinja").read_text() == FAMILIES["chatml"][0]
    assert (run / "baked" / "chat_template.jinja").read_text() == FAMILIES["chatml"][0]
    assert "chat_template_jinja" in (run / "config.yaml").read_text()
