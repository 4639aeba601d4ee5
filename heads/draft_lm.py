"""Draft language models: any causal LM sharing the target's tokenizer, or one cut from the target.

A derived draft keeps ``num_layers`` of the target's decoder layers (evenly spaced by default)
with its embeddings, final norm and LM head, so it starts close to the target. It is an ordinary
Hugging Face causal LM: ``save_pretrained`` output loads in transformers, vLLM and as HF
``generate(assistant_model=...)``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.heads.vocab import most_frequent
from draftsmith.hub import check_hub_id

# JSON, not safetensors: vLLM loads every top-level *.safetensors of a model folder as weights and
# refuses one holding no parameter of the model ("no module or parameter named 'counts'").
TOKEN_COUNTS = "token_counts.json"
TARGET_RECORD = "draftsmith_target.json"  # where a saved draft LM names its target (a plain HF folder has no room)


def evenly_spaced(total: int, keep: int) -> list[int]:
    """``keep`` layer indices spread over ``total`` layers, first and last included."""
    if not 1 <= keep <= total:
        raise ValueError(f"cannot keep {keep} of {total} layers")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def derive_draft_lm(
    target: PreTrainedModel, num_layers: int | None = None, layers: list[int] | None = None
) -> PreTrainedModel:
    """A copy of ``target`` that keeps only some decoder layers (``layers`` or ``num_layers`` evenly)."""
    decoder = target.get_decoder()
    total = len(decoder.layers)
    keep = layers if layers is not None else evenly_spaced(total, num_layers or max(1, total // 8))
    if any(not 0 <= i < total for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"layers {keep} must be distinct indices in [0, {total})")
    draft = copy.deepcopy(target)
    draft_decoder = draft.get_decoder()
    draft_decoder.layers = torch.nn.ModuleList(draft_decoder.layers[i] for i in keep)
    for new_index, layer in enumerate(draft_decoder.layers):
        # Attention modules index the KV cache by their layer number.
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_index
    draft.config.num_hidden_layers = len(keep)
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = [draft.config.layer_types[i] for i in keep]
    return draft


def load_draft_lm(name_or_path: str, dtype: torch.dtype, device: torch.device | str) -> PreTrainedModel:
    """A draft LM from a hub id or local folder, frozen, in eval mode."""
    check_hub_id(name_or_path, "draft_lm:PATH")
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def student_for(
    target: PreTrainedModel,
    source: str | None = None,
    num_layers: int | None = None,
    layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A trainable draft LM for ``target`` in ``dtype``: loaded from ``source`` (hub id or folder),
    else derived.

    fp32 (the default) keeps master weights for full fine-tuning whatever the target's dtype: in
    bf16 most AdamW updates round away (a bf16 SmolLM2 student gained 1.00 -> 1.05 acceptance length
    in 140 steps), while accelerate's mixed precision still runs the passes in bf16. A LoRA student
    can keep its frozen base in the target's dtype (peft holds the adapters in fp32). A loaded
    student must share the target's vocabulary; a mismatch is an error, not a silent misalignment
    of token ids.
    """
    if source:
        check_hub_id(source, "drafter.student")
        student = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(next(target.parameters()).device)
        want, got = target.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
        if want != got:
            raise CheckpointError(
                f"drafter.student: {source!r} has a vocabulary of {got} tokens but the target has {want}: "
                "a draft LM must share the target's tokenizer"
            )
    else:
        student = derive_draft_lm(target, num_layers=num_layers, layers=layers)
    return student.to(dtype).train().requires_grad_(True)


def save_draft_lm(
    model: PreTrainedModel,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    target_info: dict | None = None,
    dtype: torch.dtype | None = None,
    counts: torch.Tensor | None = None,
) -> None:
    """Save a plain Hugging Face causal LM (LoRA adapters merged into a copy first) that transformers,
    vLLM and ``generate(assistant_model=...)`` load as they are, in ``dtype`` (the target's, so it
    serves beside it; default: as trained); ``target_info`` goes to :data:`TARGET_RECORD` beside it,
    ``counts`` (training-response token frequencies) to ``token_counts.json``, from which
    the engine takes a reduced draft vocabulary (``draft_lm:PATH?vocab=N``)."""
    path = Path(path)
    merge = hasattr(model, "merge_and_unload")  # a peft model: export the merged weights, keep training the adapter
    recast = dtype is not None and next(model.parameters()).dtype != dtype
    if merge or recast:
        model = copy.deepcopy(model)
        if merge:
            model = model.merge_and_unload()
        if recast:
            model = model.to(dtype)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if target_info is not None:
        (path / TARGET_RECORD).write_text(json.dumps(target_info, indent=1))
    if counts is not None:
        (path / TOKEN_COUNTS).write_text(json.dumps({"counts": counts.detach().cpu().long().tolist()}))


def draft_vocab_from_counts(path: str | Path, size: int, model: PreTrainedModel) -> torch.Tensor:
    """The ``size`` most frequent token ids recorded in the draft LM checkpoint at ``path`` (its
    end-of-sequence tokens always included, so drafts can still stop)."""
    counts_file = Path(path) / TOKEN_COUNTS
    if not counts_file.is_file():
        raise CheckpointError(
            f"{path} has no {TOKEN_COUNTS} (written by train/distill.py): a reduced draft "
            "vocabulary needs the training responses' token counts; leave out vocab="
        )
    counts = torch.tensor(json.loads(counts_file.read_text())["counts"])
    vocab = model.get_output_embeddings().weight.shape[0]
    if counts.numel() != vocab:
        raise CheckpointError(
            f"{counts_file} counts {counts.numel()} token ids but the draft LM's vocabulary has {vocab}"
        )
    if not 0 < size <= vocab:
        raise UsageError(f"draft_lm option vocab={size}: give a draft vocabulary size in [1, {vocab}]")
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = model.config.eos_token_id if eos is None else eos
    always = {eos} if isinstance(eos, int) else set(eos or [])
    return most_frequent(counts, size, always)
