"""Shared fixtures: the bundled SmolLM2 target (loaded once) and tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.plugins import register_builtin
from draftsmith.target import load_target

# Tests build drafters and export through the registry as the entry points do.
register_builtin()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct in fp32 on the CPU, with its tokenizer."""
    model, tokenizer = load_target("default", dtype="float32", device="cpu")
    return model, tokenizer


def tiny_llama(
    vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, seed: int = 0, scale: float = 1.0
) -> LlamaForCausalLM:
    """A random-weight Llama small enough for exhaustive or statistical tests.

    At the default init (std 0.02) such a model is nearly uniform and context-blind, so greedy
    decoding repeats one token; ``scale`` multiplies every weight except the norms (10-20 gives
    peaked, context-dependent distributions and varied greedy text).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.mul_(scale)
    return model


@pytest.fixture(scope="session")
def make_tiny_llama():
    """``tiny_llama`` as a fixture: with ``--import-mode=importlib`` tests cannot import conftest."""
    return tiny_llama


@pytest.fixture(scope="session")
def tiny_pair_target():
    """The statistical tests' target: 8 tokens, peaked (weights x 15)."""
    return tiny_llama(vocab_size=8, hidden_size=32, layers=1, seed=0, scale=15.0)


@pytest.fixture(scope="session")
def tiny_pair_draft():
    """A draft unrelated to ``tiny_pair_target`` (other seed, flatter): many rejections, some acceptances."""
    return tiny_llama(vocab_size=8, hidden_size=32, layers=1, seed=1, scale=8.0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for tiny models: their ops are all overhead, and two threads on two
    busy cores stall (10-100x slower) on oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
