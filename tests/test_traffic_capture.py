"""Served traffic captured while decoding: what the engine records is what the offline path computes."""

from __future__ import annotations

import pytest
import torch
from tree_drafters import GreedyPrefixDrafter

from draftsmith.data_prep.features import FeatureDataset, hf_compute
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import UserError
from draftsmith.eval.engine.decode import SpeculativeDecoder

LAYERS = [0, 1]


@pytest.fixture(scope="module")
def target(make_tiny_llama):
    return make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=7)


def _prompts():
    return [[5, 9, 3, 17, 22, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41, 40, 41, 40]]


def test_captured_states_equal_the_offline_features_of_the_same_tokens(tmp_path, target):
    store = TrafficStore.for_target(tmp_path / "traffic", target, None, "tiny", LAYERS, shard_size=2)
    plain = SpeculativeDecoder(target, None, eos_ids=set())
    generations = []
    for seed, prompt in enumerate(_prompts()):
        reference = plain.generate(prompt, 24).tokens
        # Trees with the right path scattered among wrong siblings: the kept rows are not contiguous.
        drafter = GreedyPrefixDrafter(prompt, reference, 64, seed=seed)
        gen = SpeculativeDecoder(target, drafter, eos_ids=set(), capture=store).generate(prompt, 24)
        assert gen.tokens == reference
        generations.append(list(prompt) + gen.tokens)
    store.flush()
    rows = FeatureDataset(tmp_path / "traffic" / "train")
    assert len(rows) == 3 and len(store.shards()) == 2
    offline = hf_compute(target, LAYERS)
    for i, (full, prompt) in enumerate(zip(generations, _prompts())):
        row = rows[i]
        # Every token but the last was read by the target; the reply alone is supervised.
        assert row["input_ids"].tolist() == full[:-1]
        assert row["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(full) - 1 - len(prompt))
        hidden, aux = offline([full[:-1]])[0]
        torch.testing.assert_close(row["hidden"], hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row["aux"], aux, atol=1e-5, rtol=1e-5)


def test_the_store_is_bounded_and_refuses_another_target(tmp_path, target, make_tiny_llama):
    store = TrafficStore.for_target(tmp_path / "t", target, None, "tiny", LAYERS, shard_size=1)
    decoder = SpeculativeDecoder(target, None, eos_ids=set(), capture=store)
    decoder.generate(_prompts()[0], 16)
    one = store.shards()[0].stat().st_size
    store.max_bytes = int(2.5 * one)
    for prompt in _prompts():
        decoder.generate(prompt, 16)
    # 4 requests, room for 2 shards: the 2 oldest went, and the manifest says so.
    assert len(store.shards()) == 2 and store.dropped == 2
    assert [int(p.stem.split("-")[1]) for p in store.shards()] == [2, 3]
    assert FeatureDataset(tmp_path / "t" / "train")[1]["input_ids"].tolist()[:5] == _prompts()[2]
    # A reply of one token (the end of turn at once) read nothing of the reply: counted, not stored.
    decoder.generate(_prompts()[0], 1)
    assert store.empty == 1 and len(store.shards()) == 2
    other = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=8)
    with pytest.raises(UserError, match="written for target"):
        TrafficStore.for_target(tmp_path / "t", other, None, "tiny", LAYERS)
    with pytest.raises(UserError, match="written for layers"):
        TrafficStore.for_target(tmp_path / "t", target, None, "tiny", [1])
