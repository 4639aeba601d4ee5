"""Tiny random-weight Llama targets saved to folders, sharing the bundled SmolLM2 tokenizer.

Training tests load them by path like any user's target; seconds per run on one CPU thread.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 49152  # the bundled SmolLM2 tokenizer
EOS = 2  # <|im_end|>


def save_tiny_target(folder: Path, tokenizer, seed: int = 0, hidden_size: int = 64) -> Path:
    """Save a 2-layer Llama of ``hidden_size`` with ``tokenizer`` into ``folder``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
