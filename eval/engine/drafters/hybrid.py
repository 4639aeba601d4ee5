"""Hybrid drafting: one verification tree holding a lookup drafter's candidates and a learned
drafter's (``hybrid:eagle3:PATH+suffix``), as TensorRT-LLM merges a suffix automaton with EAGLE-3
and Arctic Inference picks suffix or its learned drafter per step.

Every part proposes its own tree below the same root; the trees merge into one trie (a path both
propose is one path). Nodes are ranked by their estimated probability of acceptance with their
ancestors, and the best ``budget`` form the tree: the budget goes to whichever part's nodes are
likelier to be accepted, node by node. A part that scores its nodes (a learned drafter's
cumulative draft probability, SuffixDecoding's path probability) has its scores calibrated by
what this decoder measured: at each depth, the acceptance its verified nodes had over the
acceptance they claimed (a weak head's confidence overstates it several times over). A lookup
without scores, such as prompt lookup, gets its measured per-token acceptance to the power of
the depth.

Every node is priced (``nodes=priced``, the default): the tree keeps the number of best nodes
with the most expected tokens per second of the step, from the verification pass's cost per tree
size measured on the target's device (:func:`~draftsmith.eval.engine.tree_plan.pass_costs`, the
planner's table) and the seconds the parts just spent drafting. A weak part's nodes then get few
places or none, and a step whose nodes do not pay for their place in the pass decodes plainly
(``nodes=budget`` fills the budget regardless, as before pricing).

``mode=merge`` runs every part every step. ``mode=switch`` (the default; Arctic's per-step
choice) decides before the learned parts draft whether they do: the lookup parts draft first, and
the learned ones draft only where what they add is expected to pay for itself. What they add is
measured, not claimed: in each step where they drafted, the tokens accepted beyond the deepest
path the lookup's own trees held (their *gain*), and that step's pass seconds, kept per kind of
step (the lookup proposed something, or nothing: a head adds most where the lookup has no match).
A step skips them when the lookup's tree alone is expected to yield at least the tokens per second
of the lookup's tokens plus the measured gain over the measured pass and the learned parts' own
drafting seconds. The measurements carry over from one generation to the next (the head's quality
is its own, and a running mean follows a new prompt within about ten steps), so a generation does
not start by paying for the learned parts again. After ``probe`` skipped steps of one kind in a row
they draft once to measure again; each probe that does not win them back doubles that interval (at
most :data:`MAX_PROBE_INTERVAL`), so a head that never pays costs ever fewer probes. Measured on
MT-bench in fp32 (BENCHMARKS.md, issue 59): with a head of minutes switch ran 0.96x of suffix alone
where merge ran 0.89x, and with a 150-step EAGLE-3 head 1.22x against merge's 1.23x (suffix 1.17x):
it is the default.

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
from draftsmith.eval.engine.pass_cost import priced_size
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.eval.engine.tree_plan import pass_costs
from draftsmith.kinds import get
from draftsmith.timing import clock

MODES = ("merge", "switch")
NODES = ("priced", "budget")
ESTIMATES = ("measured", "claimed")
BUDGET = 16  # most tree nodes verified per step
UNSCORED_ACCEPTANCE = 0.5  # a scoreless lookup's per-token acceptance before any is measured
_MOMENTUM = 0.9  # running means over steps
# Calibration starts as if each depth had seen this many nodes accepted as often as they claimed:
# the first steps move it, one step cannot.
CALIBRATION_PRIOR = 4.0
MAX_PROBE_INTERVAL = 64  # most skipped steps of one kind between two probes of the learned parts
MATCHED, UNMATCHED = 0, 1  # kinds of step: the lookup parts proposed something, or nothing


def _keyed(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Each node of ``tree`` by its token path from the root."""
    keys: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        keys.append((keys[parent] if parent != ROOT else ()) + (token,))
    return {key: node for node, key in enumerate(keys)}


