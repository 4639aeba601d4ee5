"""Served traffic captured while decoding: what the engine records is what the offline path computes."""

from __future__ import annotations

import pytest
import torch
from test_packing import TASKS, V  # the trainers' tiny tasks, as the packing tests build them
from tree_drafters import GreedyPrefixDrafter

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.features import FeatureDataset, hf_compute
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import UserError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.train.unroll import supervised_next

pytestmark = pytest.mark.usefixtures("one_thread")

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
        # Every token is kept and the whole reply supervised; the target read every token but the
        # last, whose row (never read by training) is zeros.
        assert row["input_ids"].tolist() == full
        assert row["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(full) - len(prompt))
        hidden, aux = offline([full[:-1]])[0]
        torch.testing.assert_close(row["hidden"][:-1], hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row["aux"][:-1], aux, atol=1e-5, rtol=1e-5)
        assert not row["hidden"][-1].any() and not row["aux"][-1].any()


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
    # A reply of no token is counted, not stored; one of one token (the end of turn at once) is
    # stored: the target's states at the prompt's end predicted it.
    decoder.generate(_prompts()[0], 0)
    assert store.empty == 1 and len(store.shards()) == 2
    decoder.generate(_prompts()[0], 1)
    assert store.empty == 1 and len(store.shards()) == 3
    assert FeatureDataset(tmp_path / "t" / "train")[2]["loss_mask"].tolist() == [0] * 6 + [1]
    other = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=8)
    with pytest.raises(UserError, match="written for target"):
        TrafficStore.for_target(tmp_path / "t", other, None, "tiny", LAYERS)
    with pytest.raises(UserError, match="written for layers"):
        TrafficStore.for_target(tmp_path / "t", target, None, "tiny", [1])


@pytest.fixture(scope="module")
def peaked(make_tiny_llama):
    """The packing tests' target: its greedy replies vary (the one above repeats a token)."""
    return make_tiny_llama(vocab_size=V, hidden_size=32, layers=3, seed=3, scale=10.0)


def _ended_by_eos(target, store: TrafficStore, prompt: list[int]) -> tuple[list[int], int]:
    """Capture ``prompt``'s greedy reply into ``store``, ended by an end-of-turn id: the reply's third
    distinct token (a reply of several tokens). Returns the reply and that id."""
    reply = SpeculativeDecoder(target, None, eos_ids=set()).generate(prompt, 12).tokens
    eos = list(dict.fromkeys(reply))[2]
    gen = SpeculativeDecoder(target, None, eos_ids={eos}, capture=store).generate(prompt, 12)
    assert gen.stop_reason != "length" and gen.tokens == reply[: reply.index(eos) + 1]
    return gen.tokens, eos


def test_a_captured_replys_end_of_turn_is_a_supervised_target(tmp_path, peaked):
    """The end of turn, never fed back to the target, is a trained token all the same: the row keeps
    it under the loss mask, and the position training scores it from holds the target's state that
    predicted it."""
    store = TrafficStore.for_target(tmp_path / "t", peaked, None, "tiny", LAYERS, shard_size=1)
    prompt = _prompts()[1]
    reply, eos = _ended_by_eos(peaked, store, prompt)
    row = FeatureDataset(tmp_path / "t" / "train")[0]
    assert row["input_ids"].tolist() == prompt + reply and len(reply) == 7 and row["input_ids"][-1] == eos
    batch = pad_batch([row])
    # Index i of supervised_next is True where token i + 2 is trained, scored from the target's state at i + 1.
    last = int(supervised_next(batch["loss_mask"], batch["attention_mask"])[0].nonzero().max())
    assert last + 2 == len(prompt) + len(reply) - 1
    assert int(peaked.lm_head(row["hidden"][last + 1]).argmax()) == eos


@pytest.mark.parametrize("kind", ["eagle_hass", "eagle3", "peagle", "medusa", "dflash"])
def test_no_trainer_reads_the_row_stored_for_a_token_never_fed_back(tmp_path, peaked, kind):
    """Every kind that trains from a feature store (EAGLE-1 with its feature regression) scores a
    batch of captured requests the same whatever their last rows hold: the zeros stored there for
    the end of turn, which the target never read, are never read by training either."""
    store = TrafficStore.for_target(tmp_path / "t", peaked, None, "tiny", [0, 1, 2], shard_size=2)
    for prompt in _prompts()[:2]:
        _ended_by_eos(peaked, store, prompt)
    rows = [dict(row) for row in FeatureDataset(tmp_path / "t" / "train")]
    task = TASKS[kind](peaked)
    results = []
    for junk in (False, True):
        for row in rows:
            for key in ("hidden", "aux"):
                row[key] = row[key].clone()
                row[key][-1] = torch.randn(row[key].shape[-1]) * 1e3 if junk else 0.0
        task.model.zero_grad()
        loss, metrics = task.loss(task.model, pad_batch(rows), training=False)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad for p in task.model.parameters() if p.grad is not None]))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert metrics_a == metrics_b and torch.equal(loss_a, loss_b) and loss_a > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_a_store_at_a_file_or_with_a_bound_of_zero_is_refused_in_one_line(tmp_path, target):
    (tmp_path / "file").write_text("")
    cases = {
        "is a file: give a folder": (tmp_path / "file", {}),
        "max_bytes must be > 0 (None: unbounded), got 0": (tmp_path / "a", {"max_bytes": 0}),
        "max_age must be > 0 (None: unbounded), got -1": (tmp_path / "b", {"max_age": -1}),
    }
    for message, (root, bounds) in cases.items():
        with pytest.raises(UserError) as refused:
            TrafficStore.for_target(root, target, None, "tiny", LAYERS, **bounds)
        assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was written
