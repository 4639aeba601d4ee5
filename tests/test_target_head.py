"""load_target(head_only=True): a target's input embeddings, LM head and final norm read from its
safetensors, equal to the full target's, with the decoder layers left on the meta device."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from draftsmith.errors import UserError
from draftsmith.target import is_head_only, load_target, load_tokenizer, move_target, target_record


@pytest.fixture(scope="module")
def tokenizer():
    """Any tokenizer will do: a target folder needs one, and the tiny models never decode text."""
    return load_tokenizer("default")


def saved_tiny(make_tiny_llama, tokenizer, folder, tied: bool = True, **save_options) -> LlamaForCausalLM:
    """A tiny random Llama saved with its tokenizer in ``folder``; its norm is random too, so a
    norm left at its initial ones would not pass for a loaded one."""
    model = make_tiny_llama(seed=3)
    if not tied:
        model.config.tie_word_embeddings = False
        torch.manual_seed(4)
        model = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **save_options)
    tokenizer.save_pretrained(folder)
    return model


def assert_head_equal(head, model):
    assert torch.equal(head.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert torch.equal(head.model.norm.weight, model.model.norm.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_head_only_target_has_the_checkpoints_head_and_nothing_else(make_tiny_llama, tokenizer, tmp_path, tied):
    model = saved_tiny(make_tiny_llama, tokenizer, tmp_path, tied)
    head, head_tokenizer = load_target(str(tmp_path), "float32", "cpu", head_only=True)

    assert_head_equal(head, model)
    assert (head.lm_head.weight is head.model.embed_tokens.weight) == tied
    if not tied:
        assert not torch.equal(head.lm_head.weight, head.model.embed_tokens.weight)
    assert head.model.layers[0].self_attn.q_proj.weight.is_meta
    assert head.model.layers[1].mlp.down_proj.weight.is_meta
    assert all(p.is_meta or (p.device.type == "cpu" and not p.requires_grad) for p in head.parameters())
    assert is_head_only(head) and not head.training
    assert head_tokenizer.vocab_size == tokenizer.vocab_size

    full, _ = load_target(str(tmp_path), "float32", "cpu")
    assert not is_head_only(full)
    assert target_record(head, "tiny") == target_record(full, "tiny")

    with pytest.raises(RuntimeError, match="loaded head-only"):
        head(torch.tensor([[2, 3, 4]]))

    # What training does with its target: the loaded part moves (ties intact), the rest stays meta.
    assert move_target(head, "cpu") is head
    assert (head.lm_head.weight is head.model.embed_tokens.weight) == tied
    assert head.model.layers[0].self_attn.q_proj.weight.is_meta
    assert_head_equal(head, model)


def test_head_only_load_casts_to_the_requested_dtype(make_tiny_llama, tokenizer, tmp_path):
    model = saved_tiny(make_tiny_llama, tokenizer, tmp_path).to(torch.bfloat16)
    head, _ = load_target(str(tmp_path), "bfloat16", "cpu", head_only=True)
    assert head.model.norm.weight.dtype == torch.bfloat16
    assert head.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert_head_equal(head, model)


def test_sharded_checkpoint_needs_only_the_shards_holding_the_head(make_tiny_llama, tokenizer, tmp_path):
    model = saved_tiny(make_tiny_llama, tokenizer, tmp_path, tied=False, max_shard_size="10KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map[key] for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    unneeded = set(weight_map.values()) - needed
    assert len(unneeded) >= 3
    for shard in unneeded:
        (tmp_path / shard).unlink()

    head, _ = load_target(str(tmp_path), "float32", "cpu", head_only=True)
    assert_head_equal(head, model)
    assert head.model.layers[0].self_attn.q_proj.weight.is_meta


def test_missing_head_tensor_is_a_user_error_naming_file_and_key(make_tiny_llama, tokenizer, tmp_path):
    saved_tiny(make_tiny_llama, tokenizer, tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights)
    with pytest.raises(UserError, match=r"target: .*model\.safetensors has no tensor model\.norm\.weight") as error:
        load_target(str(tmp_path), "float32", "cpu", head_only=True)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_bundled_target_head_gives_the_full_targets_logits(smollm2):
    full, _ = smollm2
    head, _ = load_target("default", "float32", "cpu", head_only=True)
    assert head.lm_head.weight is head.model.embed_tokens.weight  # SmolLM2 ties its embeddings
    hidden = torch.randn(3, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full.lm_head(full.model.norm(hidden))
        logits = head.lm_head(head.model.norm(hidden))
    assert logits.shape == (3, 49152)
    assert torch.equal(logits, expected)
    assert target_record(head, "default") == target_record(full, "default")
