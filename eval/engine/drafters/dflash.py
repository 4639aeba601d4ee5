"""DFlash drafting: one pass over ``[last token, MASK x K]`` drafts a chain of K <= block_size - 1 tokens
(vLLM's layout: 1 + ``num_speculative_tokens`` query slots, v1/worker/gpu/spec_decode/dflash/speculator.py).

The drafter's cache holds the injected context: the keys and values of the target's fused layers
at every verified position (added as the target verifies them, through
:meth:`~draftsmith.heads.dflash.DFlashHead.add_context`). A proposal appends the pending
positions' context, runs the block (anchor = the last token, which the target has not run yet,
at the next position) attending to all of the context and to the whole block, and crops the
block's keys off again, so the cache only ever holds context rows, as z-lab's reference does.
Slots 1..depth give the draft distributions of depths 1..depth, from which the chain is chosen
(greedy, or sampled for lossless verification) all at once (:func:`~draftsmith.eval.engine.tree.grow_chain`).
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult, load_head
from draftsmith.eval.engine.pass_cost import priced_size
from draftsmith.eval.engine.tree import TokenTree, choose_packed, grow_chain, packed_chain
from draftsmith.eval.engine.tree_plan import pass_costs
from draftsmith.heads.dflash import DFlashHead
from draftsmith.timing import clock

CUTS = ("priced", "threshold", "fixed")


def survival(confidences: list[float]) -> list[float]:
    """Each depth's predicted probability of being accepted with every depth above it."""
    return [math.prod(confidences[: d + 1]) for d in range(len(confidences))]


def grow_markov_chain(
    logits: torch.Tensor,
    step,
    first: torch.Tensor,
    sampling,
    generator: torch.Generator | None = None,
    max_entropy: float | None = None,
    vocab: torch.Tensor | None = None,
    vocab_size: int | None = None,
    cut=None,
) -> TokenTree:
    """A chain drafted in one pass whose depth d + 1 distribution is ``logits[d]`` plus a bias of
    the token chosen at depth d (DSpark's Markov head): ``step(d, previous)`` returns ``(bias
    [1, V] or None, confidence [1] or None)`` for the target ids ``previous`` ``[1]`` (``first``,
    the root's token, at depth 0). The tokens are chosen one depth after another on the device and
    read back together with the confidences (one host sync); ``cut(confidences)`` (each depth's
    predicted acceptance probability) returns how many depths to keep (None: all).
    ``vocab``/``vocab_size`` and ``max_entropy`` as in :func:`~draftsmith.eval.engine.tree.grow_tree`."""
    previous, rows, spread, confidences = first.view(1), [], [], []
    for depth in range(len(logits)):
        bias, confidence = step(depth, previous)
        row = logits[depth : depth + 1] if bias is None else logits[depth : depth + 1] + bias
        packed, probs, k = choose_packed(row.float(), 1, sampling, generator, max_entropy, vocab, vocab_size)
        previous = packed[:, k].long()  # the chosen target id (exact in float64)
        rows.append(packed)
        spread.append(probs)
        if confidence is not None:
            confidences.append(confidence.float().sigmoid().view(1, 1).double())
    values = torch.cat([torch.cat(rows), torch.cat(confidences)], 1) if confidences else torch.cat(rows)
    values = values.tolist()
    keep = len(values) if cut is None or not confidences else cut([row[-1] for row in values])
    probs = torch.cat(spread) if spread[0] is not None else None
    return packed_chain(values, probs, k, max_entropy, keep)