def merge_trees(
    trees: list[TokenTree],
    estimates: list[list[float]],
    budget: int,
    greedy: bool,
    costs: dict[int, float] | None = None,
    draft_seconds: float = 0.0,
) -> TokenTree:
    """One tree of the nodes likeliest to be accepted among ``trees``' (``estimates``: each tree's
    per-node log-probabilities of acceptance); a shared path is one node, scored by its best
    estimate. Greedy: every part's candidates below a parent; sampling: one part's (the first
    proposing there, its draw order and distribution kept, see the module docstring). How many:
    at most ``budget``, as many as pay for their place in the pass (:func:`priced_size` with the
    pass ``costs`` per size and the ``draft_seconds`` spent; ``costs`` None fills the budget)."""
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
        # a pruned draw (no node in its tree) ranks last and is cut below.
        base = best[parent_key] if parent_key else 0.0
        scores = [best.get(parent_key + (t,), -1e9) - base for t in tokens]
        for token, node in zip(tokens, builder.add(node_of[parent_key], tokens, scores, probs)):
            if parent_key + (token,) in best:
                node_of[parent_key + (token,)] = node
    ranked = sorted((math.exp(best[key]) for key in node_of if key), reverse=True)  # the real nodes
    size = priced_size(ranked, costs, draft_seconds, budget)
    root = builder.proposals.get(ROOT)
    if not greedy and not size and ranked and root is not None and root[2] is not None:
        # Sampled draws at the root are verified once drawn: a plain step chosen because of their
        # own scores would select on them, and rejection sampling is exact only over all draws.
        size = 1
    return builder.build(size)


