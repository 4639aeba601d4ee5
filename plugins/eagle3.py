"""EAGLE-3 heads: trained by ``train/eagle3.py`` (training-time test), drafting EAGLE-2 dynamic
trees over the target's fused layers, exported to ``speculators`` (vLLM serves it as ``eagle3``) and SGLang.

Its part of the speculators format (``Eagle3SpeculatorConfig``, speculators 0.9.0
``models/eagle3/{config,core}.py``; the frame is :mod:`draftsmith.export.speculators`):
``transformer_layer_config`` is the draft layers' config (``num_hidden_layers`` the head's layer
count, ``llama`` or ``qwen3`` only: speculators' ``model_classes``; layer 0 over ``[embedding ;
hidden]``, layers 1.. the verifier's plain decoder layers), ``num_aux_hidden_states`` (vLLM sizes
``fc`` from it, default 3), ``norm_before_residual`` (written always: vLLM defaults it to True when
absent), ``eagle_aux_hidden_state_layer_ids`` (HF ``hidden_states[L]``, the input of decoder layer
L, as draftsmith's ``aux_layers``), ``fc_norm`` and ``norm_output`` (EAGLE 3.1's options, the
head's; vLLM 0.32 reads both, and ``fc_norm.{i}.weight`` as ``model.fc_norm.{i}``); the head's
weights under its own (speculators') names plus ``embed_tokens.weight``, the target's table (as
the target's embedding module computes it, e.g. Gemma's scaled by ``embed_scale``; read back
without it, the head reading the target's by reference). :func:`write_eagle3_family` writes it
for the kinds built on EAGLE-3, which add their own fields and table (P-EAGLE's, ``plugins/peagle.py``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.engine.drafters.eagle import build_planned, tree_options
from draftsmith.export import sglang, speculators
from draftsmith.export.common import FUSED_COLUMNS, Source, Target, ascending_aux_layers, refuse
from draftsmith.heads.base import embedding_table
from draftsmith.heads.eagle3 import EAGLE31_OPTIONS, Eagle3Head
from draftsmith.heads.exported import EXPORT_KEY
from draftsmith.kinds import DrafterKind, Features, Served, Training
from draftsmith.plugins.eagle import chain
from draftsmith.train import eagle3

PLAN_FALLBACK = {"depth": 6, "top_k": 3, "budget": 12}  # unplanned (no held-out accuracy recorded)
LAYER_TYPES = ("llama", "qwen3")  # speculators 0.9.0 models/eagle3/model_definitions.model_classes


def to_speculators(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the speculators ``eagle3`` folder; returns the vLLM command that serves it."""
    fields = {"architectures": ["Eagle3Speculator"], "speculators_model_type": source.kind}
    return write_eagle3_family(source, target, out, tree, fields)


