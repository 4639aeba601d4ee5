"""Medusa drafting: every head guesses one future position from the target's last hidden state,
and a static tree (Medusa ``choices``) combines their ranked guesses.

Node ``(r1, ..., rd)`` is head d-1's rank-rd guess below node ``(r1, ..., r(d-1))``. Greedy
decoding takes each head's top-k; sampling draws each head's candidates without replacement from
its warped distribution, so the engine's recursive rejection sampling keeps the output
distributed as the target's (lossless; Medusa's typical acceptance is not offered).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.medusa_trees import choice_slots, load_choices, optimal_choices, static_tree
from draftsmith.eval.engine.sampling import choose
from draftsmith.eval.engine.tree import TokenTree
from draftsmith.heads.medusa import DEFAULT_TREE_SIZE, MedusaHeads, rank_accuracy
from draftsmith.target import adapter_active, attach_adapter


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
