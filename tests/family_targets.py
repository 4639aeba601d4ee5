"""Tiny random-weight targets of transformers' own classes, one per model family (the target-family
matrix of issue 58): built from each family's config class at hidden 64, 3 layers (aux layers 0, 1
and 2 are then all inputs of decoder layers, as vLLM captures them), a 256-token vocabulary and
a word-level tokenizer of the same size, weights scaled up for varied greedy text.

The matrix's tests are ``tests/test_target_families.py``; its export-gate tests build the targets
with the changes vLLM's CPU build needs (:data:`SERVED`).
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


def _config(cls, **fields):
    """A family's config builder: ``fields`` as given, each overridable (``FAMILIES[name](**more)``)."""
    return lambda **more: cls(**{**fields, **more})


# name -> the family's config (its own class; MoE ones with 4 experts, 2 per token, on every layer
# but DeepSeek-V3's first, which is dense as in the real model).
FAMILIES = {
    "llama3": _config(
        LlamaConfig,
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
    "qwen3": _config(Qwen3Config, **SHAPE, **HEAD_DIM),
    "qwen3_moe": _config(Qwen3MoeConfig, **SHAPE, **HEAD_DIM, **EXPERTS, num_experts=4, moe_intermediate_size=32),
    "gpt_oss": _config(
        GptOssConfig,
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
    "mixtral": _config(MixtralConfig, **{**SHAPE, "intermediate_size": 32}, **HEAD_DIM, **EXPERTS, num_local_experts=4),
    "gemma3": _config(
        Gemma3TextConfig, **SHAPE, **HEAD_DIM, sliding_window=8, layer_types=MIXED, query_pre_attn_scalar=16
    ),
    "phi3": _config(Phi3Config, **SHAPE),
    # Multi-head latent attention: every head reads the one compressed latent (num_key_value_heads
    # = num_attention_heads, as in the real config).
    "deepseek_v3": _config(
        DeepseekV3Config,
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
# The families vLLM 0.32 serves with an EAGLE-3 drafter (their models implement SupportsEagle3;
# Mixtral's and Gemma 3's do not), each with what its CPU build and the gate need changed: attention
# heads of 32 and up (``v1/attention/backends/cpu_attn.py``) and the context the gate's jobs ask for.
# DeepSeek-V3 is not among them: on an AMX CPU vLLM picks its AMX latent-attention backend, which
# takes bf16 weights only (``v1/attention/backends/mla/amx_mla.py``), and the gate runs fp32; its
# fp32 backend (``mla/cpu_mla.py``, latent 512 + rope 64 only) leaves HF's greedy text within 3 tokens.
LONG = dict(max_position_embeddings=4096)  # the context the gate's vLLM jobs ask for (vllm_engine.engine_args)
SERVED = {
    "llama3": dict(**LONG, head_dim=32),
    "qwen3": dict(**LONG, head_dim=32),
    "qwen3_moe": dict(**LONG, head_dim=32),
    "gpt_oss": dict(**LONG, head_dim=32),
    "phi3": dict(**LONG, num_attention_heads=2),  # head size = hidden / heads
}


def tiny_family(name: str, seed: int = 0, **more) -> PreTrainedModel:
    """A random-weight target of family ``name`` (its config's fields changed by ``more``) in fp32,
    eval mode. Every weight but the norms is
    scaled up (the default init is near uniform: greedy text would repeat one token); Gemma's
    norms scale by 1 + weight from 0, so they are drawn at random instead."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[name](**more), dtype=torch.float32).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" not in key:
                param.mul_(4.0 if gemma else 8.0)
            elif gemma:
                param.normal_(0, 3.0)
    return model


def word_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``vocab`` tokens ``<pad> <s> </s> t3 t4 ...`` (ids as the configs'),
    whose chat template writes the messages' words one after another (the export gate renders its
    prompts with the target's template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    raw = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template="{% for message in messages %}{{ message['content'] }} {% endfor %}",
    )


def save_family(name: str, folder: Path, seed: int = 0, **more) -> PreTrainedModel:
    """:func:`tiny_family` saved with :func:`word_tokenizer` as a model folder; returns the model."""
    model = tiny_family(name, seed, **more)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model
