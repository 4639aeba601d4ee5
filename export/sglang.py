"""EAGLE and EAGLE-3 heads as the draft folder SGLang's ``--speculative-draft-model-path`` takes.

Names and fields come from SGLang 0.5.23: ``srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``),
``srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``), ``srt/speculative/eagle_worker_v2.py``
and ``spec_utils.load_token_map`` (hot-token map), ``srt/models/llama.py``
(``set_eagle3_layers_to_capture``) and ``model_runner_components/spec_aux_hidden_state.py``:

- The config is the target layer's Llama config with ``architectures`` set, ``num_hidden_layers``
  the head's layers and ``tie_word_embeddings: false`` (a tied draft would make its LM head its
  embedding). SGLang shares the target's embedding (and, for EAGLE-1, its LM head) at load time,
  so neither is written.
- EAGLE-1: ``fc.weight``/``fc.bias`` over ``[embedding ; feature]``, ``layers.N.*`` with no input
  norm on layer 0 (as draftsmith's head). A reduced draft vocabulary becomes
  ``hot_token_map.pt`` (the token ids, for ``--speculative-token-map``).
- EAGLE-3: draftsmith's (speculators') names; ``d2t`` gives SGLang the hot-token ids (draft id +
  d2t). ``eagle_config.eagle_aux_hidden_state_layer_ids`` are in SGLang's convention, one less
  than draftsmith's (SGLang captures the input of layer id + 1): a head reading the target's
  last layer output (id N) cannot be expressed. SGLang's layer has no ``norm_before_residual`` and
  no q/k/v bias. vLLM reads the same ``eagle_config`` field with draftsmith's convention, so serve
  vLLM from ``--format speculators``, not from this folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.checkpoint_files import load_tensors, load_torch
from draftsmith.errors import CheckpointError
from draftsmith.export.common import (
    Source,
    Target,
    ascending_aux_layers,
    export_block,
    refuse,
    write_config,
    write_weights,
)
from draftsmith.kinds import registered

NAME = "sglang"
VERSION = "0.5.23"
# SGLang's --speculative-algorithm values draftsmith exports, one per head layout, and their draft model classes.
SGLANG_EAGLE, SGLANG_EAGLE3 = "EAGLE", "EAGLE3"
ALGORITHMS = (SGLANG_EAGLE, SGLANG_EAGLE3)
SGLANG_ARCHITECTURES = {SGLANG_EAGLE: "LlamaForCausalLMEagle", SGLANG_EAGLE3: "LlamaForCausalLMEagle3"}
# EAGLE 3.1's options, read off the draft config by SGLang's EAGLE-3 models that build them (with
# the weights ``fc_norm.{i}.weight``); SGLang releases from before EAGLE 3.1 ignore both.
EAGLE31_FIELDS = ("fc_norm", "norm_output")
SGLANG_HOT_TOKEN_MAP = "hot_token_map.pt"  # an EAGLE-1 head's draft vocabulary (--speculative-token-map)


def why_not(kind: str) -> str:
    """Why this format cannot hold ``kind`` drafters."""
    held = [name for name, declared in registered().items() if NAME in declared.formats]
    return f"SGLang's EAGLE folders hold {', '.join(held)} heads only (of draftsmith's drafter kinds)"


def check_layer(source: Source, layer: dict, algorithm: str) -> None:
    """SGLang's EAGLE layers are Llama layers without biases."""
    if layer.get("model_type") != "llama":
        raise refuse(
            NAME,
            source.kind,
            f"its layer is a {layer.get('model_type')!r} layer; SGLang {VERSION}'s "
            f"{SGLANG_ARCHITECTURES[algorithm]} builds Llama layers",
        )
    if algorithm == SGLANG_EAGLE3 and (layer.get("attention_bias") or layer.get("mlp_bias")):
        raise refuse(NAME, source.kind, f"its layer has biases and SGLang {VERSION}'s EAGLE-3 layer has none")