class HybridDrafter(Drafter):
    """Several drafters' trees verified as one (see the module docstring). ``costs``: seconds of a
    verification pass per tree size (1 = the root alone) on the target's device, None to price every
    size alike; ``device``: where the parts draft (their draft time is taken on its clock)."""

    def __init__(
        self,
        parts: list[Drafter],
        learned: list[bool],
        budget: int = BUDGET,
        mode: str = "switch",
        probe: int = 8,
        costs: dict[int, float] | None = None,
        device=None,
        estimates: str = "measured",
    ):
        if mode not in MODES:
            raise UsageError(f"hybrid: mode={mode} is not allowed: choose from {', '.join(MODES)}")
        hidden = [p for p in parts if p.needs_hidden]
        if len({tuple(p.feature_layers or ()) for p in hidden}) > 1:
            raise UsageError("hybrid: at most one part may read the target's features (or all the same layers)")
        if estimates not in ESTIMATES:
            raise UsageError(f"hybrid: estimates={estimates} is not allowed: choose from {', '.join(ESTIMATES)}")
        if any(p.verifier is not None for p in parts):
            raise UsageError("hybrid: a part verified by its own model (Medusa-2) cannot share a tree")
        self.parts, self.learned, self.budget, self.mode, self.probe = parts, learned, budget, mode, probe
        self.costs, self.device, self.calibrated = costs, device, estimates == "measured"
        self.needs_hidden = bool(hidden)
        self.feature_layers = hidden[0].feature_layers if hidden else None
        self.name = "hybrid"
        # Measured as it decodes: each part's seconds per draft and, for scoreless parts, per-token
        # acceptance; per kind of step (MATCHED, UNMATCHED), what the learned parts' drafting added
        # and what the pass cost when they drafted, and the probing schedule of switch mode.
        self.draft_seconds = [RunningMean() for _ in parts]
        self.lookup_rate = [UNSCORED_ACCEPTANCE] * len(parts)
        self.calibration = [Calibration() for _ in parts]  # scored parts: measured / claimed acceptance per depth
        self.gain = [RunningMean(), RunningMean()]  # tokens accepted beyond the lookup's own trees
        self.learned_pass = [RunningMean(), RunningMean()]  # pass seconds of steps where the learned parts drafted
        self._interval = [probe, probe]  # skips of each kind before the next probe
        self._streak = [0, 0]  # skips of each kind in a row
        self._probing = [False, False]  # the last learned draft of each kind was a probe
        self._last: list[TokenTree | None] | None = None  # the parts' trees of the pending step
        self._verified: set[tuple[int, ...]] = set()  # the pending step's verified nodes, by token path
        self._pending_pass = 0.0  # the pending step's pass seconds
        self._kind = MATCHED  # the pending step's kind
        self.skipped = 0  # steps the learned parts did not draft (switch mode)

    def runners(self) -> list:
        return [runner for part in self.parts for runner in part.runners()]

    def prepare(self, prompt: list[int], max_new_tokens: int) -> None:
        for part in self.parts:
            part.prepare(prompt, max_new_tokens)

    def begin(self, tokens: list[int], hidden) -> None:
        for part in self.parts:
            part.begin(tokens, hidden if part.needs_hidden else None)

    def _estimates(self, index: int, tree: TokenTree) -> list[float]:
        if tree.scores:
            return self.calibration[index].apply(tree.scores, tree.depths) if self.calibrated else list(tree.scores)
        return [d * math.log(self.lookup_rate[index]) for d in tree.depths]

    def _draft(self, index: int, context: DraftContext) -> tuple[TokenTree, float]:
        """Part ``index``'s tree and the seconds it took (kept as a running mean)."""
        start = clock(self.device)
        tree = self.parts[index].propose(context)
        seconds = clock(self.device) - start
        self.draft_seconds[index].add(seconds)
        return tree, seconds

    def _pass_seconds(self, tree: TokenTree) -> float:
        return self.costs[len(tree) + 1] if self.costs else 0.0

    def _skip_learned(
        self, kind: int, trees: list[TokenTree | None], estimates: dict[int, list[float]], spent: float
    ) -> bool:
        """Switch mode: whether the lookup's tree alone is expected to yield at least the tokens per
        second of the lookup's tokens plus the learned parts' measured gain in this kind of step,
        over the measured pass and their drafting (see the module docstring; a kind of step never
        measured, or due a probe, drafts them)."""
        if self.mode != "switch":
            return False
        gain, learned_pass = self.gain[kind].value, self.learned_pass[kind].value  # added together
        if gain is None or self._streak[kind] >= self._interval[kind]:
            self._probing[kind] = gain is not None
            return False
        drafted = [i for i, t in enumerate(trees) if t is not None and len(t)]
        lookup = merge_trees(
            [trees[i] for i in drafted], [estimates[i] for i in drafted], self.budget, True, self.costs, spent
        )
        expected = 1.0 + sum(math.exp(s) for s in lookup.scores)
        if not self.costs:  # no prices: the learned parts draft wherever they add tokens
            skip = gain <= 0.0
        else:
            learned_seconds = sum(m.value or 0.0 for m, learned in zip(self.draft_seconds, self.learned) if learned)
            skip = expected / (self._pass_seconds(lookup) + spent) >= (expected + gain) / (
                learned_pass + spent + learned_seconds
            )
        if skip and self._probing[kind]:  # the probe did not win them back: probe half as often
            self._interval[kind] = min(2 * self._interval[kind], MAX_PROBE_INTERVAL)
        elif not skip:
            self._interval[kind] = self.probe
        self._probing[kind] = False
        return skip

    def propose(self, context: DraftContext) -> TokenTree:
        trees: list[TokenTree | None] = [None] * len(self.parts)
        estimates: dict[int, list[float]] = {}
        spent = 0.0
        for i in range(len(self.parts)):
            if not self.learned[i]:
                trees[i], seconds = self._draft(i, context)
                estimates[i], spent = self._estimates(i, trees[i]), spent + seconds
        self._kind = MATCHED if any(t is not None and len(t) for t in trees) else UNMATCHED
        skip = self._skip_learned(self._kind, trees, estimates, spent)
        for i in range(len(self.parts)):
            if self.learned[i] and not skip:
                trees[i], seconds = self._draft(i, context)
                estimates[i], spent = self._estimates(i, trees[i]), spent + seconds
        self.skipped += skip
        self._streak[self._kind] = self._streak[self._kind] + 1 if skip else 0
        drafted = [i for i, t in enumerate(trees) if t is not None and len(t)]
        merged = merge_trees(
            [trees[i] for i in drafted],
            [estimates[i] for i in drafted],
            self.budget,
            context.sampling.greedy,
            self.costs,
            spent,
        )
        self._last, self._pending_pass = trees, self._pass_seconds(merged)
        self._verified = set(_keyed(merged))
        return merged

    def accept(self, result: StepResult) -> None:
        if self._last is not None:
            self._learn(self._last, result.accepted)
            self._last = None
        for part in self.parts:
            part.accept(result)

    def _learn(self, trees: list[TokenTree | None], accepted: list[int]) -> None:
        """Update the measured rates from one step's tokens (accepted drafts and the bonus token)."""
        drafts = accepted[:-1]
        keyed = [_keyed(t) if t is not None else {} for t in trees]  # each part's nodes by token path
        if any(t is not None for t, learned in zip(trees, self.learned) if learned):
            # The lookup alone would have kept the deepest accepted path its own trees hold.
            lookup = set().union(*(keys for keys, learned in zip(keyed, self.learned) if not learned))
            self.gain[self._kind].add(float(len(drafts) - _followed(lookup, drafts)))
            self.learned_pass[self._kind].add(self._pending_pass)
        for i, tree in enumerate(trees):
            if tree is None or not len(tree):
                continue
            if tree.scores:
                self.calibration[i].observe(tree, keyed[i], self._verified, tuple(drafts))
                continue
            # How deep this part's tree followed the accepted path: per-token acceptance = kept / tried.
            kept = _followed(keyed[i], drafts)
            tried = kept + (kept < max(tree.depths))
            self.lookup_rate[i] = min(max(_mix(self.lookup_rate[i], kept / tried), 0.01), 0.99)


