"""Drafters in the format of vLLM's ``speculators`` library (0.9.0), which vLLM loads directly.

Every field and weight name below is read by ``speculators`` 0.9.0 (``config.py``, ``model.py``)
or by vLLM 0.33.0's bridge (``transformers_utils/configs/speculators/{base,algos}.py``): what every
speculators drafter config holds beside its model's own fields: ``speculators_version``,
``transformer_layer_config`` (the draft layers' config), ``draft_vocab_size``,
``speculators_config`` (the greedy proposal method and the verifier: ``verifier.name_or_path`` is
the target's hub id, since ``vllm serve EXPORT`` loads the verifier from it and refuses a local
path, and a path breaks on another machine; the local folder stays in draftsmith's own record).
Weights keep draftsmith's names (the heads are written with speculators' names); ``d2t`` (int64,
target id = draft id + d2t[draft id]) and ``t2d`` (bool over the target vocabulary) are written
only for a reduced draft vocabulary: with a full one neither library registers them.

This module is the format's one home: what every speculators folder holds (:func:`write_folder`,
the proposal and verifier block, the serve command) and reading one back (:func:`read`). Each kind's
own part (its model's fields, layer config and weights; its reader's extras) is the kind's:
EAGLE-3's in ``plugins/eagle3.py``, P-EAGLE's (EAGLE-3's plus ``mask_token_id``, its own table
and ``parallel_drafting: true``) in ``plugins/peagle.py``, DFlash's and DSpark's in
``plugins/dflash.py`` and ``plugins/dspark.py``.

speculators 0.9.0 has no EAGLE-1 or Medusa model (its EAGLE family starts at EAGLE-3), so EAGLE-1
heads serve through ``--format sglang``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.checkpoint_files import load_tensors
from draftsmith.errors import CheckpointError
from draftsmith.export.common import Source, Target, export_block, refuse, write_config, write_weights
from draftsmith.kinds import registered

NAME = "speculators"
VERSION = "0.9.0"
VOCAB_MAPS = ("d2t", "t2d")  # written only for a reduced draft vocabulary
EMBEDDING = "embed_tokens.weight"  # the draft's embedding table, where its model ships one


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


def read(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    """The weights of the speculators folder ``folder`` (its ``config``) under draftsmith's names,
    with the identity vocabulary maps where a full draft vocabulary wrote none (an embedding table
    the drafter reads from its target by reference is its kind's reader's to leave out)."""
    if "speculators_model_type" not in config:
        raise CheckpointError(f"{folder}: config.json says it is a {NAME} export but has no speculators_model_type")
    tensors = load_tensors(folder / "model.safetensors")
    if VOCAB_MAPS[0] not in tensors:
        vocab = config["transformer_layer_config"]["vocab_size"]
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
        tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return tensors
