"""Train a P-EAGLE head: ``accelerate launch train/peagle.py recipes/smollm2-peagle.yaml [--resume] [--key value]``.

The head (:mod:`draftsmith.heads.peagle`) is an EAGLE-3 head that drafts ``ttt_steps`` tokens in one
forward pass: the positions after the last known token read a learned mask token and mask feature.
Training unrolls the same layout (the shared :func:`draftsmith.train.unroll.unroll`, its later passes'
inputs this module's :func:`mask_inputs`): pass 0 reads the target's fused layers, pass j > 0 the mask
inputs at position offset j, attending to the real context and to the mask positions before it; the loss
of pass j's draft is the cross-entropy between the target's distribution over the draft vocabulary at
depth j + 1 and the head's, weighted ``ttt_step_loss_decay ** j`` (default 1), and the loss is one mean
over every scored draft of every depth, as speculators and SpecForge reduce it. Training samples draft
chains as the P-EAGLE trainers do (:func:`draftsmith.train.unroll.chain_sample`: depth d trains a
``down_sample_ratio ** (d - 1)`` share of the positions, at least ``down_sample_ratio_min``), so deep
passes cost a fraction of a full one and, through the one mean, weigh that fraction of depth 1; held-out
evaluation scores every chain. Everything else (data, regenerated replies, draft vocabulary, online or
offline features, the out-of-vocabulary mask) is EAGLE-3's (:mod:`draftsmith.train.eagle3`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated

import torch

from draftsmith.config import COUNT, NON_NEGATIVE_INT
from draftsmith.heads.peagle import PEagleHead
from draftsmith.heads.vocab import mask_token_for
from draftsmith.recipe import DECAY
from draftsmith.train.cli import entry_point
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.fused import build_task


@dataclass
class PEagleDrafterConfig(Eagle3DrafterConfig):
    """The P-EAGLE head: EAGLE-3's options, its drafted block and its mask token."""

    kind: str = "peagle"
    ttt_steps: Annotated[int, COUNT] = 7  # tokens drafted in one pass (draft depths trained, a pass each)
    ttt_step_loss_decay: Annotated[float, DECAY] = 1.0  # a depth-(j + 1) draft weighs decay ** j (1: as upstream)
    # null: the tokenizer's mask token, else a special token absent from the data
    mask_token_id: Annotated[int, NON_NEGATIVE_INT] | None = None

    def validate(self) -> None:
        super().validate()
        if self.fc_norm or self.norm_output:
            # vLLM 0.32's speculators bridge copies neither into a peagle config (algos.py update_peagle).
            raise ValueError(
                "drafter.fc_norm and drafter.norm_output (EAGLE 3.1) are EAGLE-3 options: vLLM 0.32 "
                "serves P-EAGLE drafters without them; set both false"
            )


@dataclass
class PEagleRecipe(Eagle3Recipe):
    drafter: PEagleDrafterConfig = field(default_factory=PEagleDrafterConfig)


def mask_inputs(
    mask_token_id: int, tokens: torch.Tensor, rows: torch.Tensor | None, step: int, previous: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """P-EAGLE's :data:`~draftsmith.train.unroll.LaterInputs` (``mask_token_id`` bound): pass ``step``
    > 0 reads the mask token at every position it runs (``rows``; None: all of ``tokens``') and no
    feature, so the head reads its mask feature. No pass depends on another's output (``previous``
    goes unread): the layout one drafting pass sees."""
    return torch.full_like(tokens if rows is None else rows, mask_token_id), {}


class PEagleTask(Eagle3Task):
    """EAGLE-3's loss over the parallel (mask-fed) unroll of a P-EAGLE head."""

    head_class = PEagleHead
    min_passes = 2  # passes j > 0 alone read the mask feature (mask_hidden)

    def __init__(self, recipe: PEagleRecipe, target, head: PEagleHead):
        super().__init__(recipe, target, head)
        self.later_inputs = partial(mask_inputs, head.mask_token_id)
        # One mean over every sampled row of every depth, as speculators 0.9.0 (models/peagle/metrics.py:50,
        # losses/utils.py:301-304) and SpecForge (core/peagle.py compute_peagle_metrics, LogSoftmaxLoss's
        # mean) reduce it: chain sampling's row counts set the depths' weights (7 depths: ~31/22/15/11/8/6/6 %).
        self.loss_config = replace(self.loss_config, pool_depths=True)

    @staticmethod
    def head_options(recipe: PEagleRecipe, tokenizer, train_set) -> dict:
        mask = mask_token_for(recipe.drafter.mask_token_id, tokenizer, train_set, len(tokenizer))
        return {"mask_token_id": mask, "num_depths": recipe.drafter.ttt_steps}


build = partial(build_task, task_class=PEagleTask)
main = entry_point(PEagleRecipe, build, __doc__)


if __name__ == "__main__":
    main()
