"""Train a Domino drafter: ``accelerate launch train/domino.py recipes/smollm2-domino.yaml [--resume] [--key value]``.

DFlash's training (:mod:`draftsmith.train.dflash`: anchors on reply tokens, blocks over the
injected context, block-sparse attention, per-depth weights, the recipe's token objective) with
Domino's correction head, as SpecForge (``algorithms/common/dflash_family_model.py``,
``OnlineDominoModel``) and ModelOpt (``torch/speculative/plugins/hf_domino.py``) train it:

- the GRU reads the data's tokens before each scored slot's label (teacher-forced: the tokens the
  chain will have drafted when the draft is right), the anchor first, and its state at each depth
  past ``pure_draft_prefix_len``, with the slot's normed hidden state, gives the additive
  correction (:class:`~draftsmith.heads.domino.DominoHead`);
- the loss is ``(1 - lambda) * loss(corrected logits) + lambda * loss(backbone logits)``, where
  ``lambda`` falls linearly from ``base_loss_start`` to 0 over the first ``base_loss_decay`` of the
  run (the references' ``lambda_base_start`` / ``lambda_base_decay_ratio``: the backbone learns to
  draft first, the correction after); the share of the run is the learning-rate schedule's
  (steps, or ``training.max_minutes`` used, whichever is further);
- the LM head is the target's and stays frozen (the references score with the target's LM head
  and their checkpoints hold none), over the full vocabulary;
- the labels (``drafter.labels: auto``) are the data's tokens on regenerated data, as SpecForge
  trains it, or the target's distribution.

The references weigh depth d by ``exp(-(d - 1) / gamma)`` as DFlash does; they divide the weighted
sum by the weights' sum, this trainer (as for DFlash) by the number of scored slots, a constant
factor per batch shape that the learning rate absorbs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Annotated

import torch

from draftsmith.config import COUNT, NON_NEGATIVE_INT, Range
from draftsmith.heads.domino import DominoHead
from draftsmith.recipe import DECAY, DRAFT_VOCAB, DataConfig, Recipe
from draftsmith.train.cli import entry_point
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashTask
from draftsmith.train.fused import build_task, regenerated_data
from draftsmith.train.objectives import mixed_token_loss


@dataclass
class DominoDrafterConfig(DFlashDrafterConfig):
    """The Domino drafter: DFlash's backbone and blocks, the GRU correction head and its loss schedule."""

    kind: str = "domino"
    # Every slot drafts the token after its position, the anchor's too (the references' default:
    # b slots draft b tokens); false: DFlash's layout (the anchor's slot drafts nothing).
    shift_label: bool = True
    # depths 1..this keep the backbone's logits (the references': 1); fewer than the block drafts
    pure_draft_prefix_len: Annotated[int, NON_NEGATIVE_INT] = 1
    gru_hidden_dim: Annotated[int, COUNT] = 256  # the GRU's state size (Qwen3-8B's reference: 1024)
    emb_dim: Annotated[int, COUNT] = 128  # the correction MLP's inner width (Qwen3-8B's reference: 256)
    # the backbone loss's weight lambda at the start (lambda_base_start)
    base_loss_start: Annotated[float, Range(0, 1)] = 1.0
    # The share of the run over which lambda falls to 0 (lambda_base_decay_ratio; ModelOpt's and
    # SpecForge's recipes: 1.0, SpecForge's default when none is given: 0.5).
    base_loss_decay: Annotated[float, DECAY] = 1.0
    # must stay null: the target's LM head scores the full vocabulary
    draft_vocab_size: Annotated[int, DRAFT_VOCAB] | None = None

    def validate(self) -> None:
        super().validate()
        if self.draft_vocab_size is not None:
            raise ValueError(
                "drafter.draft_vocab_size: a Domino drafter scores the full vocabulary with the target's LM "
                "head (its serving engines load no drafter LM head); leave it null"
            )
        if self.train_lm_head:
            raise ValueError(
                "drafter.train_lm_head: a Domino drafter scores with the target's LM head, which its serving "
                "engines read from the target (an export saves none); leave it false (the default)"
            )
        if self.learn_mask_embedding or self.confidence_head or self.confidence_for is not None:
            raise ValueError(
                "drafter.learn_mask_embedding / confidence_head / confidence_for: a Domino drafter has neither a "
                "learned mask row nor a confidence head (its serving engines read the target's mask row)"
            )
        slots = self.block_size - 1 + int(self.shift_label)
        if self.pure_draft_prefix_len >= slots:
            raise ValueError(
                f"drafter.pure_draft_prefix_len must be in [0, {slots - 1}] (the block drafts {slots} tokens), "
                f"got {self.pure_draft_prefix_len}"
            )


@dataclass
class DominoRecipe(Recipe):
    data: DataConfig = field(default_factory=regenerated_data)
    drafter: DominoDrafterConfig = field(default_factory=DominoDrafterConfig)


def base_loss_weight(progress: float, start: float, decay: float) -> float:
    """lambda at ``progress`` (the share of the run done): ``start`` falling linearly to 0 at
    ``decay``, then 0 (ModelOpt's ``compute_lambda_base``, SpecForge's ``linear_lambda_base``)."""
    return max(0.0, min(1.0, start * (1.0 - min(progress / decay, 1.0))))


class DominoTask(DFlashTask):
    """DFlash's block loss on Domino's corrected logits, mixed with the backbone's on a schedule."""

    head_class = DominoHead
    weak_mask_advice = (
        "Domino's mask slots read that row (its serving engines have no learned one): choose another "
        "drafter.mask_token_id"
    )

    def __init__(self, recipe: DominoRecipe, target, head: DominoHead):
        super().__init__(recipe, target, head)
        self.base_weight = self.cfg.base_loss_start

    @staticmethod
    def head_options(drafter: DominoDrafterConfig) -> dict:
        return {
            "shift_label": drafter.shift_label,
            "pure_draft_prefix_len": drafter.pure_draft_prefix_len,
            "gru_hidden_dim": drafter.gru_hidden_dim,
            "emb_dim": drafter.emb_dim,
        }

    def on_progress(self, fraction: float) -> None:
        """Set lambda for the next training batch from the share of the run done."""
        self.base_weight = base_loss_weight(fraction, self.cfg.base_loss_start, self.cfg.base_loss_decay)

    def token_terms(self, head, hidden, previous, supervised, coeff, target_probs, kept) -> tuple:
        model = self.model
        slots = supervised.shape[-1]
        normed = model.norm(hidden[:, :, hidden.shape[2] - slots :])[supervised]
        states = model.prefix_states(previous)[supervised]
        depth = torch.arange(1, slots + 1, device=hidden.device).expand_as(supervised)[supervised]
        base = model.lm_head(normed)
        correction = model.correction(normed, states).to(base.dtype)
        corrected = depth > model.pure_draft_prefix_len
        ce, lse, logits = mixed_token_loss(
            base, correction, corrected, coeff, target_probs, self.loss_config.objective, kept, self.base_weight
        )
        return ce, lse, logits, None


build = partial(build_task, task_class=DominoTask)
main = entry_point(DominoRecipe, build, __doc__)


if __name__ == "__main__":
    main()
