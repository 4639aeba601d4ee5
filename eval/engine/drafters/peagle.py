"""P-EAGLE drafting: one head pass over ``[pending tokens, MASK x (K - 1)]`` drafts a chain of K tokens.

The head's cache and its (token, target feature) pairing are the EAGLE drafter's
(:class:`~draftsmith.eval.engine.drafters.eagle.EagleDrafter`). Each proposal runs the pending pairs and
K - 1 mask positions as one tree forward of the head (a chain of rows after the committed prefix),
keeps the real rows in the cache and drops the mask rows: the cache only ever holds rows of real
target features, as vLLM's parallel drafting overwrites its mask slots. The last real row and the
mask rows give the draft distributions of depths 1..K, from which the chain is chosen (greedy, or
sampled for lossless verification) all at once (:func:`~draftsmith.eval.engine.tree.grow_chain`).
"""

from __future__ import annotations

import torch

from draftsmith.eval.engine.drafters.base import DraftContext, DrafterSpec, load_head
from draftsmith.eval.engine.drafters.eagle import EagleDrafter
from draftsmith.eval.engine.tree import TokenTree, grow_chain
from draftsmith.heads.peagle import PEagleHead


class PEagleDrafter(EagleDrafter):
    """A :class:`~draftsmith.heads.peagle.PEagleHead` drafting ``depth`` tokens in one pass (at most
    the depths it was trained for: deeper mask positions were never trained)."""

    def __init__(self, head, depth: int | None = None, name: str = "peagle"):
        depth = min(depth or head.num_depths, head.num_depths)
        super().__init__(head, depth=depth, top_k=1, budget=depth, name=name)

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        dtype = next(self.head.parameters()).dtype
        depth = min(self.depth, context.max_tokens)
        pending, masks = len(self._tokens), max(depth - 1, 0)
        features = torch.cat([self._features.to(dtype), self.head.mask_hidden[0].to(dtype).expand(masks, -1)])
        rows = list(range(pending + masks))
        out = self.runner.forward(
            self._tokens + [self.head.mask_token_id] * masks, [r - 1 for r in rows], rows, features=features[None]
        )
        self.runner.commit(rows[:pending])  # the mask rows never stay in the cache
        self._tokens, self._features = [], None
        if depth < 1:
            return TokenTree()
        logits = self.head.draft_logits(out[pending - 1 :]).float()  # depth d's distribution in row d - 1
        vocab = None if self.head.full_vocab else self.head.draft_vocab
        return grow_chain(
            logits, context.sampling, context.generator, context.max_entropy, vocab, self.head.config.vocab_size
        )


def build(spec: DrafterSpec, target) -> PEagleDrafter:
    """The drafter of ``peagle:PATH?depth=K``."""
    return PEagleDrafter(load_head(PEagleHead, spec, target), **spec.options)
