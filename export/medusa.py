"""Medusa heads in the official layout (FasterDecoding/Medusa ``medusa/model/medusa_model.py``).

``MedusaModel.from_pretrained(DIR)`` reads ``config.json`` (``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``) and ``torch.load``s ``medusa_lm_head.pt`` into
``medusa_head``: a ModuleList of ``Sequential(ResBlock * medusa_num_layers, Linear(h, vocab,
bias=False))``, so the keys are ``K.J.linear.{weight,bias}`` and ``K.{num_layers}.weight``, every
head with its own full-vocabulary LM head. Two limits of that layout: no draft vocabulary
(every head scores the whole vocabulary), and ``[ResBlock(h)] * medusa_num_layers`` repeats one
block object, so heads with more than one residual block cannot be represented.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from draftsmith.checkpoint_files import load_torch
from draftsmith.errors import CheckpointError
from draftsmith.export.common import Source, Target, export_block, refuse, rename_blocks, write_config
from draftsmith.heads.exported import EXPORT_KEY

NAME = "medusa"
HEADS_FILE = "medusa_lm_head.pt"  # the layout's weights
BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")  # its residual blocks: medusa_head.K.J
BLOCK_NAME = "{0}.{1}.linear.{2}"
MAX_HEADS = 5  # MedusaConfig's default head count, what the official code and its released heads use
MIN_HEADS = 4  # the depth of its default tree, mc_sim_7b_63 (medusa_choices.py)
BASE_MODEL_TYPES = ("llama", "mistral")  # what MedusaModel.from_pretrained dispatches on


def why_not(kind: str) -> str:
    """Why this format cannot hold ``kind`` drafters."""
    return "the official Medusa layout holds Medusa heads only"


def export(source: Source, target: Target, out: Path, tree: dict, blocks: re.Pattern) -> list[str]:
    """Write the official Medusa folder (loaded with ``MedusaModel.from_pretrained``; ``blocks``:
    the kind's names of its residual blocks' weights)."""
    config, state = source.config, source.state
    if target.saved_config.get("model_type") not in BASE_MODEL_TYPES:
        raise refuse(
            NAME,
            source.kind,
            f"its target is a {target.saved_config.get('model_type')!r} model and the official "
            f"MedusaModel builds its base model as {' or '.join(BASE_MODEL_TYPES)} only; "
            "use --format vllm-medusa",
        )
    if config["num_heads"] > MAX_HEADS:
        raise refuse(
            NAME,
            source.kind,
            f"it has {config['num_heads']} heads; the official Medusa code is built around "
            f"{MAX_HEADS} (MedusaConfig's default, its released heads) and loads head weights "
            "with strict=False, so a head count it does not expect silently leaves heads "
            f"unused or random; train at most {MAX_HEADS} heads or use --format vllm-medusa",
        )
    if state["draft_vocab"].numel() < config["vocab_size"]:
        raise refuse(
            NAME,
            source.kind,
            "it drafts over a reduced vocabulary and the official layout has none; "
            "use --format vllm-medusa (token_map)",
        )
    if config["num_layers"] > 1:
        raise refuse(
            NAME,
            source.kind,
            f"its heads have {config['num_layers']} residual blocks and the official "
            "MedusaModel repeats one block object per head; use --format vllm-medusa",
        )
    if config["num_heads"] < MIN_HEADS:
        print(
            f"warning: {config['num_heads']} Medusa heads: the official default tree (mc_sim_7b_63) is {MIN_HEADS} "
            f"deep; pass medusa_generate a medusa_choices tree at most {config['num_heads']} deep",
            file=sys.stderr,
        )
    layers = config["num_layers"]
    tensors = {name: value.contiguous() for name, value in rename_blocks(state, blocks, BLOCK_NAME).items()}
    shared = (
        target.model.get_output_embeddings().weight.detach().to(source.dtype) if config["lm_head"] == "shared" else None
    )
    for k in range(config["num_heads"]):
        tensors[f"{k}.{layers}.weight"] = (shared if shared is not None else state["lm_weight"][k]).contiguous()
    torch.save(tensors, out / HEADS_FILE)
    write_config(
        out,
        {
            "medusa_num_heads": config["num_heads"],
            "medusa_num_layers": layers,
            "base_model_name_or_path": target.verifier_name,
            **export_block(source, NAME),
        },
    )
    return [f"python -c \"from medusa.model.medusa_model import MedusaModel; MedusaModel.from_pretrained('{out}')\""]


def read(folder: Path, config: dict, block_name: str) -> dict[str, torch.Tensor]:
    """The weights of the official Medusa folder ``folder`` (its ``config``) under the kind's names
    (``block_name``: its residual blocks' template), with the per-head LM heads stacked where the
    drafter had its own and the draft vocabulary (always the whole one in this layout)."""
    if "medusa_num_heads" not in config:
        raise CheckpointError(f"{folder}: config.json says it is a {NAME} export but has no medusa_num_heads")
    tensors = load_torch(folder / HEADS_FILE)
    own = config[EXPORT_KEY]["config"]
    layers = config["medusa_num_layers"]
    state = rename_blocks(tensors, BLOCK, block_name)
    if own["lm_head"] == "copy":
        state["lm_weight"] = torch.stack([tensors[f"{k}.{layers}.weight"] for k in range(config["medusa_num_heads"])])
    state["draft_vocab"] = torch.arange(own["vocab_size"])
    return state
