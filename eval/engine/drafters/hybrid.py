"""Hybrid drafting: one verification tree holding a lookup drafter's candidates and a learned
drafter's (``hybrid:eagle3:PATH+suffix``), as TensorRT-LLM merges a suffix automaton with EAGLE-3
and Arctic Inference picks suffix or its learned drafter per step.

Every part proposes its own tree below the same root; the trees merge into one trie (a path both
propose is one path). Nodes are ranked by their estimated probability of acceptance with their
ancestors, the learned drafter's cumulative draft probability and the lookup's frequency
estimate (SuffixDecoding's path probability; a lookup without one, such as prompt lookup, gets
its measured per-token acceptance to the power of the depth), and the best ``budget`` form the
tree: the budget goes to whichever part's nodes are likelier to be accepted, node by node.

``mode=merge`` (the default) runs every part every step. ``mode=switch`` (Arctic's per-step
choice) runs the lookup parts first and skips the learned ones in a step where the lookup's
expected accepted tokens (the sum of its nodes' estimates) reach what the learned parts have
accepted per step so far, so a confident lookup step costs no learned drafting. On MT-bench
(16 x 256, bf16, a 20-minute EAGLE-3 head) merge ran 1.83x plain and switch 1.72x (BENCHMARKS.md,
issue 34); on a CPU where the head's draft step costs more, switch may win.

Lossless: greedy verification takes any tree. For sampling, each parent keeps the candidates of
one part only (the first part in the spec that proposes there; the others' candidates and their
subtrees under that parent are dropped), so rejection sampling at every node runs over one
proposal's draws exactly as that part drew them. Every part sees every step's outcome
(``accept``), also steps it did not draft, as the engine's policies already require.
"""

from __future__ import annotations

import math

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters import build_drafter, parse_spec, split_parts
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.kinds import get

MODES = ("merge", "switch")
UNSCORED_ACCEPTANCE = 0.5  # a scoreless lookup's per-token acceptance before any is measured
_MOMENTUM = 0.9  # running means over steps


