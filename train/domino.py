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
import torch.nn.functional as F

from draftsmith.config import COUNT, NON_NEGATIVE_INT, Range
from draftsmith.heads.domino import DominoHead
from draftsmith.heads.vocab import draft_vocab_for, vocab_positions
from draftsmith.recipe import DECAY, DRAFT_VOCAB, DataConfig, Recipe
from draftsmith.train.cli import entry_point
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashTask, auto_labels
from draftsmith.train.fused import build_task, regenerated_data
from draftsmith.train.objectives import mixed_token_loss, token_loss
from draftsmith.train.unroll import depth_rates


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
    # The share of the run that trains the backbone alone (lambda held at 1, no correction) over the
    # backbone_warmup_vocab most frequent reply tokens, at about a DFlash step's cost; the rest trains
    # as the references do, over the full vocabulary, lambda falling from base_loss_start over it.
    # Needs drafter.labels: data. 0: the references' schedule from the first step.
    backbone_warmup: Annotated[float, Range(0, 1, open_high=True)] = 0.0
    backbone_warmup_vocab: Annotated[int, DRAFT_VOCAB] = 8192  # the warm-up's most frequent reply tokens

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

    def validate(self) -> None:
        drafter, dist = self.drafter, self.distributed
        if drafter.backbone_warmup == 0:
            return
        if dist.backend == "deepspeed" and dist.zero_stage == 3:
            raise ValueError(
                "drafter.backbone_warmup reads the frozen LM head's rows for its tokens, which ZeRO-3 partitions "
                "over the processes: set distributed.zero_stage 2 or lower (a drafter's weights fit each "
                "process), or drafter.backbone_warmup: 0"
            )
        labels = drafter.labels if drafter.labels != "auto" else auto_labels(drafter, self.data)[0]
        if labels != "data":
            why = " (auto takes data only on greedily regenerated replies)" if drafter.labels == "auto" else ""
            raise ValueError(
                f"drafter.backbone_warmup = {drafter.backbone_warmup} learns the data's tokens and drafter.labels "
                f"is {labels} here{why}: set drafter.labels: data (on the target's regenerated replies), or "
                "drafter.backbone_warmup: 0"
            )


def base_loss_weight(progress: float, start: float, decay: float, warmup: float = 0.0) -> float:
    """lambda at ``progress`` (the share of the run done): ``start`` falling linearly to 0 at
    ``decay``, then 0 (ModelOpt's ``compute_lambda_base``, SpecForge's ``linear_lambda_base``); with a
    backbone ``warmup`` (a share of the run), 1 through it and that schedule over the rest of the run."""
    if progress < warmup:
        return 1.0
    progress = (progress - warmup) / (1.0 - warmup)
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
        self.on_progress(0.0)
        self.warm_step = False  # this loss call's: a training step inside the warm-up

    @classmethod
    def new_head(cls, recipe: DominoRecipe, target, draft_vocab, tokenizer, train_set) -> DominoHead:
        """DFlash's fresh head, plus (with a backbone warm-up) the warm-up's vocabulary as a buffer
        that follows the head to its device and is never saved (``warmup_vocab``)."""
        head = super().new_head(recipe, target, draft_vocab, tokenizer, train_set)
        drafter = recipe.drafter
        if drafter.backbone_warmup > 0:
            vocab = draft_vocab_for(drafter.backbone_warmup_vocab, train_set, tokenizer, target.config.vocab_size)
            head.register_buffer("warmup_vocab", vocab, persistent=False)
        return head

    @staticmethod
    def head_options(drafter: DominoDrafterConfig) -> dict:
        return {
            "shift_label": drafter.shift_label,
            "pure_draft_prefix_len": drafter.pure_draft_prefix_len,
            "gru_hidden_dim": drafter.gru_hidden_dim,
            "emb_dim": drafter.emb_dim,
        }

    def on_progress(self, fraction: float) -> None:
        """Set lambda, and whether the backbone warm-up goes on, for the next training batch from
        the share of the run done."""
        warmup = self.cfg.backbone_warmup
        self.warming = fraction < warmup
        self.base_weight = base_loss_weight(fraction, self.cfg.base_loss_start, self.cfg.base_loss_decay, warmup)

    def finalise_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """:func:`~draftsmith.train.unroll.depth_rates`, and a training window's lambda (its last
        step's; during the backbone warm-up 1, and the window's losses and top-1 are over the
        warm-up's tokens)."""
        logs = depth_rates(logs)
        if "train/top1@1" in logs:
            logs["train/base_weight"] = self.base_weight
        return logs

    def loss(self, head, batch: dict, training: bool) -> tuple:
        # Held-out evaluations score the full vocabulary, as the drafter is served, warm-up or not.
        self.warm_step = training and self.warming
        return super().loss(head, batch, training)

    def warm_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, rows)`` of the warm-up's tokens: each token id's column (-1: none) and the
        frozen LM head's rows for them, built once (again only if the head's weight or the
        vocabulary moves or changes) rather than every step."""
        weight, vocab = self.model.lm_head.weight, self.model.warmup_vocab
        key = (weight.data_ptr(), weight.dtype, weight._version, vocab.data_ptr())
        if getattr(self, "_warm_key", None) != key:
            rows = weight.detach().index_select(0, vocab)
            self._warm, self._warm_key = (vocab_positions(vocab, self.model.vocab_size), rows), key
        return self._warm

    def scored_vocab(self) -> tuple:
        """The warm-up's frequent tokens in a warm-up step, else the full vocabulary."""
        if not self.warm_step:
            return super().scored_vocab()
        return self.warm_vocab()[0].__getitem__, self.model.warmup_vocab

    def token_terms(self, head, hidden, previous, supervised, coeff, target_probs, kept) -> tuple:
        model = self.model
        slots = supervised.shape[-1]
        normed = model.norm(hidden[:, :, hidden.shape[2] - slots :])[supervised]
        if self.warm_step:
            # The backbone alone over the warm-up's tokens: the target's frozen rows for them, a
            # sixth of the full vocabulary's products, and neither the GRU nor the correction.
            base = F.linear(normed, self.warm_vocab()[1])
            ce, lse = token_loss(base, coeff, target_probs, self.loss_config.objective, kept)
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # DDP waits for a gradient of every parameter each step: zeros for the idle head.
                idle = (*model.prefix_gru.parameters(), *model.embed_proj.parameters())
                ce = ce + 0.0 * sum(param.sum() for param in idle)
            return ce, lse, base, None
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
