"""Train an EAGLE-3 head: ``accelerate launch train/eagle3.py recipes/smollm2-eagle3.yaml [--resume] [--key value]``.

The head (:mod:`draftsmith.heads.eagle3`) reads the target's ``aux_layers`` hidden states fused by
``fc`` and is unrolled ``ttt_steps`` times on its own outputs (training-time test,
:mod:`draftsmith.train.unroll`); the loss of pass j, weighted ``ttt_step_loss_decay ** j``, is the
cross-entropy between the target's distribution over the draft vocabulary and the head's. There
is no feature regression. Accuracy is logged per draft depth (``top1@d``). Target features are
computed inside each step (``online``, the default: nothing to store for big targets) or cached on
disk first (``offline``). By default the training replies are the target's own (``data.regenerate``)
and the draft vocabulary is their most frequent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Literal

import torch

from draftsmith.config import COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, Range
from draftsmith.data_prep.dataset import pad_batch
from draftsmith.heads.eagle3 import EAGLE31_OPTIONS, Eagle3Head
from draftsmith.recipe import DECAY, DRAFT_VOCAB, DataConfig, DrafterConfig, Recipe
from draftsmith.train.cli import entry_point
from draftsmith.train.fused import build_task, fused_target_features, regenerated_data
from draftsmith.train.objectives import parse_objective
from draftsmith.train.unroll import (
    Chains,
    LaterInputs,
    chain_sample,
    depth_rates,
    greedy_replies,
    loss_settings,
    record_depth_accuracy,
    supervised_next,
    unroll,
    unrolled_loss,
)


@dataclass
class Eagle3DrafterConfig(DrafterConfig):
    """The EAGLE-3 head and its training-time test."""

    kind: str = "eagle3"
    # target layers fused as the head's input (HF hidden_states ids); null: [2, N/2, N-3]
    aux_layers: Annotated[list[int], NON_NEGATIVE_INT] | None = None
    # identity: fc passes the highest aux layer through and the layer starts as a no-op
    init: Literal["identity", "random"] = "identity"
    # the N most frequent tokens of the training replies (d2t/t2d); null: the full vocabulary
    draft_vocab_size: Annotated[int, DRAFT_VOCAB] | None = 8192
    norm_before_residual: bool = False  # residual from the normed hidden state (speculators' option of the same name)
    # EAGLE 3.1: an RMSNorm of its own on each aux layer's state before fc (speculators' and vLLM's fc_norm)
    fc_norm: bool = False
    # EAGLE 3.1: the normed output is what the next draft step reads back (speculators' and vLLM's norm_output)
    norm_output: bool = False
    # The first layer reads [embedding ; hidden], the rest the hidden state only (vLLM's and speculators' layout).
    # decoder layers of the target's architecture in the head (upstream P-EAGLE drafters: 4)
    num_layers: Annotated[int, COUNT] = 1
    ttt_steps: Annotated[int, COUNT] = 7  # passes of the training-time test (draft depths trained)
    ttt_step_loss_decay: Annotated[float, DECAY] = 0.8  # the loss of pass j is weighted decay ** j
    # decay: pass j weighs ttt_step_loss_decay ** j (EAGLE-3's, speculators'); reach: the product of passes
    # 0..j-1's top-1 rates on the batch, the chance a greedy chain gets to depth j + 1 (what its acceptance is worth)
    depth_weighting: Literal["decay", "reach"] = "decay"
    # reach: a step skips the passes whose reach in the last logged training window was below this
    # (their loss would weigh less; the passes before them always run); 0: every pass, every step
    reach_floor: Annotated[float, Range(0, 1)] = 0.05
    # HASS: add a distillation term over the target's K most likely tokens (null: off)
    top_k_loss: Annotated[int, COUNT] | None = None
    top_k_weight: Annotated[float, NON_NEGATIVE] = 1.0  # weight of the top-K term
    objective: str | dict[str, float] = "kl_div"  # kl_div, rkl, jsd, ce, tv, nla, lk_hybrid or a mix {ce: 0.1, tv: 0.9}
    # Chain sampling (P-EAGLE's COD): pass d >= 2 trains max(ratio ** (d - 1), ratio_min) of the positions,
    # nested (each sampled draft's ancestors are trained too) and runs on those rows only; 1: every position.
    # 0.7 beat every position at equal wall time (BENCHMARKS.md, issue 33 round 2).
    down_sample_ratio: Annotated[float, DECAY] = 0.7
    # the least share of positions a pass trains (the ratio's floor)
    down_sample_ratio_min: Annotated[float, DECAY] = 0.2
    # mask: no token loss where the target's next token (full-vocabulary argmax) is outside the draft
    # vocabulary, as the EAGLE-3 and SpecForge trainers do (one full LM-head pass over the batch a step);
    # renormalise: fit the target's distribution renormalised over the draft vocabulary there too.
    out_of_vocab_targets: Literal["mask", "renormalise"] = "mask"
    # Train the head's LM head (it starts as the target's rows for the draft vocabulary); false keeps
    # those rows frozen, as speculators' trainer does: at 6 minutes on a CPU, 5% more steps and the
    # same acceptance (BENCHMARKS.md), so the head keeps training it
    train_lm_head: bool = True
    features: Literal["online", "offline", "served"] = "online"  # target features: per step, on disk first, or served
    features_dir: str | None = None  # offline cache (default: under the draftsmith cache)

    def validate(self) -> None:
        parse_objective(self.objective)


@dataclass
class Eagle3Recipe(Recipe):
    # EAGLE-3 learns the target's own replies by default: data.regenerate.enabled is true.
    data: DataConfig = field(default_factory=regenerated_data)
    drafter: Eagle3DrafterConfig = field(default_factory=Eagle3DrafterConfig)


class Eagle3Task:
    """The training-time-test loss of an EAGLE-3 head over a frozen target."""

    head_class = Eagle3Head
    # What unroll passes j > 0 read (unroll's later_inputs); None: the previous pass's outputs, fed back.
    later_inputs: LaterInputs | None = None
    # The fewest passes a training step runs under depth_weighting: reach (a kind whose later passes read
    # weights pass 0 does not keeps them: DDP expects a gradient for every parameter every step).
    min_passes: int = 1

    @staticmethod
    def head_options(recipe, tokenizer, train_set) -> dict:
        """Constructor arguments of ``head_class`` beyond EAGLE-3's (a subclass's)."""
        return {}

    @classmethod
    def new_head(cls, recipe, target, draft_vocab, tokenizer, train_set):
        """A fresh head for ``target`` as ``recipe.drafter`` describes it."""
        drafter = recipe.drafter
        return cls.head_class.for_target(
            target,
            recipe.target.name,
            drafter.aux_layers,
            draft_vocab,
            drafter.init,
            drafter.norm_before_residual,
            num_layers=drafter.num_layers,
            **{key: True for key in EAGLE31_OPTIONS if getattr(drafter, key)},
            **cls.head_options(recipe, tokenizer, train_set),
        )

    def __init__(self, recipe: Eagle3Recipe, target, head: Eagle3Head):
        self.cfg = recipe.drafter
        self.target = target
        self.model = head
        self.loss_config = loss_settings(
            self.cfg,
            mask_out_of_vocab=self.cfg.out_of_vocab_targets == "mask",
            reach=self.cfg.depth_weighting == "reach",
        )
        self.greedy_replies = greedy_replies(getattr(recipe, "data", None))
        # Each depth's top-1 rate in the last logged training window (summed over processes, so every
        # process runs the same passes); saved with the run's state.
        self.window_rates: list[float] = []

    collate = staticmethod(pad_batch)

    def target_features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux, last)``: the fused ``aux_layers`` states and the last hidden states (see
        :func:`~draftsmith.train.fused.fused_target_features`)."""
        return fused_target_features(self.target, self.model.aux_layers, batch)

    def loss(self, head, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        aux, last = self.target_features(batch)
        dtype = next(self.model.parameters()).dtype
        steps = self.passes() if training else self.cfg.ttt_steps
        chains = self.sample_chains(batch, steps) if training else None
        outputs = unroll(
            head,
            batch["input_ids"],
            aux[:, :-1].to(dtype),
            batch["attention_mask"],
            steps,
            self.model.feedback_input,
            later_inputs=self.later_inputs,
            chains=chains,
        )
        return unrolled_loss(
            self.model,
            outputs,
            last,
            batch["loss_mask"],
            batch["attention_mask"],
            self.loss_config,
            training,
            chains,
            batch.get("loss_weight"),  # adapt.rejected_weight's, where a round set them
            batch["input_ids"] if self.greedy_replies else None,
        )

    def passes(self) -> int:
        """Passes a training step runs: all of them, or under ``depth_weighting: reach`` those up to the
        first whose reach in the last logged window (the product of the rates of the depths before it)
        is below ``reach_floor``. Read from logged values: no host sync of its own."""
        if self.cfg.depth_weighting != "reach" or not self.window_rates:
            return self.cfg.ttt_steps
        steps, reach = 1, 1.0
        for rate in self.window_rates[: self.cfg.ttt_steps - 1]:
            reach *= rate
            if reach < self.cfg.reach_floor:
                break
            steps += 1
        return max(steps, min(self.min_passes, self.cfg.ttt_steps))

    def finalise_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """:func:`depth_rates`; a training window's rates are kept for :meth:`passes`."""
        logs = depth_rates(logs)
        if "train/top1@1" in logs:
            self.window_rates = [
                logs[f"train/top1@{d}"] for d in range(1, self.cfg.ttt_steps + 1) if f"train/top1@{d}" in logs
            ]
            logs["train/passes"] = len(self.window_rates)
        return logs

    def state_dict(self) -> dict:
        """What :meth:`passes` reads, for a resumed run to go on as it was."""
        return {"window_rates": self.window_rates}

    def load_state_dict(self, state: dict) -> None:
        self.window_rates = list(state.get("window_rates", []))

    def sample_chains(self, batch: dict, steps: int) -> list[Chains] | None:
        """The draft chains each training pass j > 0 of ``steps`` trains (:func:`chain_sample`); None: all of them."""
        if self.cfg.down_sample_ratio == 1:
            return None
        return chain_sample(
            supervised_next(batch["loss_mask"], batch["attention_mask"]),
            steps,
            self.cfg.down_sample_ratio,
            self.cfg.down_sample_ratio_min,
            batch["attention_mask"],
        )

    def on_evaluate(self, metrics: dict[str, float]) -> None:
        record_depth_accuracy(self.model, metrics)

    def save_pretrained(self, model, path) -> None:
        model.save_pretrained(path)


build = partial(build_task, task_class=Eagle3Task)
main = entry_point(Eagle3Recipe, build, __doc__)


if __name__ == "__main__":
    main()