def _followed(paths, drafts: list[int]) -> int:
    """How many of the accepted ``drafts`` a tree of ``paths`` (token paths from the root) held."""
    kept = 0
    while kept < len(drafts) and tuple(drafts[: kept + 1]) in paths:
        kept += 1
    return kept


def _mix(old: float, new: float) -> float:
    return _MOMENTUM * old + (1 - _MOMENTUM) * new


class Calibration:
    """Per draft depth, the acceptance a scored part's verified nodes had against what their scores
    claimed: ``(accepted + prior) / (claimed + prior)``, across generations (it is the part's, not
    the prompt's). A node's calibrated log-estimate is its score plus the log of its depth's ratio,
    capped at certainty; the order of the part's nodes at one depth is its own."""

    def __init__(self) -> None:
        self.accepted: list[float] = []
        self.claimed: list[float] = []

    def ratio(self, depth: int) -> float:
        if depth > len(self.claimed):
            return 1.0
        prior = CALIBRATION_PRIOR
        return (self.accepted[depth - 1] + prior) / (self.claimed[depth - 1] + prior)

    def apply(self, scores: list[float], depths: list[int]) -> list[float]:
        """``scores`` (log-probabilities of acceptance with their ancestors) calibrated."""
        logs = {d: math.log(self.ratio(d)) for d in set(depths)}
        return [min(0.0, score + logs[d]) for score, d in zip(scores, depths)]

    def observe(self, tree: TokenTree, keys: dict, verified: set, drafts: tuple[int, ...]) -> None:
        """Count one step: each node of ``tree`` that was verified (its path in ``verified``)
        claimed ``exp(score)`` and was accepted if its path starts the accepted ``drafts``."""
        for key, node in keys.items():
            if key not in verified:
                continue
            depth = tree.depths[node]
            while len(self.claimed) < depth:
                self.claimed.append(0.0)
                self.accepted.append(0.0)
            self.claimed[depth - 1] += math.exp(tree.scores[node])
            self.accepted[depth - 1] += float(drafts[: len(key)] == key)


class RunningMean:
    """The mean of the values seen so far, then (from ``1 / (1 - _MOMENTUM)`` values on) a running
    mean that follows drift; None before any value. The plain mean at first keeps one early outlier
    (a first step that accepted nothing) from weighing for dozens of steps."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self.count += 1
        weight = max(1.0 / self.count, 1 - _MOMENTUM)
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x


def build(spec: DrafterSpec, target) -> HybridDrafter:
    """The drafter of ``hybrid:SPEC+SPEC[?budget=..&mode=..&nodes=..&probe=..]``: each part built by its own
    kind; its nodes priced with the pass costs measured on ``target`` (``nodes=priced``)."""
    specs = [parse_spec(part) for part in split_parts(spec.path or "")]
    if any(s.kind == spec.kind for s in specs):
        raise UsageError(f"--drafter {spec.name}: a {spec.kind} part cannot itself be a {spec.kind}")
    parts = [build_drafter(s, target) for s in specs]
    learned = [get(s.kind).has_distribution for s in specs]
    if all(learned) or not any(learned):
        learned = [i > 0 for i in range(len(parts))]  # no lookup among them: the first part runs first
    options = dict(spec.options)
    nodes = options.pop("nodes", "priced")
    if nodes not in NODES:
        raise UsageError(f"--drafter {spec.name}: nodes={nodes} is not allowed: choose from {', '.join(NODES)}")
    budget = options.get("budget", BUDGET)
    costs = pass_costs(target, max_budget=budget) if nodes == "priced" else None
    return HybridDrafter(parts, learned, costs=costs, device=next(target.parameters()).device, **options)
