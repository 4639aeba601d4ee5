"""Train Medusa heads: ``accelerate launch train/medusa.py recipes/smollm2-medusa.yaml [--resume] [--key value]``.

Medusa-1 (``drafter.lora.enabled: false``): the target is frozen; head k (0-based) at position i
predicts token i+k+2 with cross-entropy on assistant tokens, weighted ``head_decay ** k``.
Hidden states come from the target inside the step (``online``) or from the offline feature
cache that EAGLE training also uses (``offline``).

Medusa-2 (``drafter.lora.enabled: true``): LoRA adapters on the target (``peft``) train jointly
with the heads. The target keeps its own behaviour through ``lora.target_loss``: ``distill``
(KL from the frozen target, adapters disabled, to the tuned one) or ``lm`` (next-token
cross-entropy on the data; use self-distilled data, ``data.regenerate``). The heads warm up
alone until ``lora.start_step``; heads and adapters have separate learning rates. Checkpoints
hold the heads plus ``adapter/``; the engine verifies with the target with the adapter attached (unmerged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.config import COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE
from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.feature_sets import training_sets
from draftsmith.data_prep.packing import same_segment, target_inputs
from draftsmith.heads.medusa import TOP_K_RECORDED, MedusaHeads, head_positions, top_k_hits
from draftsmith.heads.vocab import draft_vocab_for
from draftsmith.recipe import DECAY, DRAFT_VOCAB, DrafterConfig, LoraConfig, Recipe
from draftsmith.target import final_logits
from draftsmith.train.cli import entry_point
from draftsmith.train.objectives import objective_rows, parse_objective
from draftsmith.train.prepare import feature_source, target_and_data


@dataclass
class LoraSettings(LoraConfig):
    """Medusa-2: LoRA on the target, trained with the heads."""

    enabled: bool = False  # Medusa-2: train LoRA adapters on the target with the heads
    learning_rate: Annotated[float, POSITIVE] = 5e-5  # the heads use training.learning_rate
    start_step: Annotated[int, NON_NEGATIVE_INT] = 0  # optimiser steps the heads train alone before the adapters join
    # keeps the tuned target faithful: KL from the frozen target, or LM loss
    target_loss: Literal["distill", "lm"] = "distill"
    target_loss_weight: Annotated[float, NON_NEGATIVE] = 1.0  # weight of that loss


@dataclass
class MedusaDrafterConfig(DrafterConfig):
    """The Medusa heads and their loss."""

    kind: str = "medusa"
    num_heads: Annotated[int, COUNT] = 4  # heads; head k predicts the token k+2 positions ahead
    num_layers: Annotated[int, NON_NEGATIVE_INT] = 1  # residual blocks per head
    lm_head: Literal["shared", "copy"] = "shared"  # the target's LM head by reference, or a trainable copy per head
    # None: the full vocabulary; N: the N most frequent assistant tokens
    draft_vocab_size: Annotated[int, DRAFT_VOCAB] | None = None
    head_decay: Annotated[float, DECAY] = 0.8  # head k's loss weight is head_decay ** k
    objective: str | dict[str, float] | None = None  # null: CE on the data's tokens (Medusa's); else as EAGLE's
    # target hidden states computed in each step, cached on disk first, or served (data.features.server)
    features: Literal["online", "offline", "served"] = "online"
    features_dir: str | None = None  # offline cache (default: under the draftsmith cache, shared with EAGLE)
    lora: LoraSettings = field(default_factory=LoraSettings)

    def validate(self) -> None:
        if self.objective is not None:
            parse_objective(self.objective)
        if self.lora.enabled and self.features != "online":
            raise ValueError(
                "drafter.features must be 'online' with drafter.lora.enabled: the tuned target's "
                "hidden states change as it trains"
            )


@dataclass
class MedusaRecipe(Recipe):
    drafter: MedusaDrafterConfig = field(default_factory=MedusaDrafterConfig)


class JointMedusa(nn.Module):
    """Medusa-2's trainable module: the LoRA-wrapped target and the heads, run in one forward."""

    def __init__(self, target, heads: MedusaHeads):
        super().__init__()
        self.target, self.heads = target, heads

    def forward(self, batch: dict, positions):
        """The tuned target's last hidden states over ``batch`` and the heads' logits at ``positions``."""
        decoder = self.target.get_base_model().get_decoder()
        hidden = decoder(**target_inputs(batch, decoder)).last_hidden_state
        return hidden, self.heads(hidden, positions)


