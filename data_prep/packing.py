"""Packing without pads: conversations laid end to end in fixed-length rows (``training.packing``).

A packed batch is ``training.batch_size`` rows of at most ``data.max_length`` tokens, each holding
whole conversations (best-fit decreasing, :func:`pack_rows`). Its ``attention_mask`` holds segment
ids (1, 2, ... for the conversations of a row, 0 on the row's padding), so ``attention_mask.bool()``
still means "real token", and ``position_ids`` restart at 0 with each conversation. Attention stops
at each conversation's boundary: the target reads the masks it would build for each conversation
alone, sliding windows included, cut at the boundaries (:func:`target_inputs`), the heads' masks
and scored positions compare segment ids (:func:`head_segments`, :func:`same_segment`). A padded
batch (``pad_batch``) is the special case of one segment per row, so the same functions serve both.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
import torch
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    packed_sequence_mask_function,
)

from draftsmith.errors import UserError

LOSS_WEIGHT = "loss_weight"  # a row's per-token loss weights, where it has them (draftsmith.adapt.weights)
PACK_WINDOW = 1024  # conversations packed together (then cut into batches, which are shuffled)
# transformers' mask of each attention layer type (the keys of a config's ``layer_types``).
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of at most ``capacity`` tokens holding every index of ``lengths`` once: best-fit
    decreasing (each conversation, longest first, goes to the fullest row it fits in, ties to the
    earlier row; a new row when none has room). Deterministic. A longer conversation than
    ``capacity`` gets a row of its own (tokenisation already cuts them to ``data.max_length``)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        at = bisect_left(free, (need, -1))
        if at == len(free):
            rows.append([index])
            room, row = capacity - need, len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(index)
            room -= need
        if room > 0:
            insort(free, (room, row))
    return rows


def packed_order(order: list[int], lengths: list[int], capacity: int, batch: int, rng) -> list[list[int]]:
    """An epoch's packed rows in training order, ``batch`` rows a batch: ``order`` (a permutation of
    the conversations) is packed ``PACK_WINDOW`` conversations at a time (:func:`pack_rows`), cut
    into batches (a window's last, partial batch carries over into the next window) and the full
    batches are shuffled by ``rng``; the epoch's last, partial batch stays last."""
    batches, carry = [], []
    for start in range(0, len(order), PACK_WINDOW):
        items = carry + order[start : start + PACK_WINDOW]
        rows = [[items[i] for i in row] for row in pack_rows([lengths[i] for i in items], capacity)]
        full = len(rows) // batch * batch
        batches += [rows[k : k + batch] for k in range(0, full, batch)]
        carry = [i for row in rows[full:] for i in row]
    partial = [[[carry[i] for i in row] for row in pack_rows([lengths[i] for i in carry], capacity)]] if carry else []
    shuffled = [batches[j] for j in rng.permutation(len(batches))] if batches else []
    return [row for b in shuffled + partial for row in b]


def pack_batch(rows: list[list[dict]]) -> dict:
    """Packed rows (each a list of tokenised conversations: ``input_ids``, ``loss_mask`` and, when
    present, cached features ``hidden`` and ``aux`` and per-token ``loss_weight``) into a batch: the
    conversations of a row end to end, right-padded to the longest row, ``attention_mask`` their
    segment ids and ``position_ids`` restarting at 0 with each."""
    longest = max(sum(len(c["input_ids"]) for c in row) for row in rows)
    first = rows[0][0]
    batch = {
        "input_ids": torch.zeros(len(rows), longest, dtype=torch.long),
        "loss_mask": torch.zeros(len(rows), longest, dtype=torch.bool),
        "attention_mask": torch.zeros(len(rows), longest, dtype=torch.long),
        "position_ids": torch.zeros(len(rows), longest, dtype=torch.long),
    }
    features = [key for key in ("hidden", "aux") if key in first]
    for key in features:
        batch[key] = torch.zeros(len(rows), longest, first[key].shape[-1], dtype=first[key].dtype)
    weighted = any(LOSS_WEIGHT in c for row in rows for c in row)  # adapt.rejected_weight's; 1 where absent
    if weighted:
        batch[LOSS_WEIGHT] = torch.ones(len(rows), longest)
    for i, row in enumerate(rows):
        at = 0
        for segment, conversation in enumerate(row, start=1):
            n = len(conversation["input_ids"])
            batch["input_ids"][i, at : at + n] = torch.as_tensor(conversation["input_ids"])
            batch["loss_mask"][i, at : at + n] = torch.as_tensor(conversation["loss_mask"], dtype=torch.bool)
            batch["attention_mask"][i, at : at + n] = segment
            batch["position_ids"][i, at : at + n] = torch.arange(n)
            for key in features:
                batch[key][i, at : at + n] = conversation[key]
            if weighted and LOSS_WEIGHT in conversation:
                batch[LOSS_WEIGHT][i, at : at + n] = torch.as_tensor(conversation[LOSS_WEIGHT], dtype=torch.float32)
            at += n
    return batch


def is_packed(batch: dict) -> bool:
    return "position_ids" in batch


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean ``[b, 1, L, L]``: query t sees key s <= t of its own segment (pads, segment 0, see
    earlier pads: no row is empty)."""
    length = segments.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def target_inputs(batch: dict, model) -> dict:
    """Keyword arguments of ``model``'s forward over ``batch`` (a causal LM or its decoder):
    ``input_ids`` and ``attention_mask``. A packed batch's, with the conversations' own
    ``position_ids``, are the masks transformers builds for ``model`` (causal, or within its sliding
    window), cut at each conversation's boundary, in the form its attention implementation reads:
    one per layer type where the config lists ``layer_types`` (Gemma-3, gpt-oss, Qwen), else the
    one its layers share (sliding where ``config.sliding_window`` is set, as Mistral chooses).
    transformers passes such masks through as they are, so it builds no window of its own."""
    if not is_packed(batch):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    config, segments = model.config, batch["attention_mask"]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kinds = {"full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"}
    else:
        kinds = set(layer_types)
    unknown = sorted(kinds - MASK_BUILDERS.keys())
    if unknown:
        raise UserError(
            f"training.packing: the target's {', '.join(unknown)} layers cannot be cut at conversation boundaries "
            "here; set training.packing: false"
        )
    # The builders read only the batch size, length, dtype and device of the embeddings.
    shape = segments.new_empty((*segments.shape, 0), dtype=model.dtype)
    masks = {
        kind: MASK_BUILDERS[kind](
            config=config,
            inputs_embeds=shape,
            attention_mask=None,
            past_key_values=None,
            and_mask_function=packed_sequence_mask_function(segments),
        )
        for kind in kinds
    }
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": masks if layer_types is not None else masks.popitem()[1],
        "position_ids": batch["position_ids"],
    }


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """``[b, L]``: each token's position within its run of equal segment ids (its conversation's
    own position; a padded batch's real tokens get ``0..n-1``)."""
    length = segments.shape[-1]
    index = torch.arange(length, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values


def head_segments(segments: torch.Tensor) -> torch.Tensor:
    """``[b, L - 1]``: the segment of each (token t, token t + 1) pair a head position reads, 0 where
    the pair crosses a boundary or reaches padding (a padded batch's ``attention_mask[:, 1:]``)."""
    return torch.where(segments[:, 1:] == segments[:, :-1], segments[:, 1:], torch.zeros_like(segments[:, 1:]))


def same_segment(segments: torch.Tensor, shift: int) -> torch.Tensor:
    """Boolean ``[b, L - 1]``: token t and token t + shift belong to one conversation (False where
    t + shift is past the row)."""
    out = torch.zeros_like(segments[:, 1:], dtype=torch.bool)
    length = segments.shape[-1]
    if shift < length:
        out[:, : length - shift] = (segments[:, : length - shift] == segments[:, shift:]) & (segments[:, shift:] > 0)
    return out


def epoch_rows(size: int, lengths: list[int], capacity: int, batch: int, seed: int) -> list[list[int]]:
    """The packed rows of the epoch seeded ``seed`` (a function of the seed alone)."""
    rng = np.random.default_rng(seed)
    return packed_order(rng.permutation(size).tolist(), lengths, capacity, batch, rng)
