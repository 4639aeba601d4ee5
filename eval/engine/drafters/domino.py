"""Domino drafting: DFlash's one pass over the block, then the chain is chosen one depth after
another, each depth past ``pure_draft_prefix_len`` corrected by the GRU state of the tokens chosen
above it (SpecForge's ``DominoDraftModel._sample_draft_tokens``: the block's base logits once, the
correction per drafted token).

The block is the trained one: with ``shift_label`` K drafted tokens take K slots ``[anchor, MASK x
(K - 1)]``, every slot drafting the token after its position; without it DFlash's ``1 + K``. The
GRU steps and the corrections stay on the device and are read back once with the chosen tokens
(:func:`~draftsmith.eval.engine.drafters.dflash.grow_markov_chain`).
"""

from __future__ import annotations

import torch

from draftsmith.eval.engine.drafters.base import DrafterSpec
from draftsmith.eval.engine.drafters.dflash import DFlashDrafter
from draftsmith.eval.engine.drafters.dflash import build as build_block_drafter
from draftsmith.heads.domino import DominoHead


class DominoDrafter(DFlashDrafter):
    """A :class:`~draftsmith.heads.domino.DominoHead`: DFlash's drafter with the GRU correction per depth."""

    def __init__(self, head: DominoHead, *args, correction: int = 1, name: str = "domino", **kwargs):
        super().__init__(head, *args, name=name, **kwargs)
        # Off, the backbone's logits draft every depth at once: the ablation the correction is measured against.
        self.sequential = bool(correction)

    def markov_step(self, normed: torch.Tensor, anchor: torch.Tensor):
        """Depth d + 1's correction from the GRU state after the tokens above it (the anchor, then
        the chosen ones), as training scores it (:meth:`~draftsmith.heads.domino.DominoHead.prefix_states`);
        the GRU reads every token, corrected depth or not."""
        head, state = self.head, None

        def step(d: int, previous: torch.Tensor):
            nonlocal state
            state = head.advance(previous, state)
            if not head.corrected(d + 1):
                return None, None
            return head.correction(normed[d : d + 1], state).to(normed.dtype), None

        return step


def build(spec: DrafterSpec, target) -> DominoDrafter:
    """The drafter of ``domino:PATH?depth=K&correction=0|1``."""
    return build_block_drafter(spec, target, DominoHead, DominoDrafter)
