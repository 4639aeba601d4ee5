"""EAGLE-3 and P-EAGLE heads in the format of vLLM's ``speculators`` library (0.9.0), which vLLM loads directly.

Every field and weight name below is read by ``speculators`` 0.9.0 (``config.py``,
``models/eagle3/{config,core}.py``, ``model.py``) or by vLLM 0.33.0's bridge
(``transformers_utils/configs/speculators/{base,algos}.py``, ``models/llama_eagle3.py``):

- ``Eagle3SpeculatorConfig``: ``transformer_layer_config`` (the draft layer's config, 1 layer,
  ``llama`` or ``qwen3`` only: speculators' ``model_classes``), ``draft_vocab_size``,
  ``norm_before_residual`` (written always: vLLM defaults it to True when absent),
  ``transformer_layer_config.num_aux_hidden_states`` (vLLM sizes ``fc`` from it, default 3),
  ``eagle_aux_hidden_state_layer_ids`` (HF ``hidden_states[L]``, the input of decoder layer L, as
  draftsmith's ``aux_layers``), ``speculators_config.verifier.name_or_path`` (the target's hub id:
  ``vllm serve EXPORT`` loads the verifier from it and refuses a local path, and a path breaks on
  another machine; the local folder stays in draftsmith's own record).
- Weights are draftsmith's names unchanged (the head was written with speculators' names) plus
  ``embed_tokens.weight`` from the target (speculators' own checkpoints carry it). ``d2t`` (int64,
  target id = draft id + d2t[draft id]) and ``t2d`` (bool over the target vocabulary) are written
  only for a reduced draft vocabulary: with a full one neither library registers them.

P-EAGLE heads (``PEagleSpeculatorConfig``, ``models/peagle/{config,core}.py``; vLLM's
``update_peagle``) are EAGLE-3's layout plus ``speculators_model_type: peagle``, a required
``mask_token_id`` and a ``mask_hidden`` weight (``[1, 1, len(aux) * hidden]``, in ``fc``'s input
space, so its blocks follow the aux layers' order as ``fc``'s columns do); ``embed_tokens.weight``
is the head's own trained table, mask token's row included (vLLM keeps a draft embedding that
differs from the target's). vLLM serves them as ``eagle3`` with
``parallel_drafting: true``.

speculators 0.9.0 has no EAGLE-1 or Medusa model (its EAGLE family is ``eagle3`` and ``peagle``), so
EAGLE-1 heads serve through ``--format sglang``.
"""

from __future__ import annotations

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
from draftsmith.heads.dflash import draft_config
from draftsmith.heads.exported import SPECULATORS_EMBED

NAME = "speculators"
KINDS = ("eagle3", "peagle", "dflash")
VERSION = "0.9.0"
LAYER_TYPES = ("llama", "qwen3")  # speculators 0.9.0 models/eagle3/model_definitions.model_classes
VOCAB_MAPS = ("d2t", "t2d")


def why_not(kind: str) -> str:
    if kind == "eagle":
        return (
            f"speculators {VERSION} has no EAGLE-1 model (its EAGLE family is eagle3 and peagle); export "
            "EAGLE-1 heads with --format sglang"
        )
    return (
        f"speculators {VERSION} has models for eagle3, mtp, dflash, dspark, peagle and xpress only; "
        "export Medusa heads with --format vllm-medusa or --format medusa, draft LMs with --format hf"
    )


def export(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the speculators folder; returns the vLLM command that serves it."""
    _check_aux_layers(source)
    return (_export_dflash if source.kind == "dflash" else _export_eagle3)(source, target, out, tree)


def _check_aux_layers(source: Source) -> None:
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


def _speculators_config(source: Source, target: Target, tokens: int) -> dict:
    return {
        "algorithm": source.kind,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": target.verifier_name, "architectures": target.architectures},
    }


def _export_eagle3(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
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
    tensors[SPECULATORS_EMBED] = (own if own is not None else target.model.get_input_embeddings().weight).detach()
    tensors[SPECULATORS_EMBED] = tensors[SPECULATORS_EMBED].to(target.dtype)
    parallel = source.kind == "peagle"
    if parallel and "mask_embedding" in tensors:  # a checkpoint from before the table trained: its mask row
        tensors[SPECULATORS_EMBED] = tensors[SPECULATORS_EMBED].clone()
        tensors[SPECULATORS_EMBED][config["mask_token_id"]] = tensors.pop("mask_embedding").to(target.dtype)
    write_config(
        out,
        {
            "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
            "speculators_model_type": source.kind,
            **({"mask_token_id": config["mask_token_id"]} if parallel else {}),
            "speculators_version": VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": config["draft_vocab_size"],
            "norm_before_residual": bool(config.get("norm_before_residual", False)),
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(config["aux_layers"]),
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
            "speculators_config": _speculators_config(source, target, tree["depth"]),
            **export_block(source, NAME, config),
        },
    )
    write_weights(out, tensors, NAME)
    extra = ', "parallel_drafting": true' if parallel else ""
    spec = f'{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": {tree["depth"]}{extra}}}'
    return [f"vllm serve {target.folder} --speculative-config '{spec}'"]


def _export_dflash(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """speculators' ``dflash``: Qwen3 layers (whatever the target), every layer full attention and
    ``sliding_window_non_causal: true`` so vLLM serves the block bidirectionally as it was trained
    (vLLM applies that flag to every layer and serves causally without it); no embedding (the
    target's, mask row included); the reduced-vocabulary LM head with ``d2t``/``t2d``."""
    from transformers import AutoConfig

    config, tensors = ascending_aux_layers(source)
    vocab = config["target_config"]["vocab_size"]
    if config["draft_vocab_size"] == vocab:
        raise refuse(
            NAME,
            source.kind,
            "its draft vocabulary is the full one: speculators' DFlash model then takes "
            "the verifier's LM head in place of the drafter's trained one; train with "
            "drafter.draft_vocab_size below the vocabulary size",
        )
    layer = draft_config(AutoConfig.for_model(**config["target_config"]), config["num_layers"]).to_dict()
    layer = {key: value for key, value in layer.items() if key not in ("torch_dtype", "_attn_implementation_autoset")}
    layer.update(dtype=target.dtype_name, layer_types=["full_attention"] * config["num_layers"])
    write_config(
        out,
        {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": "dflash",
            "speculators_version": VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": config["draft_vocab_size"],
            "block_size": config["block_size"],
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": list(config["aux_layers"]),
            "mask_token_id": config["mask_token_id"],
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "speculators_config": _speculators_config(source, target, tree["depth"]),
            **export_block(source, NAME, config),
        },
    )
    write_weights(out, tensors, NAME)
    spec = f'{{"method": "dflash", "model": "{out}", "num_speculative_tokens": {tree["depth"]}}}'
    return [f"vllm serve {target.folder} --speculative-config '{spec}'"]
