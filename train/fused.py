"""What the drafters that read the target's fused layers share in training (EAGLE-3 and its parallel kin).

Each of them reads the hidden states of several target layers (``drafter.aux_layers``) fused by
its ``fc``, scores over a draft vocabulary of the training replies' most frequent tokens, and by
default learns the target's own replies. Their tasks use these functions rather than one another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.data_prep.feature_sets import training_sets
from draftsmith.data_prep.features import layer_states
from draftsmith.data_prep.packing import target_inputs
from draftsmith.heads.vocab import draft_vocab_for
from draftsmith.recipe import DataConfig, Recipe, RegenerateConfig
from draftsmith.timing import stage
from draftsmith.train.prepare import feature_layers, feature_source, target_and_data


def regenerated_data() -> DataConfig:
    """The data section these drafters default to: the target's own replies (``data.regenerate.enabled``)."""
    return DataConfig(regenerate=RegenerateConfig(enabled=True))


@torch.no_grad()
def fused_target_features(target, aux_layers: list[int], batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux, last)``: the target's ``aux_layers`` states concatenated and its last hidden states
    (what its LM head reads), from the batch (offline features) or computed."""
    if "aux" in batch:
        return batch["aux"], batch["hidden"]
    decoder = target.get_decoder()
    return layer_states(decoder, aux_layers, **target_inputs(batch, decoder))


def build_fused(recipe: Recipe, new_head: Callable) -> tuple:
    """``(target, head, train_set, eval_set)`` for ``recipe``: the target and its tokenised data, the
    draft vocabulary, a head from ``new_head(recipe, target, draft_vocab, tokenizer, train_rows)``
    (its initial weights set by ``training.seed``; its LM head frozen unless ``drafter.train_lm_head``)
    and the training and held-out sets, with the target's features cached first when
    ``drafter.features`` is offline."""
    layers = feature_layers(recipe)  # checked before the target loads; the head resolves the same ones
    target, tokenizer, data, full_target = target_and_data(recipe, layers)
    draft_vocab = draft_vocab_for(recipe.drafter.draft_vocab_size, data["train"], tokenizer, target.config.vocab_size)
    torch.manual_seed(recipe.training.seed)  # the head's initial weights: reproducible, and set by the seed
    head = new_head(recipe, target, draft_vocab, tokenizer, data["train"])
    if not recipe.drafter.train_lm_head:
        head.lm_head.weight.requires_grad_(False)
    source = feature_source(recipe)
    with stage(f"train: {source.mode} feature sets"):
        train_set, eval_set = training_sets(source, target, tokenizer, data, head.aux_layers, full_target)
    return target, head, train_set, eval_set


def build_task(recipe: Recipe, task_class: type) -> tuple:
    """``(task, train_set, eval_set)`` for a kind whose ``task_class`` reads the fused layers:
    :func:`build_fused` with the task's ``new_head``, then the task over the target and head."""
    target, head, train_set, eval_set = build_fused(recipe, task_class.new_head)
    return task_class(recipe, target, head), train_set, eval_set
