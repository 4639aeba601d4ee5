"""What every drafter checkpoint shares: a record of the target it was trained for.

A head is useless (and silently wrong) on another target, so its ``config.json`` names the
target and carries a cheap fingerprint of the target's embedding matrix that is compared on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from draftsmith.checkpoint_files import load_tensors, read_json
from draftsmith.errors import CheckpointError
from draftsmith.heads.exported import EXPORT_KEY, native_state
from draftsmith.target import target_record


class TargetMismatchError(CheckpointError):
    """A drafter checkpoint loaded against a target it was not trained for."""


class Fp32RotaryMixin:
    """Keeps the head's ``rotary_emb`` buffers (``inv_freq``) in fp32 when the head is cast, as a
    target loaded with ``dtype=bfloat16`` keeps its own: ``.to(bfloat16)`` would round the
    frequencies, and the angle error grows with the position (0.4 in cos at position 1,000), so a
    bf16 head would attend to positions other than the ones it was trained (and vLLM serves) with."""

    def _apply(self, fn, recurse=True):
        rotary = getattr(self, "rotary_emb", None)
        kept = dict(rotary.named_buffers(recurse=False)) if rotary is not None else {}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            moved = rotary._buffers[name]
            if buf.is_floating_point() and moved.dtype != buf.dtype:
                rotary._buffers[name] = buf.to(moved.device)
        return self


def _signature_tolerances(target: PreTrainedModel) -> list[float]:
    """Per group, 1% of its sum of magnitudes: more than bf16 rounding (<= 0.2% per weight) can move it."""
    rows = target.get_input_embeddings().weight[:256].detach().double()
    return [1e-2 * float(g.abs().sum()) for g in rows.chunk(16)]


def check_target(record: dict, target: PreTrainedModel, checkpoint: str | Path) -> None:
    """Raise :class:`TargetMismatchError` unless ``target`` matches the checkpoint's ``record``."""
    actual = target_record(target, record.get("name", "?"))
    problems = [
        f"{key}: checkpoint {record[key]!r} vs target {actual[key]!r}"
        for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")
        if record.get(key) != actual[key]
    ]
    expected = record.get("embedding_checksum")
    if not problems and expected is not None:
        # bf16/fp16 copies of the same weights differ by < 0.01% in this sum; another model with
        # the same weight distribution may differ by under 1%, so the signed group sums decide.
        differs = abs(actual["embedding_checksum"] - expected) > 1e-2 * abs(expected)
        signature = record.get("embedding_signature")  # absent from older checkpoints
        if signature is not None and not differs:
            tolerances = _signature_tolerances(target)
            differs = len(signature) != len(tolerances) or any(
                abs(a - e) > tol for a, e, tol in zip(actual["embedding_signature"], signature, tolerances)
            )
        if differs:
            problems.append("embedding weights differ (different model with the same shape)")
    if problems:
        raise TargetMismatchError(
            f"{checkpoint} was trained for target {record.get('name')!r} and does not match the target "
            f"given: {'; '.join(problems)}"
        )


def read_config(path: str | Path, kind: str) -> dict:
    """The ``config.json`` of a drafter checkpoint folder, checked to be of ``kind``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a drafter checkpoint: it has no config.json (give a checkpoint-N "
            "or checkpoint-final folder written by training)"
        )
    config = read_json(file)
    if EXPORT_KEY in config:  # a draftsmith-export folder: its drafter config rides along
        config = config[EXPORT_KEY]["config"]
    if config.get("draftsmith_kind") != kind:
        raise CheckpointError(
            f"{path} holds a {config.get('draftsmith_kind')!r} drafter, not {kind!r}: "
            f"use the drafter kind that trained it ({config.get('draftsmith_kind')}:PATH)"
        )
    return config


def read_state(path: str | Path) -> dict:
    """The drafter's weights under its own names, from a training checkpoint or an exported folder."""
    if EXPORT_KEY in read_json(Path(path) / "config.json"):
        return native_state(path)
    return load_tensors(Path(path) / "model.safetensors")


def save_head(module: torch.nn.Module, path: str | Path, kind: str, config: dict) -> None:
    """Write a head's ``config.json`` (``draftsmith_kind`` first, then ``config``) and its own
    weights as ``model.safetensors`` (never the target's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"draftsmith_kind": kind, **config}, indent=1, default=str))
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", "draftsmith_kind": kind})


def load_head_parts(path: str | Path, kind: str, target: PreTrainedModel | None) -> tuple[dict, dict, tuple]:
    """``(config, state, (layer_class, rotary_class))`` of a head checkpoint (or export) of ``kind``;
    with ``target`` it is first checked against the recorded target, whose classes build the layers
    when they are of its architecture (None, None without a target, or for layers of another
    architecture, e.g. an EAGLE-3 head's dense Llama layer over a MoE target: the head derives them
    from its recorded layer config)."""
    config = read_config(path, kind)
    classes = (None, None)
    if target is not None:
        check_target(config["target"], target, path)
        recorded = (config.get("target_config") or {}).get("model_type")
        if recorded in (None, target.config.model_type):
            classes = decoder_classes(target)
    return config, read_state(path), classes


def decoder_classes(target: PreTrainedModel) -> tuple[type, type]:
    """The decoder-layer and rotary-embedding classes of ``target``'s decoder (what a head's layers are built from)."""
    decoder = target.get_decoder()
    return type(decoder.layers[0]), type(decoder.rotary_emb)
