"""Tiny random-weight targets of transformers' own classes, one per model family (the target-family
matrix of issue 58): built from each family's config class at hidden 64, 3 layers (aux layers 0, 1
and 2 are then all inputs of decoder layers, as vLLM captures them), a 256-token vocabulary and
a word-level tokenizer of the same size, weights scaled up for varied greedy text.

Shared by ``tests/test_target_families.py`` and ``bench/family_matrix.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB, HIDDEN, LAYERS = 256, 64, 3
AUX = [0, 1, 2]
EOS = 2
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=0,
    tie_word_embeddings=False,
)
HEAD_DIM = dict(head_dim=16)
EXPERTS = dict(num_experts_per_tok=2)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> the family's config (its own class; MoE ones with 4 experts, 2 per token, on every layer
# but DeepSeek-V3's first, which is dense as in the real model).
FAMILIES = {
    "llama3": lambda: LlamaConfig(
        **SHAPE,
        **HEAD_DIM,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": lambda: Qwen3Config(**SHAPE, **HEAD_DIM),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, **HEAD_DIM, **EXPERTS, num_experts=4, moe_intermediate_size=32),
    "gpt_oss": lambda: GptOssConfig(
        **{**SHAPE, "intermediate_size": 32},
        **HEAD_DIM,
        **EXPERTS,
        num_local_experts=4,
        sliding_window=8,
        layer_types=MIXED,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    ),
    "mixtral": lambda: MixtralConfig(**{**SHAPE, "intermediate_size": 32}, **HEAD_DIM, **EXPERTS, num_local_experts=4),
    "gemma3": lambda: Gemma3TextConfig(
        **SHAPE, **HEAD_DIM, sliding_window=8, layer_types=MIXED, query_pre_attn_scalar=16
    ),
    "phi3": lambda: Phi3Config(**SHAPE),
    # Multi-head latent attention: every head reads the one compressed latent (num_key_value_heads
    # = num_attention_heads, as in the real config).
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4},
        **EXPERTS,
        n_routed_experts=4,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}
# What these families' decoder layers are (MoE: routed experts in place of the dense MLP).
MOE = {"qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3"}


def tiny_family(name: str, seed: int = 0) -> PreTrainedModel:
    """A random-weight target of family ``name`` in fp32, eval mode. Every weight but the norms is
    scaled up (the default init is near uniform: greedy text would repeat one token); Gemma's
    norms scale by 1 + weight from 0, so they are drawn at random instead."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" not in key:
                param.mul_(4.0 if gemma else 8.0)
            elif gemma:
                param.normal_(0, 3.0)
    return model


def word_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``vocab`` tokens ``<pad> <s> </s> t3 t4 ...`` (ids as the configs')."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    raw = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_family(name: str, folder: Path, seed: int = 0) -> PreTrainedModel:
    """:func:`tiny_family` saved with :func:`word_tokenizer` as a model folder; returns the model."""
    model = tiny_family(name, seed)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model
