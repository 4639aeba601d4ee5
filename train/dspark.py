"""Train a DSpark drafter: ``accelerate launch train/dspark.py recipes/smollm2-dspark.yaml [--resume] [--key value]``.

DFlash's training (:mod:`draftsmith.train.dflash`: anchors on reply tokens, blocks over the injected
context, block-sparse attention, slot weights) with DSpark's two heads, as speculators 0.9 trains
them (``models/dspark/{core,metrics}.py``):

- with ``sample_from_anchor`` (the default, DeepSeek's convention) slot k of a block anchored at a
  drafts token a + k + 1, scored with the target's distribution at a + k: the anchor's slot drafts
  too, so a block of b slots trains depths 1..b (DFlash's layout, depths 1..b - 1, without it);
- the Markov head adds ``W2 f(previous token)`` to each slot's logits, teacher-forced with the
  data's token before the slot's label (the token the chain will have drafted when the draft is
  right); an rnn head's recurrence runs over every slot of the block as speculators' ``block_bias``
  does, so without ``sample_from_anchor`` it steps over the anchor's slot (previous token: the
  anchor) before depth 1 (:meth:`~draftsmith.heads.dspark.DSparkHead.teacher_forced`);
- the confidence head is trained with binary cross-entropy against each slot's analytic acceptance
  rate ``sum_v min(p_v, q_v)`` (p the target's distribution, q the draft's with the Markov bias,
  over the draft vocabulary; no gradient through the rate), weighted by DFlash's decay whatever the
  token loss's ``weighting`` (``dpace`` included: speculators keeps the confidence BCE on the decay),
  divided by the number of scored slots (speculators' ``_masked_decayed_mean``), and added with
  weight ``confidence_alpha`` (speculators' default 1.0).

The token loss is the soft cross-entropy to the target's distribution (the same gradient as
speculators' default ``kl_div``), weighted per depth as DFlash's (decay or D-PACE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Literal

import torch

from draftsmith.config import Range
from draftsmith.heads.dspark import DSparkHead
from draftsmith.recipe import DataConfig, Recipe
from draftsmith.train.cli import entry_point
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashTask
from draftsmith.train.fused import build_task, regenerated_data

MAX_MARKOV_RANK = 4096
MAX_BLOCK_SIZE = 64


@dataclass
class DSparkDrafterConfig(DFlashDrafterConfig):
    """The DSpark drafter: DFlash's backbone and blocks, the Markov and confidence heads, and their losses."""

    kind: str = "dspark"
    # slots a block (DeepSeek's released drafters: 7); drafts as many with sample_from_anchor
    block_size: Annotated[int, Range(2, MAX_BLOCK_SIZE, integer=True)] = 7
    # Every slot drafts the token after its position, the anchor's too (DeepSeek's convention; vLLM
    # then runs K slots for K tokens); false: DFlash's layout (the anchor's slot drafts nothing).
    sample_from_anchor: bool = True
    # rank r of the Markov bias W1 @ W2 (0: no Markov head, plain DFlash drafting)
    markov_rank: Annotated[int, Range(0, MAX_MARKOV_RANK, integer=True)] = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"  # vLLM 0.32 serves vanilla only
    confidence_head: bool = True  # the per-position acceptance predictor (the engine's cut=priced/threshold)
    confidence_head_with_markov: bool = True  # it also reads the previous token's Markov embedding

    def validate(self) -> None:
        super().validate()
        if self.confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "drafter.confidence_head_with_markov needs a Markov head (drafter.markov_rank >= 1); "
                "set drafter.confidence_head_with_markov: false or a rank"
            )
        if self.learn_mask_embedding:
            raise ValueError(
                "drafter.learn_mask_embedding: vLLM's DSpark reads the target's embedding row for the mask "
                "token and has no learned one; choose a drafter.mask_token_id whose row is trained"
            )


@dataclass
class DSparkRecipe(Recipe):
    data: DataConfig = field(default_factory=regenerated_data)
    drafter: DSparkDrafterConfig = field(default_factory=DSparkDrafterConfig)


class DSparkTask(DFlashTask):
    """DFlash's block loss with the Markov bias in the scored logits and the confidence head's loss."""

    head_class = DSparkHead
    weak_mask_advice = (
        "DSpark's mask slots read that row (vLLM has no learned one): choose another drafter.mask_token_id"
    )

    @staticmethod
    def head_options(drafter: DSparkDrafterConfig) -> dict:
        return {
            "markov_rank": drafter.markov_rank,
            "markov_head_type": drafter.markov_head_type,
            "confidence_head_with_markov": drafter.confidence_head_with_markov,
            "sample_from_anchor": drafter.sample_from_anchor,
        }

    def score(self, head, hidden: torch.Tensor, previous: torch.Tensor, supervised: torch.Tensor):
        model = self.model
        normed, features, embedded = model.teacher_forced(hidden, previous)
        logits = model.markov_logits(normed[supervised], None if features is None else features[supervised])
        confidence = model.confidence_logits(normed[supervised], None if embedded is None else embedded[supervised])
        return logits, confidence


build = partial(build_task, task_class=DSparkTask)
main = entry_point(DSparkRecipe, build, __doc__)


if __name__ == "__main__":
    main()