def target_table(target: Target, config: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """EAGLE-3's embedding table: the target's, as its embedding module computes it (the head reads
    it by reference and ships none of its own)."""
    return embedding_table(target.model).detach().to(target.dtype)


def write_eagle3_family(
    source: Source,
    target: Target,
    out: Path,
    tree: dict,
    fields: dict,
    columns: tuple[str, ...] = FUSED_COLUMNS,
    table: Callable[[Target, dict, dict[str, torch.Tensor]], torch.Tensor] = target_table,
    extra: dict | None = None,
) -> list[str]:
    """Write the speculators folder of an EAGLE-3-family head: EAGLE-3's config after a kind's
    leading ``fields``, and its weights; returns the vLLM command that serves it as ``eagle3`` with
    the speculative config's ``extra`` options.

    ``columns``: the weights in the space of the concatenated aux layers; ``table(target, config,
    weights)``: the embedding table shipped as ``embed_tokens.weight`` (:func:`target_table`, or a
    kind's own, which takes the rows it is built from out of ``weights``)."""
    speculators.check_aux_layers(source)
    config, tensors = ascending_aux_layers(source, columns)
    layer = target.engine_layer_config(config["target_config"])
    if layer.get("model_type") not in LAYER_TYPES:
        raise refuse(
            speculators.NAME,
            source.kind,
            f"its layer is a {layer.get('model_type')!r} layer and speculators {speculators.VERSION} "
            f"builds EAGLE-3 layers of {' and '.join(LAYER_TYPES)} only",
        )
    layer["num_hidden_layers"] = config["num_layers"]
    layer["tie_word_embeddings"] = False  # the head's LM head is its own, never the embedding
    # vLLM builds its EAGLE-3 layer config from this dict and sizes fc from num_aux_hidden_states
    # (else from an eagle_config, else 3): without it any other number of aux layers fails to load.
    layer["num_aux_hidden_states"] = len(config["aux_layers"])
    if config["draft_vocab_size"] == layer["vocab_size"]:
        for name in speculators.VOCAB_MAPS:
            tensors.pop(name)
    tensors[speculators.EMBEDDING] = table(target, config, tensors)
    fields = {
        **fields,
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "eagle_aux_hidden_state_layer_ids": list(config["aux_layers"]),
        "norm_before_fc": False,
        **{key: bool(config.get(key, False)) for key in EAGLE31_OPTIONS},
        "embed_requires_grad": False,
    }
    speculators.write_folder(source, target, out, tree, config, layer, fields, tensors)
    return [speculators.vllm_command(target, out, "eagle3", tree["depth"], extra or {})]


def read_speculators(folder: Path, config: dict) -> dict:
    """The weights of an EAGLE-3 speculators folder (:func:`draftsmith.export.speculators.read`)
    less the target's embedding table, which the head reads by reference; refused where its EAGLE
    3.1 fields, which speculators and vLLM build the drafter from, disagree with draftsmith's
    record, which the engine builds it from: the two would draft differently."""
    record = config.get(EXPORT_KEY, {}).get("config", {})
    for key in EAGLE31_OPTIONS:
        served, ours = bool(config.get(key, False)), bool(record.get(key, False))
        if served != ours:
            raise CheckpointError(
                f"{folder}: config.json says {key}: {str(served).lower()} (what vLLM and speculators build) "
                f"but its {EXPORT_KEY} record says {str(ours).lower()}: export the checkpoint again"
            )
    tensors = speculators.read(folder, config)
    tensors.pop(speculators.EMBEDDING, None)
    return tensors


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves the speculators export as ``eagle3``; the SGLang one is refused, saying which to check."""
    if fmt == sglang.NAME:
        raise UsageError(
            f"{folder}: this is the SGLang layout; vLLM serves EAGLE-3 heads from "
            "`draftsmith-export CKPT --format speculators`: check that export"
        )
    return Served("eagle3", depth) if fmt == speculators.NAME else None


KIND = DrafterKind(
    name="eagle3",
    summary="a trained EAGLE-3 head (fused target layers, training-time test) growing EAGLE-2 dynamic trees",
    build=partial(build_planned, head_class=Eagle3Head, fallback=PLAN_FALLBACK),
    path="checkpoint, speculators or sglang export folder (required)",
    options=tree_options(PLAN_FALLBACK),
    has_distribution=True,
    plan_fallback=PLAN_FALLBACK,
    training=Training("eagle3", eagle3.Eagle3Recipe, eagle3.main, eagle3.build, eagle3.Eagle3Task),
    features=Features("aux", rows=True),
    title="EAGLE-3 head",
    formats={
        speculators.NAME: to_speculators,
        sglang.NAME: partial(sglang.export, algorithm=sglang.SGLANG_EAGLE3),
    },
    readers={speculators.NAME: read_speculators, sglang.NAME: sglang.read},
    serve=serve,
    chain=chain,
    builds_on=("eagle",),  # its drafter and chain are EAGLE-1's (eval/engine/drafters/eagle.py), over fused layers
)