class MedusaTask:
    """Medusa-1 or Medusa-2 loss over a target."""

    def __init__(self, recipe: MedusaRecipe, target, heads: MedusaHeads):
        self.cfg = recipe.drafter
        self.recipe = recipe
        self.heads = heads
        self.latest_eval: dict[str, float] = {}
        self.objective = parse_objective(self.cfg.objective) if self.cfg.objective is not None else None
        if self.cfg.lora.enabled:
            from peft import get_peft_model

            peft_target = get_peft_model(target, self.cfg.lora.peft_config())
            self.target = peft_target
            self.model = JointMedusa(peft_target, heads)
        else:
            self.target = target
            self.model = heads

    collate = staticmethod(pad_batch)

    def param_groups(self) -> list[dict]:
        groups = [{"params": list(self.heads.parameters()), "name": "heads"}]
        if self.cfg.lora.enabled:
            adapters = [p for p in self.target.parameters() if p.requires_grad]
            groups.append(
                {
                    "params": adapters,
                    "lr": self.cfg.lora.learning_rate,
                    "name": "lora",
                    "start_step": self.cfg.lora.start_step,
                }
            )
        return groups

    def loss(self, model, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        positions, labels = head_positions(batch, self.cfg.num_heads)
        metrics: dict[str, float] = {}
        if self.cfg.lora.enabled:
            hidden, head_logits = model(batch, positions)
            target_loss = self._target_loss(hidden, batch, metrics)
        else:
            with torch.no_grad():
                decoder = self.target.get_decoder()
                hidden = (
                    batch["hidden"] if "hidden" in batch else decoder(**target_inputs(batch, decoder)).last_hidden_state
                )
            head_logits = model(hidden.to(next(self.heads.parameters()).dtype), positions)
            target_loss = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for k, (logits, gold) in enumerate(zip(head_logits, labels)):
            draft_gold = self.heads.to_draft_ids(gold)
            known = draft_gold >= 0  # labels outside the draft vocabulary cannot be learnt, only missed
            if self.objective is None:
                ce = F.cross_entropy(logits[known].float(), draft_gold[known], reduction="sum")
            else:
                # Head k's label (token i+k+2) is what the target predicts from position i+k+1.
                probs = self.target_probs(hidden.flatten(0, 1)[positions[k] + k + 1])
                ce = objective_rows(self.objective, logits, probs).sum()
            total = total + self.cfg.head_decay**k * ce / max(1, len(gold))
            with torch.no_grad():
                ranks = min(TOP_K_RECORDED if not training else 5, logits.shape[-1])
                hits = top_k_hits(self.heads, logits, gold, ranks)
            name = f"head{k + 1}"
            metrics[f"{name}/tokens"] = float(len(gold))
            metrics[f"{name}/ce"] = float(ce.detach())
            for r in (1, 5) if training else range(1, ranks + 1):
                metrics[f"{name}/top{r}"] = float(hits[r - 1]) if len(gold) else 0.0
        if target_loss is not None:
            total = total + self.cfg.lora.target_loss_weight * target_loss
        metrics["tokens"] = float(len(labels[0]))
        metrics["loss"] = float(total.detach()) * metrics["tokens"]
        return total, metrics

    @torch.no_grad()
    def target_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token distribution over the heads' draft vocabulary, fp32, from rows
        of its last hidden states (renormalised over that vocabulary, as EAGLE's)."""
        lm_head = self.target.get_output_embeddings()
        weight = lm_head.weight.index_select(0, self.heads.draft_vocab.to(lm_head.weight.device))
        logits = F.linear(hidden.detach().to(weight.dtype), weight)
        return final_logits(self.target.config, logits).softmax(-1)

    def _target_loss(self, hidden: torch.Tensor, batch: dict, metrics: dict) -> torch.Tensor:
        """How far the tuned target moved, on assistant positions (next-token predictions)."""
        mask = torch.zeros_like(batch["loss_mask"])
        mask[:, :-1] = batch["loss_mask"][:, 1:] & same_segment(batch["attention_mask"], 1)  # within a conversation
        rows = hidden[mask]
        lm_head = self.target.get_output_embeddings()
        config = self.target.get_base_model().config  # the target's logit scale or soft cap applies to both sides
        # fp32 LoRA adapters can lift the tuned hidden states out of the target's dtype.
        logits = final_logits(config, lm_head(rows.to(lm_head.weight.dtype)).float())
        count = max(1, rows.shape[0])
        if self.cfg.lora.target_loss == "lm":
            gold = batch["input_ids"][:, 1:][mask[:, :-1]]
            loss = F.cross_entropy(logits, gold, reduction="sum")
            reference = None
        else:
            with torch.no_grad(), self.target.disable_adapter():
                decoder = self.target.get_base_model().get_decoder()
                base = decoder(**target_inputs(batch, decoder)).last_hidden_state
                reference = final_logits(config, lm_head(base[mask].to(lm_head.weight.dtype)).float())
            loss = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum")
        metrics["target/tokens"] = float(rows.shape[0])
        metrics["target/loss"] = float(loss.detach())
        if reference is not None:
            metrics["target/argmax_agreement"] = float((logits.argmax(-1) == reference.argmax(-1)).sum())
        return loss / count

    def on_evaluate(self, metrics: dict[str, float]) -> None:
        self.latest_eval = metrics

    def head_accuracy(self) -> list[list[float]] | None:
        """Held-out top-1..top-10 accuracy of each head from the latest evaluation."""
        rows = []
        for k in range(self.cfg.num_heads):
            row = [self.latest_eval.get(f"eval/head{k + 1}/top{r}") for r in range(1, TOP_K_RECORDED + 1)]
            if any(v is None for v in row):
                return None
            rows.append(row)
        return rows

    def save_pretrained(self, model, path: Path) -> None:
        heads = model.heads if isinstance(model, JointMedusa) else model
        heads.head_accuracy = self.head_accuracy() or heads.head_accuracy
        heads.save_pretrained(path)
        if isinstance(model, JointMedusa):
            model.target.save_pretrained(str(Path(path) / "adapter"))


def build(recipe: MedusaRecipe):
    """Target, tokenised data (or features), heads and task for ``recipe``."""
    target, tokenizer, data, full_target = target_and_data(recipe)
    cfg = recipe.drafter
    draft_vocab = draft_vocab_for(cfg.draft_vocab_size, data["train"], tokenizer, target.config.vocab_size)
    torch.manual_seed(recipe.training.seed)
    heads = MedusaHeads.for_target(target, recipe.target.name, cfg.num_heads, cfg.num_layers, cfg.lm_head, draft_vocab)
    train_set, eval_set = training_sets(feature_source(recipe), target, tokenizer, data, full_target=full_target)
    return MedusaTask(recipe, target, heads), train_set, eval_set


main = entry_point(MedusaRecipe, build, __doc__)


if __name__ == "__main__":
    main()
