"""Targets beyond plain causal attention: sliding windows, mixed layer types, other attention
implementations and context limits.

Tiny random-weight Mistral (one window for every layer), Qwen2 and Gemma-2/3 (``layer_types``
mixing sliding and full layers) targets in fp32 decode well past their window; tree decoding with
wrong and right branches, a draft LM and an EAGLE head must give Hugging Face's own greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    MistralConfig,
    Qwen2Config,
)
from tree_drafters import GreedyPrefixDrafter, RandomTreeDrafter

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.eagle import EagleDrafter
from draftsmith.eval.engine.target_runner import CausalLMRunner, ContextLengthError, UnsupportedTargetError
from draftsmith.heads.draft_lm import derive_draft_lm
from draftsmith.heads.eagle import EagleHead

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, WINDOW, NEW_TOKENS = 64, 5, 40
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIGS = {
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED),
    "gemma2": lambda: Gemma2Config(**COMMON, sliding_window=WINDOW, layer_types=MIXED),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, sliding_window=WINDOW, layer_types=MIXED, query_pre_attn_scalar=8),
}


def tiny(kind: str):
    """A random-weight target of architecture ``kind``, weights scaled up for varied greedy text."""
    torch.manual_seed(0)
    # Gemma-2 soft-caps attention logits, which only eager attention implements.
    impl = "eager" if kind == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation=impl).eval()
    gemma = kind.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0 if gemma else 8.0)
            elif gemma:  # Gemma norms scale by 1 + weight, from 0: the default is context-blind here
                param.normal_(0, 3.0)
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_tree_decoding_is_lossless_with_sliding_windows(kind):
    model = tiny(kind)
    prompt = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = hf_greedy(model, prompt)
    assert len(set(reference)) > 5  # varied text, so a wrong window would show
    torch.manual_seed(0)
    head = EagleHead.for_target(model, kind, init="random")
    drafters = {
        "plain": None,
        "greedy_prefix": GreedyPrefixDrafter(prompt, reference, VOCAB, seed=3),
        "random_tree": RandomTreeDrafter(VOCAB, seed=2),
        "draft_lm_tree": DraftLMDrafter(derive_draft_lm(model, num_layers=2), depth=3, top_k=2, budget=6),
        "eagle": EagleDrafter(head, depth=3, top_k=2, budget=6),
    }
    for name, drafter in drafters.items():
        for cuda_graphs in ("off", "on"):  # on: the static-shape path CUDA graphs replay, run eagerly
            gen = SpeculativeDecoder(model, drafter, eos_ids=set(), cuda_graphs=cuda_graphs).generate(
                prompt, NEW_TOKENS
            )
            assert gen.tokens == reference, f"{kind} with {name}, cuda_graphs={cuda_graphs}"
    assert max(drafters["greedy_prefix"].expected) > 1  # trees were accepted beyond the root


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_eagle_head_attends_to_everything_whatever_the_target_layers(kind):
    head = EagleHead.for_target(tiny(kind), kind, num_layers=2)
    assert getattr(head.config, "sliding_window", None) is None
    assert getattr(head.config, "layer_types", None) in (None, ["full_attention"] * 2)
    runner = CausalLMRunner(decoder=head, lm_head=head.logits, config=head.config)
    assert runner.window is None


def test_eagle_head_for_a_soft_capping_target_reloads_with_eager_attention(tmp_path):
    target = tiny("gemma2")
    head = EagleHead.for_target(target, "gemma2", init="random")
    head.save_pretrained(tmp_path / "head")
    loaded = EagleHead.from_pretrained(tmp_path / "head", target)
    assert loaded.config._attn_implementation == "eager"
    ids, features = torch.tensor([[3, 4, 5]]), torch.randn(1, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, features).last_hidden_state, head(ids, features).last_hidden_state)


def scaled(kind: str):
    """A random-weight target whose forward changes its LM head's logits: Gemma-2 soft-caps them,
    Granite divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``."""
    if kind == "gemma2":
        return tiny(kind)
    torch.manual_seed(0)
    config = (
        GraniteConfig(**COMMON, logits_scaling=8.0) if kind == "granite" else CohereConfig(**COMMON, logit_scale=0.5)
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["gemma2", "granite", "cohere"])
def test_verification_logits_are_the_forwards_own(kind):
    model = scaled(kind)
    ids = torch.tensor([[3, 4, 5, 6]])
    runner = CausalLMRunner(model)
    runner.reset()
    logits = runner.logits(runner.forward(ids[0].tolist()))
    torch.testing.assert_close(logits, model(ids).logits[0].float())


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged|sdpa"])
def test_attention_that_ignores_the_tree_mask_is_refused(impl, make_tiny_llama):
    model = make_tiny_llama()
    model.config._attn_implementation = impl
    with pytest.raises(UnsupportedTargetError, match='attn_implementation="sdpa"') as err:
        CausalLMRunner(model)
    assert "\n" not in str(err.value)


def test_unknown_layer_types_are_refused(make_tiny_llama):
    model = make_tiny_llama()
    model.config.layer_types = ["full_attention", "chunked_attention"]  # Llama-4-style chunks: no tree mask for them
    with pytest.raises(UnsupportedTargetError, match="chunked_attention") as err:
        CausalLMRunner(model)
    assert "\n" not in str(err.value)


def test_requests_past_the_context_are_refused_before_decoding(make_tiny_llama):
    model = make_tiny_llama()  # max_position_embeddings=512
    decoder = SpeculativeDecoder(model, RandomTreeDrafter(64, seed=0), eos_ids=set())
    prompt = [2 + i % 60 for i in range(494)]
    assert len(decoder.generate(prompt[:493], 20).tokens) == 20  # 493 + 20 - 1 = 512 positions: fits
    with pytest.raises(ContextLengthError, match="max_position_embeddings=512") as err:
        decoder.generate(prompt, 20)
    assert "\n" not in str(err.value)
