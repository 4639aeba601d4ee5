"""Medusa heads in the layout of vLLM's Medusa loader (vLLM 0.32.0; 0.33.0 no longer has Medusa).

Names and fields come from vLLM 0.32.0 ``model_executor/models/medusa.py`` (``Medusa``,
registered as ``MedusaModel``) and ``transformers_utils/configs/medusa.py`` (``MedusaConfig``,
``model_type: medusa``): ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers``
(residual blocks per head), ``truncated_vocab_size``, ``medusa_fc_bias`` (draftsmith's blocks have
biases), ``original_lm_head``. Weights: ``blocks.K.layers.J.{weight,bias}``; then either one
``lm_head.weight`` shared by all heads (``original_lm_head: true``: draftsmith's ``lm_head: shared``,
the target's LM head written in) or ``lm_heads.K.weight`` per head (``lm_head: copy``).
A reduced draft vocabulary is vLLM's ``token_map`` (the token ids) with ``truncated_vocab_size``;
vLLM cuts a full-vocabulary LM head down to those rows, so it works with a shared LM head only
(per-head LM heads are built at the full vocabulary size).
``logit_scale`` (``Medusa.__init__``: ``LogitsProcessor(..., getattr(config, "logit_scale", 1.0))``)
is the target's (:func:`~draftsmith.target.logit_scale`) for a shared LM head, which draftsmith
scales at run time, and 1.0 for per-head ones, which hold it in their weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from draftsmith.checkpoint_files import load_tensors
from draftsmith.errors import CheckpointError
from draftsmith.export.common import (
    Source,
    Target,
    export_block,
    refuse,
    rename_blocks,
    write_config,
    write_weights,
)
from draftsmith.target import logit_scale

NAME = "vllm-medusa"
VERSION = "0.32.0"
BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")  # vLLM's residual blocks
BLOCK_NAME = "blocks.{0}.layers.{1}.{2}"


def why_not(kind: str) -> str:
    """Why this format cannot hold ``kind`` drafters."""
    return "vLLM's Medusa loader holds Medusa heads only"


def unservable(lm_head: str, reduced_vocab: bool) -> str | None:
    """Why vLLM cannot serve Medusa heads trained with ``lm_head`` (``shared``/``copy``) over a
    reduced draft vocabulary or not, or None when it can."""
    if reduced_vocab and lm_head != "shared":
        return (
            "its per-head LM heads cover a reduced draft vocabulary, and vLLM builds per-head LM heads at the "
            "full vocabulary size (its token_map works with a shared LM head only); train with lm_head: shared "
            "and draft_vocab_size: null"
        )
    if reduced_vocab:
        # Found by serving one: Medusa.load_weights sets token_map but leaves it out of the names it
        # reports loaded, so vLLM's weight check refuses every checkpoint that has one.
        return (
            f"it drafts over a reduced vocabulary, which vLLM {VERSION} cannot load (its Medusa loader does not "
            "report token_map as loaded and the engine stops with 'weights were not initialized from checkpoint: "
            "{'token_map'}'); train with draft_vocab_size: null"
        )
    return None


def export(source: Source, target: Target, out: Path, tree: dict, blocks: re.Pattern) -> list[str]:
    """Write the vLLM Medusa folder; returns the vLLM command that serves it (``blocks``: the
    kind's names of its residual blocks' weights)."""
    config, state = source.config, source.state
    shared = config["lm_head"] == "shared"
    draft_vocab = state["draft_vocab"]
    reduced = draft_vocab.numel() < config["vocab_size"]
    why = unservable(config["lm_head"], reduced)
    if why:
        raise refuse(NAME, source.kind, why)
    tensors = rename_blocks(state, blocks, BLOCK_NAME)
    if shared:
        tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().to(source.dtype)
    else:
        for k, weight in enumerate(state["lm_weight"]):
            tensors[f"lm_heads.{k}.weight"] = weight
    if reduced:
        tensors["token_map"] = draft_vocab
    write_config(
        out,
        {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"],
            "num_heads": config["num_heads"],
            "num_hidden_layers": config["num_layers"],
            "truncated_vocab_size": int(draft_vocab.numel()),
            "medusa_fc_bias": True,
            "original_lm_head": shared,
            "logit_scale": logit_scale(target.model.config) if shared else 1.0,
            **export_block(source, NAME),
        },
    )
    write_weights(out, tensors, NAME)
    spec = (
        f'{{"method": "medusa", "model": "{out}", "num_speculative_tokens": {min(tree["depth"], config["num_heads"])}}}'
    )
    return [f"vllm serve {target.folder} --speculative-config '{spec}'  # vLLM <= {VERSION}"]


def read(folder: Path, config: dict, block_name: str) -> dict[str, torch.Tensor]:
    """The weights of the vLLM Medusa folder ``folder`` (its ``config``) under the kind's names
    (``block_name``: its residual blocks' template), with the per-head LM heads stacked and the
    draft vocabulary (all tokens without a ``token_map``)."""
    if config.get("model_type") != "medusa":
        raise CheckpointError(f"{folder}: config.json says it is a {NAME} export but its model_type is not medusa")
    tensors = load_tensors(folder / "model.safetensors")
    state = rename_blocks(tensors, BLOCK, block_name)
    if not config["original_lm_head"]:
        state["lm_weight"] = torch.stack([tensors[f"lm_heads.{k}.weight"] for k in range(config["num_heads"])])
    state["draft_vocab"] = tensors.get("token_map", torch.arange(config["vocab_size"]))
    return state