def export(source: Source, target: Target, out: Path, tree: dict, algorithm: str) -> list[str]:
    """Write the SGLang draft folder for SGLang's ``algorithm`` (:data:`ALGORITHMS`: ``EAGLE``, an
    EAGLE-1 head over the last hidden state; ``EAGLE3``, a head over fused aux layers; the kind's
    declaration says which); returns the SGLang command that serves it.

    ``tree``: ``depth``, ``top_k`` and ``budget`` of the draft tree (SGLang's num-steps, eagle-topk
    and num-draft-tokens).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"SGLang algorithm {algorithm!r}: choose from {', '.join(ALGORITHMS)}")
    fused = algorithm == SGLANG_EAGLE3
    config, tensors = ascending_aux_layers(source) if fused else (source.config, dict(source.state))
    layer = target.engine_layer_config(config["target_config"])
    check_layer(source, layer, algorithm)
    vocab = layer["vocab_size"]
    draft_config = {
        **layer,
        "architectures": [SGLANG_ARCHITECTURES[algorithm]],
        "num_hidden_layers": config["num_layers"],
        "tie_word_embeddings": False,
    }
    extra = []
    if fused:
        if config.get("norm_before_residual"):
            raise refuse(
                NAME,
                source.kind,
                f"it was trained with norm_before_residual, which SGLang {VERSION}'s "
                "EAGLE-3 layer does not implement; use --format speculators",
            )
        if config["num_layers"] > 1:
            # SGLang 0.5.23's llama_eagle3.py names layer 0 ``midlayer`` and later ones
            # ``additional_layers.N`` with ``hidden_norm`` as their input norm: not vLLM's (and the
            # head's) ``layers.N.input_layernorm``, so the weights would not be a copy.
            raise refuse(
                NAME,
                source.kind,
                f"it has {config['num_layers']} decoder layers and SGLang {VERSION}'s EAGLE-3 model "
                "names and norms the layers past the first otherwise; use --format speculators",
            )
        num_layers = source.record.get("num_hidden_layers")
        if num_layers in config["aux_layers"]:
            raise refuse(
                NAME,
                source.kind,
                f"it reads the target's last layer output (aux layer {num_layers}), which "
                f"SGLang {VERSION} cannot capture; use --format speculators",
            )
        draft_config["draft_vocab_size"] = config["draft_vocab_size"]
        draft_config.update({key: bool(config.get(key, False)) for key in EAGLE31_FIELDS})
        draft_config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [layer_id - 1 for layer_id in config["aux_layers"]],
            "use_aux_hidden_state": True,
        }
        if config["draft_vocab_size"] == vocab:
            del tensors["d2t"], tensors["t2d"]
    else:
        draft_vocab = tensors.pop("draft_vocab")
        if draft_vocab.numel() < vocab:
            torch.save(draft_vocab.tolist(), out / SGLANG_HOT_TOKEN_MAP)
            extra = ["--speculative-token-map", str(out / SGLANG_HOT_TOKEN_MAP)]
    write_config(out, {**draft_config, **export_block(source, NAME, config)})
    write_weights(out, tensors, NAME)
    command = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target.folder),
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        str(out),
        "--speculative-num-steps",
        str(tree["depth"]),
        "--speculative-eagle-topk",
        str(tree["top_k"]),
        "--speculative-num-draft-tokens",
        str(tree["budget"]),
        *extra,
    ]
    return [" ".join(command)]


def read(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    """The weights of the SGLang folder ``folder`` (its ``config``) under draftsmith's names: an
    EAGLE-3 layout's identity vocabulary maps where a full draft vocabulary wrote none, an EAGLE-1
    layout's draft vocabulary from its hot-token map (all tokens without one)."""
    architectures = set(config.get("architectures") or [])
    if not architectures & set(SGLANG_ARCHITECTURES.values()):
        raise CheckpointError(
            f"{folder}: config.json says it is a {NAME} export but names no architecture of SGLang's EAGLE "
            f"layouts ({', '.join(SGLANG_ARCHITECTURES.values())})"
        )
    tensors = load_tensors(folder / "model.safetensors")
    vocab = config["vocab_size"]
    if SGLANG_ARCHITECTURES[SGLANG_EAGLE3] in architectures:
        if "d2t" not in tensors:
            tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
            tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    else:
        hot = folder / SGLANG_HOT_TOKEN_MAP
        tensors["draft_vocab"] = (
            torch.tensor(load_torch(hot), dtype=torch.long) if hot.is_file() else torch.arange(vocab)
        )
    return tensors
