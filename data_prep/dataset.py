"""The tokenised training set: conversations -> ids + assistant loss mask, split and cached.

The cache key covers the source file (path, size, mtime), the tokenizer (vocabulary size and
chat template), the max length, the limit and the split, so a changed input never reuses a stale
cache and an unchanged one loads in about a second with ``datasets.load_from_disk``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from draftsmith.assets import asset_path, cache_root
from draftsmith.atomic import staged
from draftsmith.data_prep.chat import tokenize_conversation
from draftsmith.data_prep.packing import LOSS_WEIGHT, pack_batch
from draftsmith.data_prep.sharegpt import BUNDLED, DataError, load_conversations
from draftsmith.recipe import DataConfig

FORMAT_VERSION = 2  # 2: regenerated replies keep their generated token ids
TRAIN, HELD_OUT = "train", "held_out"
# Conversations below which tokenising in one process is quicker than forking workers and sending
# their rows back (ShareGPT here: ~4 ms a conversation, rendering its chat template turn by turn).
POOL_MIN = 2000
_WORKER: tuple = ()  # (tokenizer, max_length) of the forked workers, inherited from the parent


def _encode(messages: list[dict]) -> dict:
    tokenizer, max_length = _WORKER
    return tokenize_conversation(tokenizer, messages, max_length)


def encode_all(tokenizer, conversations: list[list[dict]], max_length: int, processes: int | None = None) -> list[dict]:
    """:func:`~draftsmith.data_prep.chat.tokenize_conversation` of every conversation's messages, in
    order, by ``processes`` forked workers (default: every CPU this process may use, for sets of at
    least :data:`POOL_MIN` conversations, where fork exists; else this process alone)."""
    if processes is None:
        large = len(conversations) >= POOL_MIN and "fork" in multiprocessing.get_all_start_methods()
        processes = len(os.sched_getaffinity(0)) if large and hasattr(os, "sched_getaffinity") else 1
    if processes <= 1:
        return [tokenize_conversation(tokenizer, messages, max_length) for messages in conversations]
    global _WORKER
    _WORKER = (tokenizer, max_length)
    # The workers only tokenise; unset, the tokenizers library warns in each of them at the fork.
    ours = "TOKENIZERS_PARALLELISM" not in os.environ
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return pool.map(_encode, conversations, chunksize=64)
    finally:
        _WORKER = ()
        if ours:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


@dataclass
class TokenizedSummary:
    """Counts for the tokenised set (saved beside the cache and printed)."""

    conversations: dict = field(default_factory=dict)  # split -> count
    tokens: dict = field(default_factory=dict)  # split -> tokens after truncation
    assistant_tokens: dict = field(default_factory=dict)  # split -> tokens under the loss mask
    truncated: int = 0
    dropped: dict = field(default_factory=dict)  # reason -> count (after loading)
    load_summary: str = ""

    def __str__(self) -> str:
        parts = [
            f"{split}: {self.conversations.get(split, 0)} conversations, {self.tokens.get(split, 0):,} "
            f"tokens ({self.assistant_tokens.get(split, 0):,} assistant)"
            for split in (TRAIN, HELD_OUT)
        ]
        extra = f"; {self.truncated} truncated to max_length"
        extra += "".join(f"; dropped {n} {reason}" for reason, n in self.dropped.items())
        return "tokenised set: " + "; ".join(parts) + extra


def is_held_out(conversation_id: str, fraction: float) -> bool:
    """Deterministic split by id: independent of file order, limits and machines."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def source_identity(path: str) -> str:
    local = asset_path(BUNDLED) if path == BUNDLED else Path(path)
    if local.is_file():
        stat = local.stat()
        return f"{local.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"hub:{path}"


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template or ""
    return f"{tokenizer.name_or_path}|{len(tokenizer)}|{hashlib.sha256(template.encode()).hexdigest()}"


