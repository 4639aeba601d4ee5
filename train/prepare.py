"""What a training run reads before its loop starts: the recipe's target (whole or head-only),
its tokenised data (after self-distillation where the recipe asks), the target layers a fused head
reads and where the target's features come from (:class:`~draftsmith.data_prep.features.FeatureSource`,
what the data preparation is given of the recipe). The command line is :mod:`draftsmith.train.cli`.
"""

from __future__ import annotations

import functools

from transformers import AutoConfig

from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import FeatureSource
from draftsmith.data_prep.regenerate import prepare_data_config
from draftsmith.data_prep.vllm_features import prepare_with_vllm, resolve_engine
from draftsmith.heads.aux_layers import resolve_aux_layers
from draftsmith.kinds import Features, for_recipe
from draftsmith.target import load_target, resolve_target
from draftsmith.timing import stage


def features(recipe) -> Features:
    """What of the target the kind ``recipe`` trains reads, as that kind declares it (:class:`Features`)."""
    return for_recipe(recipe.drafter.kind).features


def feature_source(recipe) -> FeatureSource:
    """What the data preparation needs of ``recipe`` to find, fill or serve its target features:
    the target and data sections, ``drafter.features`` and ``drafter.features_dir`` (online for
    kinds that read no feature rows)."""
    rows = features(recipe).rows
    return FeatureSource(
        recipe.target,
        recipe.data,
        recipe.drafter.features if rows else "online",
        recipe.drafter.features_dir if rows else None,
    )


def feature_layers(recipe) -> list[int] | None:
    """The target layers whose states the recipe's head fuses (``drafter.aux_layers``, checked,
    or the default ``[2, N/2, N-3]``), or None for kinds that read no fused layers."""
    if features(recipe).hidden != "aux":
        return None
    num_layers = AutoConfig.from_pretrained(resolve_target(recipe.target.name, "target.name")).num_hidden_layers
    return resolve_aux_layers(recipe.drafter.aux_layers, num_layers)


def target_and_data(recipe, layers: list[int] | None = None):
    """``(target, tokenizer, data, full_target)``: the recipe's target (frozen), its tokenizer and
    the tokenised train/held-out set, after self-distillation when ``data.regenerate`` asks for it.

    Where the features come from a store or a server (``drafter.features`` offline or served) the
    target is head-only (:func:`~draftsmith.target.load_target` with ``head_only``: embeddings, LM head, final
    norm) and ``full_target()`` loads the whole one only if something has to run it (the ``hf``
    engines); with ``data.features.engine`` vllm the store is filled first (``layers``: the head's
    aux layers), in the same vLLM job as the regeneration. Online: the whole target, and
    ``full_target()`` returns it."""
    name, dtype, template = recipe.target.name, recipe.target.dtype, recipe.target.chat_template
    field, source = "target.name", feature_source(recipe)
    with stage("train: load target and tokenise data"):
        if source.mode == "online":
            target, tokenizer = load_target(name, dtype, chat_template=template, field=field)
            full_target = lambda: target  # noqa: E731 (the loader's stand-in: nothing more to load)
        else:
            target, tokenizer = load_target(name, dtype, chat_template=template, field=field, head_only=True)
            full_target = functools.cache(lambda: load_target(name, dtype, chat_template=template, field=field)[0])
            if source.mode == "offline" and resolve_engine(recipe.data.features.engine) == "vllm":
                prepare_with_vllm(source, layers, target, tokenizer, full_target)
        prepared = prepare_data_config(recipe.data, target, name, tokenizer, full_target=full_target)
        data, _ = build_dataset(prepared, tokenizer)
    return target, tokenizer, data, full_target
