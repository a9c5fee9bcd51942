"""Inputs bounded in memory: what a bake holds of a conversation is bounded by the
sequence length, not by the conversation. One 50 MB line with ``sequence_len`` 32 took
13.2 GB of RSS and minutes, because the whole text was tokenized with offsets before it
was truncated; here it is tokenized under an address-space limit, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import REPO

LIMIT = 3 << 30  # bytes of address space: torch, the tokenizer and a few copies of 50 MB of text

SCRIPT = textwrap.dedent("""
    import resource, sys, time
    from transformers import AutoTokenizer
    from overbrainer.trainers.examples import tokenize
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    line = "arr, " * 10_000_000  # 50 MB of one user message
    messages = [{"role": "user", "content": line}, {"role": "assistant", "content": "Aye."}]
    started = time.monotonic()
    short = tokenize(tokenizer, messages[:1] + [{"role": "user", "content": "x"}] + messages[1:], 32)
    long = tokenize(tokenizer, messages, 32)
    whole = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False)[:20_000],
                      add_special_tokens=False)["input_ids"][:32]
    assert long.ids == whole, "the first tokens are those of the whole text"
    assert len(long.ids) == 32 and long.loss_tokens == 0
    print(f"ok {time.monotonic() - started:.1f}s {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
""")


def test_a_50_mb_line_is_tokenized_within_a_memory_limit(tiny_model):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model), str(LIMIT)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stderr[-3000:]