def cache_key(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, expected_model: str | None = None) -> str:
    """Hash of everything the tokenised set depends on."""
    parts = [
        FORMAT_VERSION,
        source_identity(cfg.path),
        cfg.split,
        tokenizer_identity(tokenizer),
        cfg.max_length,
        cfg.limit,
        cfg.held_out_fraction,
    ]
    if cfg.held_out_path:
        # "by prompt": sets cut by held-out ids before that rule are stale; other sets stay valid.
        parts.append(["by prompt", source_identity(cfg.held_out_path)])
    if expected_model is not None:  # appended only when given: the keys of every other set stay as they were
        parts.append(["served model", expected_model])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _user_turns(conversation: dict) -> tuple[str, ...]:
    """Its system message ("" without one) and user turns: what a conversation shares with a
    regenerated copy of it, which may keep fewer turns."""
    messages = conversation["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    return (system, *(m["content"] for m in messages if m["role"] == "user"))


def _same_prompts(held_out: list[dict]):
    """A test: does a conversation's user-turn sequence extend, or is it part of, a held-out one's?"""
    by_first = defaultdict(list)
    for conv in held_out:
        turns = _user_turns(conv)
        by_first[turns[:2]].append(turns)

    def test(conv: dict) -> bool:
        turns = _user_turns(conv)
        return any(turns[: len(other)] == other[: len(turns)] for other in by_first.get(turns[:2], ()))

    return test


def _tokenize(
    conversations: list[dict], tokenizer, cfg: DataConfig, held_out: list[dict] | None = None
) -> tuple[datasets.DatasetDict, TokenizedSummary]:
    """The splits of ``conversations``: held out by id hash, or (``held_out``: the conversations of
    ``data.held_out_path``) those are the held-out split and conversations with their prompts (one
    user-turn sequence the start of the other's, same system message) leave the training one."""
    summary = TokenizedSummary()
    rows = {TRAIN: [], HELD_OUT: []}
    dropped = Counter()
    if held_out is None:
        tagged = [(conv, is_held_out(conv["id"], cfg.held_out_fraction)) for conv in conversations]
    else:
        # Matched by prompts, not id: a regenerated held-out file keeps its source's prompts, and files
        # without ids number their records from 0, so ids of two files say nothing about each other.
        held = _same_prompts(held_out)
        kept = [conv for conv in conversations if not held(conv)]
        if overlap := len(conversations) - len(kept):
            dropped["prompt_in_data_held_out_path"] = overlap
        tagged = [(conv, False) for conv in kept] + [(conv, True) for conv in held_out]
    encodings = encode_all(tokenizer, [conv["messages"] for conv, _ in tagged], cfg.max_length)
    for (conv, in_held_out), encoded in zip(tagged, encodings):
        summary.truncated += encoded["truncated"]
        if not any(encoded["loss_mask"]):
            # A prompt longer than max_length leaves nothing to learn from.
            dropped["no_assistant_tokens_within_max_length"] += 1
            continue
        split = HELD_OUT if in_held_out else TRAIN
        rows[split].append({"id": conv["id"], "input_ids": encoded["input_ids"], "loss_mask": encoded["loss_mask"]})
    if not rows[TRAIN]:
        reasons = f"{len(rows[HELD_OUT])} held out, " if rows[HELD_OUT] else ""
        if cfg.held_out_path:
            reasons += f"{dropped['prompt_in_data_held_out_path']} with prompts of data.held_out_path, "
        split = "use another data.held_out_path" if cfg.held_out_path else "lower data.held_out_fraction"
        raise DataError(
            f"{cfg.path}: no training conversation left after tokenising {len(conversations)} "
            f"({reasons}{dropped['no_assistant_tokens_within_max_length']} with no assistant token "
            f"within data.max_length={cfg.max_length}); raise data.max_length or data.limit, or {split}"
        )
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    for split, items in rows.items():
        summary.conversations[split] = len(items)
        summary.tokens[split] = sum(len(r["input_ids"]) for r in items)
        summary.assistant_tokens[split] = sum(sum(r["loss_mask"]) for r in items)
    summary.dropped = dict(dropped)
    # Column-wise, so an empty split (no held-out conversation) keeps its features.
    dataset = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict({k: [r[k] for r in items] for k in features}, features=features)
            for split, items in rows.items()
        }
    )
    return dataset, summary


