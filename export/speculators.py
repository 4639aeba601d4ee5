"""EAGLE-3-family heads in the format of vLLM's ``speculators`` library (0.9.0), which vLLM loads directly.

Every field and weight name below is read by ``speculators`` 0.9.0 (``config.py``,
``models/eagle3/{config,core}.py``, ``model.py``) or by vLLM 0.33.0's bridge
(``transformers_utils/configs/speculators/{base,algos}.py``, ``models/llama_eagle3.py``):

- ``Eagle3SpeculatorConfig``: ``transformer_layer_config`` (the draft layers' config,
  ``num_hidden_layers`` the head's layer count, ``llama`` or ``qwen3`` only: speculators'
  ``model_classes``; both libraries build layer 0 over ``[embedding ; hidden]`` and layers 1.. as
  the verifier's plain decoder layers, the head's own layout), ``draft_vocab_size``,
  ``norm_before_residual`` (written always: vLLM defaults it to True when absent),
  ``transformer_layer_config.num_aux_hidden_states`` (vLLM sizes ``fc`` from it, default 3),
  ``eagle_aux_hidden_state_layer_ids`` (HF ``hidden_states[L]``, the input of decoder layer L, as
  draftsmith's ``aux_layers``), ``speculators_config.verifier.name_or_path`` (the target's hub id:
  ``vllm serve EXPORT`` loads the verifier from it and refuses a local path, and a path breaks on
  another machine; the local folder stays in draftsmith's own record).
- Weights are draftsmith's names unchanged (the head was written with speculators' names:
  ``layers.N.*`` for every layer) plus
  ``embed_tokens.weight`` from the target (speculators' own checkpoints carry it; as the target's
  embedding module computes it, e.g. Gemma's scaled by ``embed_scale``). ``d2t`` (int64,
  target id = draft id + d2t[draft id]) and ``t2d`` (bool over the target vocabulary) are written
  only for a reduced draft vocabulary: with a full one neither library registers them.

Heads drafting the chain in one pass with a learned mask token (``parallel=True``) add a
``mask_token_id``; vLLM serves them as ``eagle3`` with ``parallel_drafting: true``. A kind's
declaration (:mod:`draftsmith.plugins`) picks the converter and the architecture name.

speculators 0.9.0 has no EAGLE-1 or Medusa model (its EAGLE family starts at EAGLE-3), so EAGLE-1
heads serve through ``--format sglang``.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.export.common import (
    Source,
    Target,
    ascending_aux_layers,
    export_block,
    refuse,
    write_config,
    write_weights,
)
from draftsmith.heads.base import embedding_table
from draftsmith.heads.exported import SPECULATORS_EMBED
from draftsmith.kinds import registered

NAME = "speculators"
VERSION = "0.9.0"
LAYER_TYPES = ("llama", "qwen3")  # speculators 0.9.0 models/eagle3/model_definitions.model_classes
VOCAB_MAPS = ("d2t", "t2d")


def why_not(kind: str) -> str:
    """Why this format cannot hold ``kind`` drafters (a kind may say better: ``DrafterKind.refused``)."""
    held = [name for name, declared in registered().items() if NAME in declared.formats]
    return f"speculators {VERSION} has models for {', '.join(held)} only (of draftsmith's drafter kinds)"


def check_aux_layers(source: Source) -> None:
    """Refuse a head reading the target's last layer output, which vLLM captures at another point."""
    num_layers = source.record.get("num_hidden_layers")
    if num_layers in source.config["aux_layers"]:
        # HF's hidden_states[N] is the last layer's output after the final norm; vLLM's capture at
        # layer N is the residual stream before it: the head would be served other features.
        raise refuse(
            NAME,
            source.kind,
            f"it reads aux layer {num_layers}, the target's last layer output after its "
            f"final norm, which vLLM captures before the norm; train with aux layers "
            f"below {num_layers} (default [2, N/2, N-3])",
        )


