"""Train an EAGLE head: ``accelerate launch train/eagle.py recipes/smollm2-eagle.yaml [--resume] [--key value]``.

Loss at position i (head input ``[emb(t_{i+1}) ; f_i + noise]``, output the predicted
``f_{i+1}``): Smooth-L1 against the target's ``f_{i+1}`` plus ``ce_weight`` x the cross-entropy
between the target's distribution of token i+2 and the LM head applied to the prediction, on
assistant tokens only. HASS (Zhang et al., 2025) is two options: ``ttt_steps > 1`` adds passes
in which the head reads its own (detached) predicted features, every pass weighted alike (context
alignment, see :mod:`draftsmith.train.unroll`), and ``top_k_loss`` adds ``top_k_weight`` x a
distillation term over the target's top-K tokens to the loss. Features come from the frozen target inside the step
(``online``) or from an on-disk cache written by ``draftsmith.data_prep.features`` (``offline``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch

from draftsmith.config import COUNT, NON_NEGATIVE
from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.feature_sets import training_sets
from draftsmith.data_prep.packing import target_inputs
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.vocab import draft_vocab_for
from draftsmith.recipe import DECAY, DRAFT_VOCAB, DrafterConfig, Recipe
from draftsmith.timing import stage
from draftsmith.train.cli import entry_point
from draftsmith.train.objectives import parse_objective
from draftsmith.train.prepare import feature_source, target_and_data
from draftsmith.train.unroll import depth_rates, loss_settings, record_depth_accuracy, unroll, unrolled_loss


@dataclass
class EagleDrafterConfig(DrafterConfig):
    """The EAGLE head and its loss."""

    kind: str = "eagle"
    num_layers: Annotated[int, COUNT] = 1  # decoder layers of the target's architecture in the head
    # identity: the head starts as f_{i+1} = f_i; random: the paper's init
    init: Literal["identity", "random"] = "identity"
    # None: the full vocabulary; N: the N most frequent assistant tokens
    draft_vocab_size: Annotated[int, DRAFT_VOCAB] | None = None
    # amplitude a of the U(-a, a) noise added to input features while training (the paper: 0.1)
    feature_noise: Annotated[float, NON_NEGATIVE] = 0.1
    regression_weight: Annotated[float, NON_NEGATIVE] = 1.0  # weight of the Smooth-L1 loss on the next feature
    # weight of the soft cross-entropy against the target's next-token distribution
    ce_weight: Annotated[float, NON_NEGATIVE] = 0.1
    features: Literal["online", "offline", "served"] = "online"  # target features: per step, on disk first, or served
    features_dir: str | None = None  # offline cache (default: under the draftsmith cache)
    # HASS context alignment: passes over the head's own predicted features (1: off; HASS uses 3)
    ttt_steps: Annotated[int, COUNT] = 1
    # the loss of pass j is weighted decay ** j (HASS weighs the passes equally)
    ttt_step_loss_decay: Annotated[float, DECAY] = 1.0
    detach_feedback: bool = True  # HASS: no gradient through the predicted features fed back to later passes
    # HASS distillation: add a term over the target's K most likely tokens (null: off)
    top_k_loss: Annotated[int, COUNT] | None = None
    # weight of the top-K term (HASS: 1.0, beside ce_weight x the full distribution)
    top_k_weight: Annotated[float, NON_NEGATIVE] = 1.0
    objective: str | dict[str, float] = "kl_div"  # kl_div, rkl, jsd, ce, tv, nla, lk_hybrid or a mix {ce: 0.1, tv: 0.9}

    def validate(self) -> None:
        parse_objective(self.objective)


@dataclass
class EagleRecipe(Recipe):
    drafter: EagleDrafterConfig = field(default_factory=EagleDrafterConfig)


class EagleTask:
    """The EAGLE loss over a frozen target."""

    def __init__(self, recipe: EagleRecipe, target, head: EagleHead):
        self.cfg = recipe.drafter
        self.target = target
        self.model = head
        self.loss_config = loss_settings(
            self.cfg, ce_weight=self.cfg.ce_weight, regression_weight=self.cfg.regression_weight
        )

    collate = staticmethod(pad_batch)

    @torch.no_grad()
    def target_features(self, batch: dict) -> torch.Tensor:
        """The target's last hidden states (what its LM head reads), from the batch or computed."""
        if "hidden" in batch:
            return batch["hidden"]
        decoder = self.target.get_decoder()
        return decoder(**target_inputs(batch, decoder)).last_hidden_state

    def loss(self, head, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        features = self.target_features(batch)
        dtype = next(self.model.parameters()).dtype
        feats_in = features[:, :-1].to(dtype)
        if training and self.cfg.feature_noise > 0:
            feats_in = feats_in + (torch.rand_like(feats_in) * 2 - 1) * self.cfg.feature_noise
        outputs = unroll(
            head,
            batch["input_ids"],
            feats_in,
            batch["attention_mask"],
            self.cfg.ttt_steps,
            self.model.feedback_input,
            detach=self.cfg.detach_feedback,
        )
        return unrolled_loss(
            self.model, outputs, features, batch["loss_mask"], batch["attention_mask"], self.loss_config, training
        )

    finalise_metrics = staticmethod(depth_rates)

    def on_evaluate(self, metrics: dict[str, float]) -> None:
        record_depth_accuracy(self.model, metrics)

    def save_pretrained(self, model, path: Path) -> None:
        model.save_pretrained(path)


def build(recipe: EagleRecipe):
    """Target, tokenised data (or features), head and task for ``recipe``."""
    target, tokenizer, data, full_target = target_and_data(recipe)
    draft_vocab = draft_vocab_for(recipe.drafter.draft_vocab_size, data["train"], tokenizer, target.config.vocab_size)
    torch.manual_seed(recipe.training.seed)  # the head's initial weights: reproducible, and set by the seed
    head = EagleHead.for_target(target, recipe.target.name, recipe.drafter.num_layers, draft_vocab, recipe.drafter.init)
    with stage(f"train: {recipe.drafter.features} feature sets"):
        train_set, eval_set = training_sets(feature_source(recipe), target, tokenizer, data, full_target=full_target)
    return EagleTask(recipe, target, head), train_set, eval_set


main = entry_point(EagleRecipe, build, __doc__)


if __name__ == "__main__":
    main()
