"""EAGLE drafting (EAGLE-1 and EAGLE-3 heads): the head extends the target's features
autoregressively into an EAGLE-2 dynamic tree.

The head keeps its own KV cache over (token, target feature) pairs: after the prefill it reads
the prompt's pairs, after every step the accepted tokens paired with the target's features of
the tokens before them (its last hidden state for EAGLE-1, the fused ``aux_layers`` for EAGLE-3).
Tree rows (fed with the head's own outputs through ``head.feedback_input``) are discarded after
each proposal, so the cache only ever holds rows computed from real target features.
"""

from __future__ import annotations

import torch

from draftsmith.config import COUNT
from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult, load_head
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder, grow_tree
from draftsmith.eval.engine.tree_plan import plan_head_tree
from draftsmith.kinds import Option

AUTO = "auto"


class EagleDrafter(Drafter):
    """An EAGLE head (``EagleHead`` or ``Eagle3Head``) growing dynamic trees of ``depth`` levels,
    ``top_k`` wide, ``budget`` nodes."""

    needs_hidden = True

    def __init__(self, head, depth: int = 5, top_k: int = 3, budget: int = 12, name: str = "eagle"):
        self.head = head.eval()
        self.feature_layers = getattr(head, "aux_layers", None)
        self.runner = CausalLMRunner(decoder=head, lm_head=head.logits, config=head.config)
        self.depth, self.top_k, self.budget, self.name = depth, top_k, budget, name
        self._tokens: list[int] = []
        self._features: torch.Tensor | None = None

    def runners(self) -> list:
        return [self.runner]

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self.runner.reset()
        # Pair token i+1 with the target's feature of token i.
        self._tokens, self._features = list(tokens[1:]), hidden

    def accept(self, result: StepResult) -> None:
        # Appended, not replaced: steps the target decoded alone also reach the head's cache.
        self._tokens += result.accepted
        self._features = result.hidden if self._features is None else torch.cat([self._features, result.hidden])

    def _expand(self, frontier: list[int], builder: TreeBuilder) -> torch.Tensor:
        base = self.runner.pending
        parents = [builder.parents[n] for n in frontier]
        features = torch.stack([self._predicted[p] for p in parents])
        out = self.runner.forward(
            [builder.tokens[n] for n in frontier],
            [self._row[p] for p in parents],
            [builder.depths[n] - 1 for n in frontier],
            **{self.head.feedback_input: features[None]},
        )
        for i, node in enumerate(frontier):
            self._row[node], self._predicted[node] = base + i, out[i]
        return self.head.draft_logits(out).float()

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        dtype = next(self.head.parameters()).dtype
        out = self.runner.forward(self._tokens, features=self._features.to(dtype)[None])
        self._tokens, self._features = [], None
        depth = min(self.depth, context.max_tokens)
        if depth < 1:
            return TokenTree()
        self._row, self._predicted = {ROOT: ROOT}, {ROOT: out[-1]}
        # Candidates are chosen over the head's draft vocabulary and mapped to target ids (d2t).
        vocab = None if self.head.full_vocab else self.head.draft_vocab
        tree = grow_tree(
            self.head.draft_logits(out[-1]).float(),
            self._expand,
            depth,
            self.top_k,
            self.budget,
            context.sampling,
            context.generator,
            context.max_entropy,
            vocab,
            self.head.config.vocab_size,
        )
        self.runner.commit([])
        return tree


def tree_options(fallback: dict[str, int]) -> dict[str, Option]:
    """An EAGLE head's tree options: each a count, or ``auto`` (planned, :mod:`draftsmith.eval.engine.tree_plan`);
    ``fallback``: the tree of a head that records no held-out accuracy."""
    unplanned = f"depth {fallback['depth']}, top_k {fallback['top_k']}, budget {fallback['budget']}"
    return {
        "depth": Option(
            AUTO,
            "tree depth (draft steps per verification): a count, or auto: planned from the head's "
            "held-out accuracy per depth and this device's measured pass costs (a head recording none: "
            f"{unplanned})",
            COUNT,
            text=True,
        ),
        "top_k": Option(AUTO, "children expanded per node: a count, or auto (planned)", COUNT, text=True),
        "budget": Option(AUTO, "tree nodes verified per step: a count, or auto (planned)", COUNT, text=True),
    }


def build_planned(spec: DrafterSpec, target, head_class, fallback: dict[str, int]) -> EagleDrafter:
    """An EAGLE drafter of a ``head_class`` head whose ``auto`` tree options (the default) come from
    the tree planned for the head on ``target``'s device (:func:`~draftsmith.eval.engine.tree_plan.plan_head_tree`;
    ``fallback`` when the head records no held-out accuracy); counts given in the spec win over the plan."""
    head = load_head(head_class, spec, target)
    options = dict(spec.options)
    tree = {key: options.pop(key, AUTO) for key in ("depth", "top_k", "budget")}
    for key, value in tree.items():
        if isinstance(value, str) and value != AUTO:
            raise UsageError(f"--drafter {spec.kind}:{spec.path}: {key}={value} is not allowed: give a count or auto")
    label = ""
    if AUTO in tree.values():
        plan = plan_head_tree(target, head)
        if plan is None:
            planned = fallback
            label = (
                f"{spec.path} records no held-out accuracy per draft depth (trained without held-out data): "
                f"unplanned tree depth {planned['depth']}, top_k {planned['top_k']}, budget {planned['budget']}"
            )
        else:
            planned = {"depth": plan.depth, "top_k": plan.top_k, "budget": plan.budget}
            label = plan.describe()
        given = {key: value for key, value in tree.items() if value != AUTO}
        tree = {key: given.get(key, planned[key]) for key in tree}
        if "budget" not in given:  # a depth given deeper than the plan's still gets a node per level
            tree["budget"] = max(tree["budget"], tree["depth"])
        print(f"{spec.name}: {label}" + (f" (given: {given})" if given else ""))
    drafter = EagleDrafter(head, **tree, **options)
    drafter.tree_label = label
    return drafter
