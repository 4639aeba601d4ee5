"""Which served requests a round may judge on: whole conversations, never seen by a trained row.

A request log row supervises every assistant turn of its messages, and a later turn's request
carries the earlier turns: a held-out turn-3 request whose conversation's turn 1 was trained on
would be judged on a reply the challenger learnt. So traffic is split by conversation, at the level
of tokens (what both a capture store and a request log hold): two rows are of one conversation when
the prompt of one (its ids before its first supervised token: the system message, the first user
turn and the generation prompt) is a prefix of the other's ids. The relation is closed over chains
(turn 1 - turn 2 - turn 3), and identical prompts of different users fall into one conversation,
so a duplicate prompt is never judged twice nor trained on beside its judged copy.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

_WIDTH = array("i").itemsize  # bytes per token id in the digests


def judge_prompt(ids: list[int], mask: list[int]) -> list[int]:
    """The ids of a row before its last supervised span: the request as it was served, without the
    reply the judge asks both heads to draft (a log row supervises earlier turns too)."""
    start = len(mask)
    while start > 0 and not mask[start - 1]:
        start -= 1  # past the unsupervised tail, to the end of the last reply
    while start > 0 and mask[start - 1]:
        start -= 1
    return list(ids[:start])


def _first_prompt(mask: list[int]) -> int:
    return mask.index(1) if 1 in mask else len(mask)


def conversations(rows: list[tuple[list[int], list[int]]]) -> list[int]:
    """A conversation label per ``(input_ids, loss_mask)`` row (the smallest row index of its
    conversation): rows are joined when one's first prompt is a prefix of the other's ids."""
    parent = list(range(len(rows)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # Prefixes are compared by a digest of their bytes, fed incrementally: one pass over each row
    # at the distinct prompt lengths, instead of comparing every pair of rows.
    data = [array("i", ids).tobytes() for ids, _ in rows]
    lengths = [_first_prompt(mask) for _, mask in rows]
    owners: dict[tuple[int, bytes], int] = {}
    for i, n in enumerate(lengths):
        key = (n, hashlib.blake2b(data[i][: _WIDTH * n], digest_size=16).digest())
        if key in owners:
            parent[root(i)] = root(owners[key])
        else:
            owners[key] = i
    cuts = sorted(set(lengths))
    for j, blob in enumerate(data):
        digest, done = hashlib.blake2b(digest_size=16), 0
        for n in cuts:
            if _WIDTH * n > len(blob):
                break
            digest.update(blob[_WIDTH * done : _WIDTH * n])
            done = n
            owner = owners.get((n, digest.copy().digest()))
            if owner is not None:
                parent[root(j)] = root(owner)
    return [root(i) for i in range(len(rows))]


@dataclass
class TrafficSplit:
    """A round's split of the traffic (row indices into it)."""

    train: list[int]  # rows of conversations none of whose rows is judged
    judged: list[int]  # one row per held-out conversation (its newest), newest conversation first
    conversations: int  # in the traffic
    fresh: int  # conversations all of whose rows arrived after ``since``: the ones a round may judge


def split_traffic(rows: list[tuple[list[int], list[int]]], first: int, since: int, held_out: int) -> TrafficSplit:
    """Hold out the ``held_out`` most recent conversations that began at or after request number
    ``since`` (rows are requests ``first, first + 1, ...`` in arrival order; ``since``: the traffic
    the last judged round saw, whose rows a serving head may have trained on), keeping at least
    one conversation to train on; the rest train."""
    labels = conversations(rows)
    members: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    fresh = [group for group in members.values() if first + group[0] >= since]
    fresh.sort(key=lambda group: group[-1], reverse=True)
    held = fresh[: max(0, min(held_out, len(members) - 1))]
    out = {i for group in held for i in group}
    return TrafficSplit(
        [i for i in range(len(rows)) if i not in out], [group[-1] for group in held], len(members), len(fresh)
    )
