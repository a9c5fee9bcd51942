"""Mixing: which conversations of each source the examples hold, and how many times.

Every distinct conversation has two numbers drawn from one blake3 digest of
``f"{seed}:{id}"``: its *split score* (bytes 0-8, big-endian: train or validation) and its
*mix score* (bytes 8-16: its place in its source's sampling order). Both depend only on
its content and the split's seed, never on its position or on the other sources, so:

1. ``rows`` caps a source: it keeps the ``rows`` conversations with the smallest mix
   scores (a sample without replacement; raising the cap only adds conversations).
2. The split: with a fraction, a conversation is in validation when its split score is
   below it; with a count ``k``, the ``k`` smallest split scores of what the caps kept.
3. ``weight`` shares the training examples: with ``T`` the train conversations the caps
   kept, source ``i`` gets ``T * w_i / sum(w)`` examples, rounded by largest remainder
   (ties to the earlier source) so that they sum to ``T``. A source with more train
   conversations than its share gives the ones with the smallest mix scores, once each;
   one with fewer gives each ``share // t`` times and the ``share % t`` smallest mix
   scores once more: with replacement, as evenly as it can be. Validation
   conversations are not weighted: each is there once.

Without weights every train conversation is there once.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence

__all__ = ["smallest", "shares", "select"]


def smallest(scores: Sequence[int], count: int, among: Sequence[int] | None = None) -> list[int]:
    """Positions (into ``scores``) of the ``count`` smallest scores of ``among`` (default:
    all); a tie at the boundary, which needs two equal 64-bit scores, goes to the earlier."""
    positions = range(len(scores)) if among is None else among
    if count <= 0:
        return []
    if count >= len(positions):
        return list(positions)
    return sorted(heapq.nsmallest(count, positions, key=lambda p: (scores[p], p)))


def shares(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights``, by largest remainder."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    left = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def select(
    source: array,
    split_scores: array,
    mix_scores: array,
    n_sources: int,
    *,
    fraction: float | None,
    count: int | None,
    caps: Sequence[int | None],
    weights: Sequence[float] | None,
) -> tuple[array, bytearray]:
    """Per conversation (in order): how many times the examples hold it (0 when a cap
    leaves it out), and whether it is in validation."""
    n = len(source)
    members: list[list[int]] = [[] for _ in range(n_sources)]
    for position, k in enumerate(source):
        members[k].append(position)
    for k, cap in enumerate(caps):
        if cap is not None and len(members[k]) > cap:
            members[k] = smallest(mix_scores, cap, members[k])
    kept = [p for group in members for p in group]
    copies = array("I", bytes(4 * n))
    validation = bytearray(n)
    if fraction is not None:
        limit = fraction * 2**64
        for p in kept:
            if split_scores[p] < limit:  # score / 2**64 < fraction, exactly
                validation[p] = 1
    else:
        for p in smallest(split_scores, count or 0, sorted(kept)):
            validation[p] = 1
    train = [[p for p in group if not validation[p]] for group in members]
    for p in kept:
        copies[p] = 1
    if weights is not None:
        for group in train:
            for p in group:
                copies[p] = 0
        targets = shares(weights, sum(len(g) for g in train))
        for group, target in zip(train, targets):
            if not group:
                continue
            times, extra = divmod(target, len(group))
            for p in group:
                copies[p] = times
            for p in smallest(mix_scores, extra, group):
                copies[p] += 1
    return copies, validation