class DFlashDrafter(Drafter):
    """A :class:`~draftsmith.heads.dflash.DFlashHead` drafting ``depth`` (<= its block's) tokens a pass.

    With a confidence head, ``cut`` decides how many of them the target verifies: ``priced`` (the
    count with the most expected tokens per second, the expected yield of n tokens being ``1 + sum``
    of the predicted acceptances' running products and its cost the target's measured pass over
    n + 1 tokens (``costs``) plus the seconds this step spent drafting:
    :func:`~draftsmith.eval.engine.pass_cost.priced_size`; vLLM's adaptive verification sizes
    DSpark's drafts from the same products and its cost tables), ``threshold`` (while the running
    product is at least ``threshold``) or ``fixed`` (all)."""

    needs_hidden = True

    def __init__(
        self,
        head,
        depth: int | None = None,
        cut: str | None = None,
        threshold: float = 0.5,
        costs: dict[int, float] | None = None,
        name: str = "dflash",
    ):
        self.head = head.eval()
        self.feature_layers = head.aux_layers
        self.depth = min(depth or head.draft_slots, head.draft_slots)
        self.name = name
        self._cache, self._length, self._features = DynamicCache(), 0, None
        cut = cut or default_cut(head)
        if cut not in CUTS:
            raise UsageError(f"{head.kind}: cut={cut} is not allowed: choose one of {', '.join(CUTS)}")
        if cut != "fixed" and head.confidence_head is None:
            raise UsageError(
                f"{head.kind}: cut={cut} needs a confidence head, and this drafter has none: use cut=fixed, or train "
                "one for it (drafter.confidence_for, docs/training.md)"
            )
        if cut == "priced" and costs is None:
            raise ValueError("cut=priced needs the target's pass costs")
        self.cut, self.threshold, self.costs = cut, threshold, costs
        if head.confidence_head is not None:
            self.tree_label = f"cut={cut}" + (f", threshold {threshold:g}" if cut == "threshold" else "")

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self._cache, self._length, self._features = DynamicCache(), 0, hidden

    def accept(self, result: StepResult) -> None:
        self._features = result.hidden if self._features is None else torch.cat([self._features, result.hidden])

    def block_hidden(self, context: DraftContext) -> torch.Tensor:
        """The hidden states ``[slots, h]`` of every slot of the block (the anchor's first; depth d's
        in row d - shift), after the pending positions' context has joined the cache."""
        param = next(self.head.parameters())
        if self._features is not None and len(self._features):
            n = len(self._features)
            positions = torch.arange(self._length, self._length + n, device=param.device)[None]
            self.head.add_context(self._cache, self._features.to(param.dtype)[None], positions)
            self._length, self._features = self._length + n, None
        # [anchor, MASK...] for the configured depth even where fewer tokens are wanted (the output's end):
        # the slots attend to each other both ways, so the block's length changes every slot's output,
        # and vLLM always runs the same slots (1 + num_speculative_tokens for DFlash, as many as drafted
        # tokens where the anchor's slot drafts too). A shorter depth than trained is therefore a
        # shorter block than training ran, measured as vLLM serves it.
        first = 1 - self.head.shift  # the slot drafting depth 1
        block = self.depth + first
        ids = torch.full((1, block), self.head.mask_token_id, dtype=torch.long, device=param.device)
        ids[0, 0] = context.tokens[-1]  # the anchor sits right after the context
        positions = torch.arange(self._length, self._length + block, device=param.device)[None]
        everything = torch.ones(1, 1, block, self._length + block, dtype=torch.bool, device=param.device)
        hidden = self.head(ids, positions, self._cache, everything)
        self._cache.crop(-block)  # the block's keys: the cache keeps the context only
        return hidden[0]

    @property
    def device(self) -> torch.device:
        """Where the head runs (its drafting is timed on this device's clock)."""
        return next(self.head.parameters()).device

    def keep(self, confidences: list[float], started: float, depth: int, sampled: bool) -> int:
        """How many of ``depth`` drafted tokens to verify, by ``cut``, from their predicted acceptances
        (``sampled``: the tokens were sampled, not chosen greedily)."""
        reach = survival(confidences)
        if self.cut == "threshold":  # a stopping rule: depth d's fate reads the draws above it only
            return sum(1 for p in reach if p >= self.threshold)
        seconds = clock(self.device) - started
        if not (sampled and self.confidences_read_draws):
            return priced_size(reach, self.costs, seconds, depth)
        # Depth d + 1's confidence reads the token drawn at depth d: an argmax over every depth would
        # let a draw's own value decide whether it is verified (a plain step because it priced the
        # chain out), a selection on the draws that recursive rejection sampling does not undo. Draw d
        # is kept while the best of the first d + 1 depths, priced on their reach alone (moved by the
        # draws above d only), keeps them all. Greedy output is the target's whatever the cut.
        kept = 0
        while kept < depth and priced_size(reach[: kept + 1], self.costs, seconds, kept + 1) == kept + 1:
            kept += 1
        return kept

    sequential = False  # each depth's distribution depends on the token chosen above it (a Markov head)
    confidences_read_draws = False  # each depth's confidence reads the token chosen above it

    def markov_step(self, normed: torch.Tensor, anchor: torch.Tensor):
        """``step(d, previous) -> (bias, confidence logit)`` for :func:`grow_markov_chain` (``normed``
        the drafting slots' normed states, ``anchor`` the slots before them: the anchor's where it
        drafts nothing): DFlash drafts without a bias; a subclass's Markov head adds one."""

        def step(d: int, previous: torch.Tensor):
            return None, self.head.confidence_logits(normed[d : d + 1])

        return step

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        # The previous step's commit already read its tokens back: this wait costs nothing.
        started = clock(self.device)
        depth = min(self.depth, context.max_tokens)
        if depth < 1:
            return TokenTree()  # the pending context joins the cache at the next proposal
        head = self.head
        slots = head.norm(self.block_hidden(context))
        first = 1 - head.shift  # the slot drafting depth 1
        normed = slots[first : first + depth]
        logits = head.lm_head(normed)  # depth d's distribution in row d - 1
        vocab = None if head.full_vocab else head.draft_vocab
        if self.cut == "fixed" and not self.sequential:  # every depth chosen at once
            return grow_chain(
                logits.float(), context.sampling, context.generator, context.max_entropy, vocab, head.config.vocab_size
            )
        return grow_markov_chain(
            logits,
            self.markov_step(normed, slots[:first]),
            torch.tensor(context.tokens[-1], device=logits.device),
            context.sampling,
            context.generator,
            context.max_entropy,
            vocab,
            head.config.vocab_size,
            cut=None
            if self.cut == "fixed"
            else lambda confidences: self.keep(confidences, started, depth, not context.sampling.greedy),
        )


def default_cut(head) -> str:
    """``priced`` for a drafter with a confidence head, else ``fixed``."""
    return "priced" if head.confidence_head is not None else "fixed"


def build(spec: DrafterSpec, target, head_class=DFlashHead, drafter_class=None):
    """The drafter of ``dflash:PATH?depth=K&cut=..&threshold=P`` (a subclass's with its classes); the
    target's pass costs are measured once for ``cut=priced``."""
    head = load_head(head_class, spec, target)
    options = dict(spec.options)
    costs = None
    if (options.get("cut") or default_cut(head)) == "priced" and head.confidence_head is not None:
        depth = min(options.get("depth") or head.draft_slots, head.draft_slots)
        costs = pass_costs(target, max_budget=depth)
    return (drafter_class or DFlashDrafter)(head, costs=costs, **options)
