"""Medusa static trees: trees given as choices (paths of candidate ranks, ``[[0], [0, 0], [1], ...]``),
filled from the heads' ranked candidates, and the optimal choices for measured head accuracies.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch
import yaml

from draftsmith.errors import UsageError
from draftsmith.eval.engine.tree import ROOT, Proposal, TokenTree


def load_choices(source: str | list) -> list[tuple[int, ...]]:
    """Medusa-style choices (``[[0], [0, 0], [1], ...]``) from a list, a literal or a JSON/YAML file.

    Each choice is a path of candidate ranks; every prefix of a choice must itself be a choice.
    A file may also hold a mapping with a ``choices`` key (what tree calibration writes).
    """
    if isinstance(source, str):
        path = Path(source)
        if path.suffix in (".json", ".yaml", ".yml") and not path.is_file():
            raise UsageError(f"tree choices file {source} does not exist")
        # JSON is YAML, and so is the Python-literal style Medusa repos use.
        source = yaml.safe_load(path.read_text() if path.is_file() else source)
        if isinstance(source, dict) and "choices" in source:
            source = source["choices"]
        if not isinstance(source, list):
            raise UsageError(f"tree choices must be a list of lists of ranks, got {type(source).__name__}")
    choices = sorted({tuple(int(r) for r in c) for c in source}, key=lambda c: (len(c), c))
    present = set(choices)
    for choice in choices:
        if not choice or any(r < 0 for r in choice):
            raise UsageError(f"tree choice {list(choice)} must be a non-empty list of ranks >= 0")
        if len(choice) > 1 and choice[:-1] not in present:
            raise UsageError(f"tree choice {list(choice)} has no parent {list(choice[:-1])} in the choices")
    return choices


def choice_slots(choices: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """How many ranked candidates each path prefix needs: ``{prefix: max rank + 1}``."""
    need: dict[tuple[int, ...], int] = {}
    for choice in choices:
        prefix = choice[:-1]
        need[prefix] = max(need.get(prefix, 0), choice[-1] + 1)
    return need


def static_tree(
    choices: list[tuple[int, ...]], candidates: list[list[int]], probs: list[torch.Tensor | None] | None = None
) -> TokenTree:
    """A Medusa static tree: node ``(r1, ..., rd)`` holds ``candidates[d-1][rd]``.

    ``candidates[d]`` are the ranked guesses for depth d+1 (one head's), shared by every parent
    at that depth; ``probs[d]`` the distribution they were drawn from (None when greedy). Each
    parent's proposal is the first ``max rank + 1`` of them, a valid draw without replacement.
    """
    # Drop choices deeper than the heads given or ranked past the candidates drawn (prefixes share
    # their ranks, so what stays is still closed under taking parents).
    choices = [c for c in choices if len(c) <= len(candidates) and all(r < len(candidates[d]) for d, r in enumerate(c))]
    node = {(): ROOT}
    tree = TokenTree()
    for choice in sorted(choices, key=lambda c: (len(c), c)):
        node[choice] = len(tree.tokens)
        tree.tokens.append(int(candidates[len(choice) - 1][choice[-1]]))
        tree.parents.append(node[choice[:-1]])
        tree.depths.append(len(choice))
    for prefix, slots in choice_slots(choices).items():
        depth = len(prefix)
        tree.proposals[node[prefix]] = Proposal(
            [int(t) for t in candidates[depth][:slots]],
            [node.get(prefix + (r,)) for r in range(slots)],
            probs[depth] if probs else None,
        )
    return tree


def optimal_choices(rank_accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The ``budget``-node tree with the largest expected acceptance length (Medusa's construction).

    ``rank_accuracy[d][r]`` is the probability that the rank-r guess of head d is the right token.
    Taking heads as independent, node ``(r1, ..., rd)`` is accepted with probability
    ``prod rank_accuracy[i][r_i]``, and the expected acceptance length is 1 plus the sum over
    nodes. That probability never grows from a parent to its child, so the ``budget`` best nodes
    (found best-first from the root) include their ancestors and are the optimum.
    """
    heap = [(-rank_accuracy[0][r], (r,)) for r in range(len(rank_accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, choice = heapq.heappop(heap)
        chosen.append(choice)
        if len(choice) < len(rank_accuracy):
            for r, acc in enumerate(rank_accuracy[len(choice)]):
                heapq.heappush(heap, (neg * acc, choice + (r,)))
    return sorted(chosen, key=lambda c: (len(c), c))


def expected_acceptance(choices: list[tuple[int, ...]], rank_accuracy: list[list[float]]) -> float:
    """Expected tokens per step of a static tree under independent per-head rank accuracies."""
    total = 1.0
    for choice in choices:
        p = 1.0
        for depth, rank in enumerate(choice):
            p *= rank_accuracy[depth][rank]
        total += p
    return total
