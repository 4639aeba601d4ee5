"""DSpark drafting: DFlash's one pass over the block, then the Markov head chooses the chain one
depth after another (each depth's logits biased by the token just chosen), and the confidence head's
predicted acceptance decides how much of the chain the target verifies (``cut``, as for any
DFlash-family drafter with a confidence head: :class:`~draftsmith.eval.engine.drafters.dflash.DFlashDrafter`).

The block is vLLM's (v1/worker/gpu/spec_decode/dspark/speculator.py): with ``sample_from_anchor``
K drafted tokens take K slots ``[anchor, MASK x (K - 1)]``, every slot drafting the token after its
position; without it DFlash's ``1 + K`` slots. The Markov steps and the confidences stay on the
device and are read back once with the chosen tokens
(:func:`~draftsmith.eval.engine.drafters.dflash.grow_markov_chain`).
"""

from __future__ import annotations

import torch

from draftsmith.eval.engine.drafters.base import DrafterSpec
from draftsmith.eval.engine.drafters.dflash import DFlashDrafter
from draftsmith.eval.engine.drafters.dflash import build as build_block_drafter
from draftsmith.heads.dspark import DSparkHead


class DSparkDrafter(DFlashDrafter):
    """A :class:`~draftsmith.heads.dspark.DSparkHead`: DFlash's drafter with the Markov bias in each depth."""

    def __init__(self, head: DSparkHead, *args, name: str = "dspark", **kwargs):
        super().__init__(head, *args, name=name, **kwargs)
        self.sequential = head.markov_head is not None
        self.confidences_read_draws = head.confidence_with_markov

    def markov_step(self, normed: torch.Tensor, anchor: torch.Tensor):
        """Depth d's Markov bias from the token chosen at depth d - 1 (the rnn's state carried along,
        from the anchor's slot where the anchor drafts nothing, as training runs it:
        :meth:`~draftsmith.heads.dspark.DSparkHead.teacher_forced`), and its confidence logit from
        the same features."""
        head, state = self.head, None

        def step(d: int, previous: torch.Tensor):
            nonlocal state
            embedded = head.embed_previous(previous)
            bias = None
            if embedded is not None:
                if d == 0 and len(anchor):  # the anchor's slot: previous is the anchor's own token
                    state = head.markov_start(embedded, anchor)
                features, state = head.markov_head.step(embedded, normed[d : d + 1], state)
                bias = head.markov_head.markov_w2(features)
            return bias, None if self.cut == "fixed" else head.confidence_logits(normed[d : d + 1], embedded)

        return step


def build(spec: DrafterSpec, target) -> DSparkDrafter:
    """The drafter of ``dspark:PATH?depth=K&cut=priced|threshold|fixed&threshold=P``."""
    return build_block_drafter(spec, target, DSparkHead, DSparkDrafter)