def speculators_config(source: Source, target: Target, tokens: int) -> dict:
    """The ``speculators_config`` block: the proposal method (greedy, ``tokens`` per step) and the verifier."""
    return {
        "algorithm": source.kind,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": target.verifier_name, "architectures": target.architectures},
    }


def export_eagle3(
    source: Source,
    target: Target,
    out: Path,
    tree: dict,
    architecture: str = "Eagle3Speculator",
    parallel: bool = False,
) -> list[str]:
    """Write the speculators folder of an EAGLE-3-family head; returns the vLLM command that serves it.

    ``parallel``: the head drafts its chain in one pass over a learned mask token
    (``mask_token_id`` in the config, ``parallel_drafting`` in the serve command)."""
    check_aux_layers(source)
    config, tensors = ascending_aux_layers(source)
    layer = target.engine_layer_config(config["target_config"])
    if layer.get("model_type") not in LAYER_TYPES:
        raise refuse(
            NAME,
            source.kind,
            f"its layer is a {layer.get('model_type')!r} layer and speculators {VERSION} "
            f"builds EAGLE-3 layers of {' and '.join(LAYER_TYPES)} only",
        )
    layer["num_hidden_layers"] = config["num_layers"]
    layer["tie_word_embeddings"] = False  # the head's LM head is its own, never the embedding
    # vLLM builds its EAGLE-3 layer config from this dict and sizes fc from num_aux_hidden_states
    # (else from an eagle_config, else 3): without it any other number of aux layers fails to load.
    layer["num_aux_hidden_states"] = len(config["aux_layers"])
    if config["draft_vocab_size"] == layer["vocab_size"]:
        for name in VOCAB_MAPS:
            tensors.pop(name)
    # P-EAGLE's table is the head's own, trained (mask row included); EAGLE-3's is the target's.
    own = tensors.get(SPECULATORS_EMBED)
    tensors[SPECULATORS_EMBED] = (own if own is not None else embedding_table(target.model)).detach()
    tensors[SPECULATORS_EMBED] = tensors[SPECULATORS_EMBED].to(target.dtype)
    if parallel and "mask_embedding" in tensors:  # a checkpoint from before the table trained: its mask row
        tensors[SPECULATORS_EMBED] = tensors[SPECULATORS_EMBED].clone()
        tensors[SPECULATORS_EMBED][config["mask_token_id"]] = tensors.pop("mask_embedding").to(target.dtype)
    fields = {
        "architectures": [architecture],
        "speculators_model_type": source.kind,
        **({"mask_token_id": config["mask_token_id"]} if parallel else {}),
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "eagle_aux_hidden_state_layer_ids": list(config["aux_layers"]),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
    }
    write_folder(source, target, out, tree, config, layer, fields, tensors)
    return [vllm_command(target, out, "eagle3", tree["depth"], {"parallel_drafting": True} if parallel else {})]


def write_folder(
    source: Source, target: Target, out: Path, tree: dict, config: dict, layer: dict, fields: dict, tensors: dict
) -> None:
    """A speculators folder: ``config.json`` with a model's own ``fields`` and what every speculators
    drafter config holds (version, ``transformer_layer_config`` ``layer``, draft vocabulary size, the
    proposal and verifier, draftsmith's export record), and ``model.safetensors`` with ``tensors``."""
    write_config(
        out,
        {
            **fields,
            "speculators_version": VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": None,
            "speculators_config": speculators_config(source, target, tree["depth"]),
            **export_block(source, NAME, config),
        },
    )
    write_weights(out, tensors, NAME)


def vllm_command(target: Target, out: Path, method: str, depth: int, extra: dict) -> str:
    """The ``vllm serve`` line that serves the folder ``out`` as ``method`` drafting ``depth`` tokens."""
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": depth, **extra})
    return f"vllm serve {target.folder} --speculative-config '{spec}'"