def _keyed(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Each node of ``tree`` by its token path from the root."""
    keys: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        keys.append((keys[parent] if parent != ROOT else ()) + (token,))
    return {key: node for node, key in enumerate(keys)}


def merge_trees(trees: list[TokenTree], estimates: list[list[float]], budget: int, greedy: bool) -> TokenTree:
    """One tree of the ``budget`` nodes likeliest to be accepted among ``trees``' (``estimates``:
    each tree's per-node log-probabilities of acceptance); a shared path is one node, scored by
    its best estimate. Greedy: every part's candidates below a parent; sampling: one part's (the
    first proposing there, its draw order and distribution kept, see the module docstring)."""
    keyed = [_keyed(tree) for tree in trees]
    best: dict[tuple[int, ...], float] = {}
    for index, tree_keys in zip(estimates, keyed):
        for key, node in tree_keys.items():
            best[key] = max(best.get(key, -math.inf), index[node])
    builder, node_of, done = TreeBuilder(), {(): ROOT}, set()
    for key in sorted(best, key=len):  # every parent before its children
        parent_key = key[:-1]
        if parent_key not in node_of or parent_key in done:
            continue  # dropped with its parent, or added with its siblings
        done.add(parent_key)
        tokens, probs = [], None
        for tree, tree_keys in zip(trees, keyed):
            if parent_key and parent_key not in tree_keys:
                continue
            proposal = tree.proposals.get(tree_keys[parent_key] if parent_key else ROOT)
            if proposal is None:
                continue
            if greedy:
                tokens += [t for t, n in zip(proposal.tokens, proposal.nodes) if n is not None and t not in tokens]
            else:  # one part's proposal, in its draw order (pruned draws included)
                tokens, probs = list(proposal.tokens), proposal.probs
                break
        # Scores relative to the parent, so the builder's cumulative score is the node's estimate;
        # a pruned draw (no node in its tree) ranks last and is cut by the budget below.
        base = best[parent_key] if parent_key else 0.0
        scores = [best.get(parent_key + (t,), -1e9) - base for t in tokens]
        for token, node in zip(tokens, builder.add(node_of[parent_key], tokens, scores, probs)):
            if parent_key + (token,) in best:
                node_of[parent_key + (token,)] = node
    return builder.build(min(budget, len(node_of) - 1))  # the real nodes: every pruned draw cut


class HybridDrafter(Drafter):
    """Several drafters' trees verified as one (see the module docstring)."""

    def __init__(self, parts: list[Drafter], learned: list[bool], budget: int = 16, mode: str = "merge"):
        if mode not in MODES:
            raise UsageError(f"hybrid: mode={mode} is not allowed: choose from {', '.join(MODES)}")
        hidden = [p for p in parts if p.needs_hidden]
        if len({tuple(p.feature_layers or ()) for p in hidden}) > 1:
            raise UsageError("hybrid: at most one part may read the target's features (or all the same layers)")
        if any(p.verifier is not None for p in parts):
            raise UsageError("hybrid: a part verified by its own model (Medusa-2) cannot share a tree")
        self.parts, self.learned, self.budget, self.mode = parts, learned, budget, mode
        self.needs_hidden = bool(hidden)
        self.feature_layers = hidden[0].feature_layers if hidden else None
        self.name = "hybrid"
        # Measured as it decodes: draft tokens accepted per step when the learned parts drafted, and
        # each scoreless part's per-token acceptance.
        self.learned_yield: float | None = None
        self.lookup_rate = [UNSCORED_ACCEPTANCE] * len(parts)
        self._last: list[TokenTree | None] | None = None  # the parts' trees of the pending step
        self.skipped = 0  # steps the learned parts did not draft (switch mode)

    def prepare(self, prompt: list[int], max_new_tokens: int) -> None:
        for part in self.parts:
            part.prepare(prompt, max_new_tokens)

    def begin(self, tokens: list[int], hidden) -> None:
        for part in self.parts:
            part.begin(tokens, hidden if part.needs_hidden else None)

    def _estimates(self, index: int, tree: TokenTree) -> list[float]:
        if tree.scores:
            return list(tree.scores)
        return [d * math.log(self.lookup_rate[index]) for d in tree.depths]

    def propose(self, context: DraftContext) -> TokenTree:
        trees: list[TokenTree | None] = [None] * len(self.parts)
        for i, part in enumerate(self.parts):
            if not self.learned[i]:
                trees[i] = part.propose(context)
        estimates = {i: self._estimates(i, t) for i, t in enumerate(trees) if t is not None}
        expected = sum(math.exp(s) for values in estimates.values() for s in values)
        skip = self.mode == "switch" and self.learned_yield is not None and expected >= self.learned_yield
        for i, part in enumerate(self.parts):
            if self.learned[i] and not skip:
                trees[i] = part.propose(context)
                estimates[i] = self._estimates(i, trees[i])
        self.skipped += skip
        drafted = [i for i, t in enumerate(trees) if t is not None and len(t)]
        merged = merge_trees(
            [trees[i] for i in drafted], [estimates[i] for i in drafted], self.budget, context.sampling.greedy
        )
        self._last = trees
        return merged

    def accept(self, result: StepResult) -> None:
        if self._last is not None:
            self._learn(self._last, result.accepted[:-1])
            self._last = None
        for part in self.parts:
            part.accept(result)

    def _learn(self, trees: list[TokenTree | None], accepted: list[int]) -> None:
        """Update the measured rates from one step's accepted draft tokens."""
        if any(t is not None for t, learned in zip(trees, self.learned) if learned):
            got = float(len(accepted))
            self.learned_yield = got if self.learned_yield is None else _mix(self.learned_yield, got)
        for i, tree in enumerate(trees):
            if tree is None or tree.scores or not len(tree):
                continue
            # How deep this part's tree followed the accepted path: per-token acceptance = kept / tried.
            keys, kept = _keyed(tree), 0
            while kept < len(accepted) and tuple(accepted[: kept + 1]) in keys:
                kept += 1
            tried = kept + (kept < max(tree.depths))
            self.lookup_rate[i] = min(max(_mix(self.lookup_rate[i], kept / tried), 0.01), 0.99)


def _mix(old: float, new: float) -> float:
    return _MOMENTUM * old + (1 - _MOMENTUM) * new


def build(spec: DrafterSpec, target) -> HybridDrafter:
    """The drafter of ``hybrid:SPEC+SPEC[?budget=..&mode=..]``: each part built by its own kind."""
    specs = [parse_spec(part) for part in split_parts(spec.path or "")]
    if any(s.kind == "hybrid" for s in specs):
        raise UsageError(f"--drafter {spec.name}: a hybrid part cannot itself be a hybrid")
    parts = [build_drafter(s, target) for s in specs]
    learned = [get(s.kind).has_distribution for s in specs]
    if all(learned) or not any(learned):
        learned = [i > 0 for i in range(len(parts))]  # no lookup among them: the first part runs first
    return HybridDrafter(parts, learned, **spec.options)
