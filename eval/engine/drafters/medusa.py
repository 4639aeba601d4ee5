"""Medusa drafting: every head guesses one future position from the target's last hidden state,
and a static tree (Medusa ``choices``) combines their ranked guesses.

Node ``(r1, ..., rd)`` is head d-1's rank-rd guess below node ``(r1, ..., r(d-1))``. Greedy
decoding takes each head's top-k; sampling draws each head's candidates without replacement from
its warped distribution, so the engine's recursive rejection sampling keeps the output
distributed as the target's (lossless; Medusa's typical acceptance is not offered).

Its static trees are here too: trees given as choices (paths of candidate ranks,
``[[0], [0, 0], [1], ...]``), filled from the heads' ranked candidates, and the optimal choices for
measured head accuracies (their calibration to the device, a harness job: :mod:`draftsmith.eval.medusa_calibration`).
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch
import yaml
from transformers import PreTrainedModel

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.sampling import choose
from draftsmith.eval.engine.tree import ROOT, Proposal, TokenTree
from draftsmith.heads.medusa import (
    DEFAULT_TREE_SIZE,
    MedusaHeads,
    rank_accuracy,
)
from draftsmith.target import adapter_active, attach_adapter


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


class MedusaDrafter(Drafter):
    """Medusa heads over a static tree of ``choices``.

    ``verifier``: the target this drafter must be verified by when it is not the engine's own
    (Medusa-2 heads come with a LoRA-tuned target: the base target with the adapter attached,
    switched on only while this drafter decodes).
    """

    needs_hidden = True

    def __init__(
        self,
        heads: MedusaHeads,
        choices: list[tuple[int, ...]],
        name: str = "medusa",
        verifier: PreTrainedModel | None = None,
    ):
        if not choices:
            raise UsageError("medusa: a Medusa tree needs at least one choice")
        too_deep = max(len(c) for c in choices)
        if too_deep > heads.num_heads:
            raise UsageError(
                f"medusa: the tree is {too_deep} levels deep but the checkpoint has {heads.num_heads} heads"
            )
        self.heads = heads.eval()
        self.choices = list(choices)
        self.depth = too_deep
        slots = choice_slots(self.choices)
        self.width = [max(n for prefix, n in slots.items() if len(prefix) == d) for d in range(self.depth)]
        self.name, self.verifier = name, verifier
        self._last: torch.Tensor | None = None

    def verifying(self):
        return adapter_active(self.verifier) if self.verifier is not None else super().verifying()

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self._last = hidden[-1]

    def accept(self, result: StepResult) -> None:
        self._last = result.hidden[-1]

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        depth = min(self.depth, context.max_tokens)
        if depth < 1:
            return TokenTree()
        dtype = next(self.heads.parameters()).dtype
        logits = self.heads.logits(self._last.to(dtype)[None])[:depth, 0]  # [depth, V]
        candidates, probs = [], []
        for d in range(depth):
            tokens, q = choose(logits[d : d + 1], self.width[d], context.sampling, context.generator)
            candidates.append(tokens[0].tolist())
            probs.append(q[0] if q is not None else None)
        return static_tree(self.choices, candidates, None if context.sampling.greedy else probs)


def build(spec: DrafterSpec, target: PreTrainedModel) -> MedusaDrafter:
    """The drafter of ``medusa:PATH?...``, verified by the target with the checkpoint's LoRA adapter
    when it has one (Medusa-2)."""
    options = dict(spec.options)
    heads, choices, verifier = _parts(spec.path, target, options.pop("choices", None), options.pop("budget", None))
    drafter = MedusaDrafter(heads, choices, verifier=verifier, **options)
    if verifier is not None:
        drafter.verifier_label = f"target + LoRA adapter {spec.path}/adapter (unmerged, on for this drafter only)"
    return drafter


def _parts(path: str, target: PreTrainedModel, choices, budget):
    """Heads, tree and (for Medusa-2 checkpoints) the target with its LoRA adapter to verify with.

    The tree is ``choices`` (a file or a literal), else the optimal ``budget``-node tree for the
    heads' recorded held-out accuracies, else the checkpoint's calibrated ``tree.yaml``, else the
    optimal tree of Medusa's default size (63 nodes).
    """
    heads = MedusaHeads.from_pretrained(path, target).to(next(target.parameters()).dtype)
    adapter = Path(path) / "adapter"
    verifier = attach_adapter(target, adapter) if adapter.is_dir() else None
    if verifier is not None:
        heads.bind(verifier)
    if choices is not None:
        return heads, load_choices(str(choices)), verifier
    calibrated = Path(path) / "tree.yaml"
    if budget is None and calibrated.is_file():
        return heads, load_choices(str(calibrated)), verifier
    if not heads.head_accuracy:
        raise CheckpointError(f"{path} records no head accuracies: pass choices=FILE or run eval/calibrate_tree.py")
    return heads, optimal_choices(rank_accuracy(heads.head_accuracy), int(budget or DEFAULT_TREE_SIZE)), verifier
