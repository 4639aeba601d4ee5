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

import torch
from transformers import DynamicCache

from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult, load_head
from draftsmith.eval.engine.tree import TokenTree, grow_chain
from draftsmith.heads.dflash import DFlashHead


class DFlashDrafter(Drafter):
    """A :class:`~draftsmith.heads.dflash.DFlashHead` drafting ``depth`` (< its block size) tokens a pass."""

    needs_hidden = True

    def __init__(self, head, depth: int | None = None, name: str = "dflash"):
        self.head = head.eval()
        self.feature_layers = head.aux_layers
        self.depth = min(depth or head.block_size - 1, head.block_size - 1)
        self.name = name
        self._cache, self._length, self._features = DynamicCache(), 0, None

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self._cache, self._length, self._features = DynamicCache(), 0, hidden

    def accept(self, result: StepResult) -> None:
        self._features = result.hidden if self._features is None else torch.cat([self._features, result.hidden])

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        param = next(self.head.parameters())
        if self._features is not None and len(self._features):
            n = len(self._features)
            positions = torch.arange(self._length, self._length + n, device=param.device)[None]
            self.head.add_context(self._cache, self._features.to(param.dtype)[None], positions)
            self._length, self._features = self._length + n, None
        depth = min(self.depth, context.max_tokens)
        if depth < 1:
            return TokenTree()
        # [anchor, MASK x K] for the configured K even where fewer tokens are wanted (the output's end):
        # the slots attend to each other both ways, so the block's length changes every slot's output,
        # and vLLM always runs 1 + num_speculative_tokens slots. K < block_size - 1 is therefore a
        # shorter block than training ran, measured as vLLM serves it.
        block = self.depth + 1
        ids = torch.full((1, block), self.head.mask_token_id, dtype=torch.long, device=param.device)
        ids[0, 0] = context.tokens[-1]  # the anchor sits right after the context
        positions = torch.arange(self._length, self._length + block, device=param.device)[None]
        everything = torch.ones(1, 1, block, self._length + block, dtype=torch.bool, device=param.device)
        hidden = self.head(ids, positions, self._cache, everything)
        self._cache.crop(-block)  # the block's keys: the cache keeps the context only
        logits = self.head.draft_logits(hidden[0, 1 : depth + 1]).float()  # depth d's distribution in row d - 1
        vocab = None if self.head.full_vocab else self.head.draft_vocab
        return grow_chain(
            logits, context.sampling, context.generator, context.max_entropy, vocab, self.head.config.vocab_size
        )


def build(spec: DrafterSpec, target) -> DFlashDrafter:
    """The drafter of ``dflash:PATH?depth=K``."""
    return DFlashDrafter(load_head(DFlashHead, spec, target), **spec.options)