def build_dataset(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, verbose: bool = True, expected_model: str | None = None
) -> tuple[datasets.DatasetDict, TokenizedSummary]:
    """The tokenised ``train``/``held_out`` set for ``cfg``, from the cache when it is current.

    Columns: ``id``, ``input_ids`` and ``loss_mask`` (1 on assistant tokens). ``expected_model``:
    the served model a request log's requests must be for (others are counted, never kept).
    """
    root = Path(cfg.cache_dir) if cfg.cache_dir else cache_root() / "datasets"
    target = root / cache_key(cfg, tokenizer, expected_model)
    summary_file = target / "draftsmith_summary.json"
    if summary_file.is_file():
        summary = TokenizedSummary(**json.loads(summary_file.read_text()))
        if verbose:
            print(f"loaded cached tokenised set from {target}\n{summary}")
        return _load(target, cfg, verbose), summary
    conversations, load_summary = load_conversations(
        cfg.path, cfg.split, cfg.limit, verbose=verbose, expected_model=expected_model
    )
    held_out = None
    if cfg.held_out_path:
        held_out, _ = load_conversations(cfg.held_out_path, "train", None, verbose=verbose)
    dataset, summary = _tokenize(conversations, tokenizer, cfg, held_out)
    summary.load_summary = str(load_summary)
    try:
        with staged(target, folder=True) as tmp:
            # datasets cannot load back a saved empty split (IndexError): only non-empty ones are saved.
            datasets.DatasetDict({split: rows for split, rows in dataset.items() if len(rows)}).save_to_disk(str(tmp))
            (tmp / "draftsmith_summary.json").write_text(json.dumps(asdict(summary), indent=1))
    except OSError:
        # Another process finished the same cache first; its copy is identical.
        if not summary_file.is_file():
            raise
    if verbose:
        print(summary)
    return _load(target, cfg, verbose), summary


def _load(folder: Path, cfg: DataConfig, verbose: bool) -> datasets.DatasetDict:
    """The saved splits, with an empty ``held_out`` (and a note saying so) when none was held out."""
    dataset = datasets.load_from_disk(str(folder))
    if HELD_OUT not in dataset:
        train = dataset[TRAIN]
        dataset[HELD_OUT] = datasets.Dataset.from_dict({k: [] for k in train.features}, features=train.features)
        if verbose:
            print(
                f"note: no held-out conversation among {len(train)} (data.held_out_fraction={cfg.held_out_fraction}): "
                "training without held-out metrics; raise data.limit or data.held_out_fraction to get them"
            )
    return dataset


def pad_batch(rows: list[dict] | list[list[dict]]) -> dict:
    """Right-pad tokenised rows (``input_ids``, ``loss_mask`` and, when present, cached features
    ``hidden`` and ``aux``) into a batch with an ``attention_mask``; packed rows (lists of such
    rows, ``training.packing``) into a packed batch (:func:`~draftsmith.data_prep.packing.pack_batch`).
    Rows with a per-token ``loss_weight`` (``adapt.rejected_weight``) give the batch one, 1 where a row has none."""
    if isinstance(rows[0], list):
        return pack_batch(rows)
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.zeros(len(rows), longest, dtype=torch.long),
        "loss_mask": torch.zeros(len(rows), longest, dtype=torch.bool),
        "attention_mask": torch.zeros(len(rows), longest, dtype=torch.long),
    }
    features = [key for key in ("hidden", "aux") if key in rows[0]]
    for key in features:
        batch[key] = torch.zeros(len(rows), longest, rows[0][key].shape[-1], dtype=rows[0][key].dtype)
    if any(LOSS_WEIGHT in row for row in rows):
        batch[LOSS_WEIGHT] = torch.ones(len(rows), longest)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(row["input_ids"])
        batch["loss_mask"][i, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
        batch["attention_mask"][i, :n] = 1
        for key in features:
            batch[key][i, :n] = row[key]
        if LOSS_WEIGHT in row:
            batch[LOSS_WEIGHT][i, :n] = torch.as_tensor(row[LOSS_WEIGHT], dtype=torch.float32)
    return batch
