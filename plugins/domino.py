"""Domino drafters: a DFlash backbone drafting the block in one pass and a GRU correction head
adding, at each depth, logits from the tokens drafted above it; trained by ``train/domino.py``.

Exported as the folder its serving engine and trainers read (SpecForge's
``configs/qwen3-8b-domino.json`` and ``modeling/draft/domino.py``, ModelOpt's ``DominoExporter``
in ``torch/export/plugins/hf_spec_export.py``; SGLang's ``DFlashDraftModel`` loads it when
``dflash_config.projector_type`` is ``domino``): a Qwen3 config with ``block_size``,
``num_target_layers``, a ``dflash_config`` (``mask_token_id``, ``target_layer_ids``,
``projector_type``, ``pure_draft_prefix_len``, ``emb_dim``, ``gru_hidden_dim``, ``shift_label``)
and ``emb_dim`` again at the top, and ``model.safetensors`` with the backbone's and the head's
weights under the reference's flat names, no embedding and no LM head (the target's are used).
``target_layer_ids`` count as the reference's ``hidden_states[id + 1]``: one less than draftsmith's
aux layers.

vLLM cannot serve it: vLLM 0.32's DFlash model (``qwen3_dflash.py``) has no correction head, and
speculators 0.9 has no Domino model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from draftsmith.config import COUNT, Range
from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters import domino
from draftsmith.export import sglang
from draftsmith.export.common import (
    Source,
    Target,
    ascending_aux_layers,
    export_block,
    refuse,
    write_config,
    write_weights,
)
from draftsmith.heads.dflash import draft_config, weak_mask_row
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.train import domino as training

ARCHITECTURE = "DFlashDraftModel"  # SGLang's entry class for the DFlash family, Domino included
PROJECTOR = "domino"
# SGLang's DFlash config parser refuses pure_draft_prefix_len 2 (its test_invalid_domino_config_fails_fast).
MAX_PURE_PREFIX = 1
NOT_SERVED = (
    "vLLM 0.32 cannot serve Domino drafters: its DFlash model (qwen3_dflash.py) has no GRU correction head and "
    "speculators 0.9 no Domino model; serve the export in SGLang (--speculative-algorithm DFLASH), or compare "
    "in draftsmith's engine (eval/run.py)"
)


def to_sglang(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the reference's Domino folder; returns the SGLang command that serves it."""
    config, tensors = ascending_aux_layers(source)
    vocab = config["target_config"]["vocab_size"]
    if config["draft_vocab_size"] != vocab:
        raise refuse(sglang.NAME, source.kind, "its draft vocabulary is reduced; Domino's loaders score the full one")
    if config["pure_draft_prefix_len"] > MAX_PURE_PREFIX:
        raise refuse(
            sglang.NAME,
            source.kind,
            f"pure_draft_prefix_len {config['pure_draft_prefix_len']}: SGLang's Domino takes at most {MAX_PURE_PREFIX}",
        )
    if min(config["aux_layers"]) < 1:
        raise refuse(
            sglang.NAME,
            source.kind,
            "it reads the target's embedding output (aux layer 0), which the reference's target_layer_ids cannot name",
        )
    model = target.model
    if not torch.equal(tensors["lm_head.weight"].float(), model.get_output_embeddings().weight.detach().float()):
        raise refuse(
            sglang.NAME,
            source.kind,
            "its LM head is not the target's, and Domino's loaders score with the target's; train with train/domino.py",
        )
    weak = weak_mask_row(model.get_input_embeddings().weight, config["mask_token_id"])
    if weak is not None:
        raise refuse(
            sglang.NAME,
            source.kind,
            f"its mask token {config['mask_token_id']}'s embedding row is near zero (never trained), and "
            "the serving engine reads that row",
        )
    layers = config["num_layers"]
    layer = draft_config(AutoConfig.for_model(**config["target_config"]), layers).to_dict()
    layer = {key: value for key, value in layer.items() if key not in ("torch_dtype", "_attn_implementation_autoset")}
    head = {
        "mask_token_id": config["mask_token_id"],
        "target_layer_ids": [layer_id - 1 for layer_id in config["aux_layers"]],
        "projector_type": PROJECTOR,
        "pure_draft_prefix_len": config["pure_draft_prefix_len"],
        "emb_dim": config["emb_dim"],
        "gru_hidden_dim": config["gru_hidden_dim"],
        "shift_label": config["shift_label"],
    }
    write_config(
        out,
        {
            **layer,
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": config["block_size"],
            "num_target_layers": config["target_config"]["num_hidden_layers"],
            "layer_types": ["full_attention"] * layers,
            "rope_theta": layer["rope_parameters"]["rope_theta"],
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "dtype": target.dtype_name,
            "emb_dim": config["emb_dim"],
            "dflash_config": head,
            **export_block(source, sglang.NAME, config),
        },
    )
    # The target's embedding and LM head serve the drafter; the vocabulary maps are the identity.
    dropped = ("lm_head.weight", "d2t", "t2d")
    kept = {name: value.to(target.dtype) for name, value in tensors.items() if name not in dropped}
    write_weights(out, kept, sglang.NAME)
    return [
        f"python -m sglang.launch_server --model-path {target.folder} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}"
    ]


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves no Domino export (:data:`NOT_SERVED`)."""
    raise UsageError(f"{folder}: {NOT_SERVED}")


KIND = DrafterKind(
    name="domino",
    summary="a trained Domino drafter: a DFlash block drafted in one pass, each token's logits corrected by a "
    "GRU over the tokens drafted before it",
    build=domino.build,
    path="checkpoint folder (required)",
    options={
        "depth": Option(
            None,
            "tokens K drafted per step, in one pass over the block (default and most: the block's, "
            "block_size with shift_label, else block_size - 1)",
            COUNT,
        ),
        "correction": Option(
            1,
            "0: draft with the backbone's logits alone (the correction head's ablation; still lossless)",
            Range(0, 1, integer=True),
        ),
    },
    has_distribution=True,
    max_depth=lambda config: config["block_size"] - 1 + int(config["shift_label"]),
    training=Training("domino", training.DominoRecipe, training.main, training.build),
    features=Features("aux", rows=True),
    title="Domino drafter",
    formats={sglang.NAME: to_sglang},
    refused={"speculators": "speculators 0.9 has no Domino model (its DFlash models have no correction head)"},
    serve=serve,
    chain=lambda depth: {"depth": depth},
    builds_on=("dflash",),  # DFlash's block drafter with a correction head
)
