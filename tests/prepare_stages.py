"""Tokenising and offline feature extraction as one command (neither has a command of its own):
``test_interruptions.py`` runs it in a subprocess to kill it, and in-process to compare.

    python tests/prepare_stages.py TARGET_DIR DATA_CACHE LIMIT [FEATURES_DIR]

tokenises the first LIMIT bundled ShareGPT conversations with the tokenizer in TARGET_DIR into
DATA_CACHE and, with FEATURES_DIR, extracts that target's features into shards of 2 conversations
(several shards, so a kill can land between them as well as inside one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import extract_features
from draftsmith.recipe import DataConfig
from draftsmith.target import load_tokenizer


def main(argv: list[str]) -> None:
    target, cache, limit, *features = argv
    tokenizer = load_tokenizer(target)
    data, _ = build_dataset(
        DataConfig(limit=int(limit), max_length=256, held_out_fraction=0.2, cache_dir=cache), tokenizer, verbose=False
    )
    if features:
        model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        extract_features(model, data, Path(features[0]), shard_size=2, show=False)


if __name__ == "__main__":
    main(sys.argv[1:])
