"""Conversations → token ids and labels, and the deterministic order they are trained in.

Loss is taken on assistant turns only: each assistant message's content and its end-of-turn
token. The chat template is rendered once per conversation; the assistant spans are found
as character ranges by rendering the prefixes, and mapped onto tokens with the tokenizer's
offsets, so the token boundaries are those of the whole text (never of pieces glued).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


@dataclass
class Example:
    ids: list[int]
    labels: list[int]

    @property
    def loss_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


class TemplateError(Exception):
    pass


def tokenizer_settings(cfg: dict) -> dict:
    """What config.yaml sets on the base's tokenizer, as attributes: its special tokens, and
    the plan's chat template (Axolotl's ``chat_template_jinja``) when it has one. The
    trainer, the merge (so merged/ and baked/ carry it) and a checkpoint's chat all set it."""
    settings = dict(cfg.get("special_tokens") or {})
    if cfg.get("chat_template_jinja"):
        settings["chat_template"] = cfg["chat_template_jinja"]
    return settings


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(prefix) and text.startswith(upto) and len(upto) > len(prefix)):
            raise TemplateError(
                "the chat template does not render a conversation as the sum of its turns"
            )
        end = len(upto)
        if eos:
            # train the end-of-turn token, not what the template puts after it ("\n")
            at = text.rfind(eos, len(prefix), end)
            if at >= 0:
                end = at + len(eos)
        spans.append((len(prefix), end))
    return text, spans


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: its longest vocabulary
    entry (a byte-level entry has a character per byte), computed once per tokenizer."""
    known = _LONGEST.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        known = _LONGEST[id(tokenizer)] = (tokenizer, max(map(len, tokenizer.get_vocab()), default=1))
    return known[1]


_LONGEST: dict[int, tuple[object, int]] = {}


def within(tokenizer, text: str, max_len: int) -> str:
    """The start of `text` that holds its first `max_len` tokens, with a margin: no token
    stands for more than `longest_token` characters, and twice that many characters (and
    some) leave the tokens before the cut as the whole text has them. What is tokenized is
    bounded by the sequence length, not by the conversation: a 50 MB line costs what its
    first few thousand characters do."""
    limit = 2 * max_len * (longest_token(tokenizer) + 1) + 1024
    return text if len(text) <= limit else text[:limit]


def tokenize(tokenizer, messages: list[dict], max_len: int) -> Example:
    text, spans = assistant_spans(tokenizer, messages)
    text = within(tokenizer, text, max_len)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = []
    k = 0
    for token, (start, _end) in zip(ids, offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start < spans[k][1]
        labels.append(token if inside else IGNORE)
    return Example(ids[:max_len], labels[:max_len])


def load_examples(path: Path, tokenizer, max_len: int,
                  validation: Path | None = None) -> tuple[list[Example], list[Example], int]:
    """Train and validation examples, and how many were dropped because truncation to
    `max_len` left them no assistant token: from config.yaml's split files (`path` the
    train rows, `validation` the validation rows, None when there are none), or from a
    `path` with a ``split`` column (examples.parquet)."""
    import pyarrow.parquet as pq

    if "split" in pq.read_schema(path).names:
        table = pq.read_table(path, columns=["split", "messages"])
        rows = zip(table.column("split").to_pylist(), table.column("messages").to_pylist())
    else:
        parts = [("train", path)] + ([("validation", validation)] if validation is not None else [])
        rows = [(split, m) for split, p in parts for m in pq.read_table(p, columns=["messages"]).column("messages").to_pylist()]
    train, held_out, dropped = [], [], 0
    for split, messages in rows:
        example = tokenize(tokenizer, messages, max_len)
        if example.loss_tokens == 0:
            dropped += 1
            continue
        (train if split == "train" else held_out).append(example)
    return train, held_out, dropped


GROUP_STEPS = 64  # steps whose conversations are grouped by length together (group_by_length)


class Order:
    """Which examples each optimizer step trains on, from the seed and the step alone.

    Epoch e is a permutation of the train examples drawn from ``seed`` and ``e``; the
    examples are consumed in that sequence, ``per_step`` at a time, across epoch
    boundaries. Step k's examples depend on nothing but k: resuming needs no data state.

    With ``lengths`` (``group_by_length``), each epoch's permutation is cut into groups of
    ``GROUP_STEPS`` steps' worth of examples; a group is sorted by length, cut into steps,
    and its steps shuffled (again from the seed). A step then holds conversations of about
    one length, so its micro-batches carry little padding (on CPU the matmuls cost what
    their positions cost), while every epoch still trains each example once and the
    lengths still come in a random order.
    """

    def __init__(self, n: int, per_step: int, seed: int, lengths: list[int] | None = None):
        self.n, self.per_step, self.seed, self.lengths = n, per_step, seed, lengths
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
            if self.lengths is not None:
                perm = self._grouped(perm, g)
            self._perms = {epoch: perm}
        return self._perms[epoch]

    def _grouped(self, perm: list[int], g: torch.Generator) -> list[int]:
        out: list[int] = []
        size = GROUP_STEPS * self.per_step
        for start in range(0, len(perm), size):
            group = sorted(perm[start : start + size], key=lambda i: self.lengths[i])
            steps = [group[j : j + self.per_step] for j in range(0, len(group), self.per_step)]
            for j in torch.randperm(len(steps), generator=g).tolist():
                out.extend(steps[j])
        return out

    def step(self, k: int) -> list[int]:
        """Indices of the examples of step k (0-based)."""
        out = []
        for p in range(k * self.per_step, (k + 1) * self.per_step):
            out.append(self._perm(p // self.n)[p % self.n])
        return out

    def position(self, k: int) -> dict:
        p = k * self.per_step
        return {"epoch": p // self.n, "index": p % self.n}


def micro_batches(examples: list[Example], size: int) -> list[list[Example]]:
    """Split one step's examples into micro-batches of similar length (less padding).
    The step's loss is normalized by all its loss tokens, so the grouping changes no math."""
    ordered = sorted(examples, key=lambda e: -len(e.ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def collate(batch: list[Example], pad_id: int, multiple: int = 1, limit: int | None = None) -> dict[str, torch.Tensor]:
    """A micro-batch as tensors, right-padded to its longest conversation's length rounded up
    to a multiple of `multiple` (train.pad_to_multiple_of), but not past `limit`
    (sequence_len) when the longest is within it."""
    longest = max(len(e.ids) for e in batch)
    width = -(-longest // multiple) * multiple
    if limit is not None and longest <= limit:
        width = min(width, limit)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.ids)
        ids[row, :n] = torch.tensor(e.ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
