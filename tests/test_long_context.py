"""Long conversations on bounded memory (issue 58 item 2): chunked-prefill feature extraction, the
store's size stated (and refused) before it is written, and EAGLE-3 training on rows too long for
dense ``n x n`` masks."""

from __future__ import annotations

from functools import partial

import datasets
import pytest
import torch

from draftsmith.config import RecipeError, from_dict
from draftsmith.data_prep.features import (
    FeatureDataset,
    StoreSize,
    extract_features,
    hf_compute,
    shard_bounds,
    store_bytes,
    store_identity,
)
from draftsmith.errors import UserError
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.peagle import PEagleHead
from draftsmith.recipe import FeaturesConfig
from draftsmith.train import unroll as unroll_module
from draftsmith.train.peagle import mask_inputs
from draftsmith.train.unroll import UnrollLoss, chain_sample, supervised_next, unroll, unrolled_loss

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 2, 4]  # the embeddings, a middle layer's input and the last (normed) state


@pytest.fixture(scope="module")
def target(make_tiny_llama):
    return make_tiny_llama(vocab_size=64, hidden_size=32, layers=4, seed=5, scale=4.0)


def _reference(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, aux)`` of one forward pass over the whole conversation, every layer's states returned."""
    out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.last_hidden_state[0], torch.cat([out.hidden_states[layer][0] for layer in LAYERS], dim=-1)


@torch.no_grad()
def test_chunked_prefill_equals_one_pass_and_a_fresh_cache_per_chunk_does_not(target):
    ids = torch.randint(2, 64, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden, aux = _reference(target, ids)
    for prefill in (64, 7, 1000):  # chunks of 64 and of 7 (a ragged last one), and the whole at once
        [(h, a)] = hf_compute(target, LAYERS, prefill=prefill)([ids])
        assert h.shape == hidden.shape and a.shape == aux.shape
        torch.testing.assert_close(h, hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, aux, atol=1e-5, rtol=1e-5)
    # Negative control: each chunk without the earlier ones' cache (what a lost cache would give).
    alone = [hf_compute(target, LAYERS, prefill=64)([ids[i : i + 64]])[0] for i in range(0, 300, 64)]
    wrong_h, wrong_a = torch.cat([h for h, _ in alone]), torch.cat([a for _, a in alone])
    assert (wrong_h[:64] - hidden[:64]).abs().max() < 1e-5  # the first chunk has no earlier context to lose
    assert (wrong_h[64:] - hidden[64:]).abs().max() > 1e-2
    assert (wrong_a[64:, 32:] - aux[64:, 32:]).abs().max() > 1e-2  # layer 2's input: attention has run
    # Kept in bf16 as they come: the fp32 states rounded once.
    [(h16, a16)] = hf_compute(target, LAYERS, keep=torch.bfloat16, prefill=64)([ids])
    assert h16.dtype == a16.dtype == torch.bfloat16
    assert torch.equal(a16, aux.to(torch.bfloat16)) and torch.equal(h16, hidden.to(torch.bfloat16))


def _data(lengths: list[int]) -> datasets.DatasetDict:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})})


def test_shards_close_at_a_token_budget():
    assert shard_bounds([5, 5, 5, 5, 5], shard_size=2, shard_tokens=100) == [range(0, 2), range(2, 4), range(4, 5)]
    # 12 tokens a shard at most: a conversation longer than that gets a shard of its own
    assert shard_bounds([5, 5, 5, 30, 5], shard_size=64, shard_tokens=12) == [
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 5),
    ]
    assert shard_bounds([], 4, 10) == []


@pytest.mark.parametrize("storage", ["auto", "bfloat16", "float8"])
def test_the_stated_size_is_the_written_size(target, tmp_path, storage, capsys):
    data = _data([120, 300, 75, 410, 260, 33])
    identity = store_identity("tiny", target, None, LAYERS, storage, data)
    size = StoreSize(target.config.hidden_size, torch.float32)
    expected = store_bytes(data, identity, size, shard_size=2)
    manifest = extract_features(target, data, tmp_path / "store", shard_size=2, layers=LAYERS, identity=identity)
    assert f"will take {expected / 2**30:.2f} GiB" in capsys.readouterr().out
    assert abs(expected - manifest["bytes"]) / manifest["bytes"] < 0.01
    # The estimate follows what is stored: without the layers it is a quarter of the states.
    bare = store_bytes(data, {**identity, "layers": []}, size, shard_size=2)
    assert abs(bare - manifest["bytes"]) / manifest["bytes"] > 0.5
    if storage == "bfloat16":
        row = FeatureDataset(tmp_path / "store" / "train")[1]
        assert row["aux"].dtype == torch.bfloat16 and row["aux"].shape == (300, 3 * 32)
        reference = _reference(target, data["train"][1]["input_ids"])[1]
        assert (row["aux"].float() - reference).abs().max() < 5e-2


def test_a_store_past_max_gb_is_refused_in_one_line_before_anything_is_written(target, tmp_path):
    data = _data([400, 400])
    identity = store_identity("tiny", target, None, LAYERS, "auto", data)
    expected = store_bytes(data, identity, StoreSize(32, torch.float32)) / 2**30
    root = tmp_path / "store"
    with pytest.raises(UserError) as err:
        extract_features(target, data, root, show=False, layers=LAYERS, identity=identity, max_gb=expected / 2)
    message = str(err.value)
    assert "\n" not in message and "data.features.max_gb" in message and f"{expected:.2f} GiB" in message
    assert not list(root.glob("*/shard-*"))
    # Just above the estimate it is written.
    with pytest.raises(RecipeError, match="max_gb must be a number > 0"):
        from_dict(FeaturesConfig, {"max_gb": 0})
    assert from_dict(FeaturesConfig, {"max_gb": 0.5}).max_gb == 0.5
    bound = expected * 1.05
    manifest = extract_features(target, data, root, show=False, layers=LAYERS, identity=identity, max_gb=bound)
    assert manifest["bytes"] / 2**30 <= bound


# ---------------------------------------------------------------------------------------------
# Training on rows too long for dense masks


def _unrolled(head, batch, features, hidden, chains, dense_rows, cfg, parallel=False):
    """Outputs, loss and the head's gradients of one unroll (``dense_rows``: the long-row threshold;
    ``parallel``: P-EAGLE's later passes, :func:`mask_inputs`)."""
    head.zero_grad()
    later_inputs = partial(mask_inputs, head.mask_token_id) if parallel else None
    outputs = unroll(
        head, batch["input_ids"], features, batch["attention_mask"], cfg.steps, head.feedback_input,
        later_inputs=later_inputs, chains=chains, dense_rows=dense_rows,
    )  # fmt: skip
    loss, metrics = unrolled_loss(head, outputs, hidden, batch["loss_mask"], batch["attention_mask"], cfg, True, chains)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}
    return outputs, loss.detach(), metrics, grads


@pytest.mark.parametrize(("sampled", "parallel"), [(False, False), (True, False), (True, True)])
def test_a_long_row_trains_as_a_short_one_without_dense_masks(target, monkeypatch, sampled, parallel):
    """Two packed rows (three conversations and padding), 4 passes: segment-id masks in query chunks
    of 5, checkpointed passes and the loss in chunks of 7 rows give the dense path's outputs, loss,
    metrics and gradients (with chain sampling: its sampled passes' too; P-EAGLE's parallel passes
    as well); the same masks without the boundaries do not."""
    torch.manual_seed(0)
    # Random, not identity, initialisation: an identity head's layer is a no-op that attends to nothing.
    vocab = torch.arange(0, 64, 2)
    if parallel:
        head = PEagleHead.for_target(target, "tiny", [0, 2, 4], vocab, "random", mask_token_id=63, num_depths=4)
    else:
        head = Eagle3Head.for_target(target, "tiny", aux_layers=[0, 2, 4], draft_vocab=vocab, init="random")
    gen = torch.Generator().manual_seed(3)
    length = 48
    segments = torch.tensor([[1] * 20 + [2] * 28, [1] * 30 + [2] * 10 + [0] * 8])
    batch = {
        "input_ids": torch.randint(2, 64, (2, length), generator=gen),
        "attention_mask": segments,
        "loss_mask": (torch.rand(2, length, generator=gen) > 0.3) & segments.bool(),
    }
    features = torch.randn(2, length - 1, 3 * 32, generator=gen)
    hidden = torch.randn(2, length, 32, generator=gen)
    cfg = UnrollLoss(steps=4)
    chains = None
    if sampled:
        chains = chain_sample(supervised_next(batch["loss_mask"], segments), cfg.steps, 0.6, 0.3, segments)
    dense = _unrolled(head, batch, features, hidden, chains, 10**6, cfg, parallel)
    monkeypatch.setattr(unroll_module, "ATTENTION_CHUNK", 5 * 2 * (length - 1))  # 5 queries a chunk
    monkeypatch.setattr(unroll_module, "LOSS_CHUNK", 7 * 32)  # 7 rows of the 32-token draft vocabulary
    long = _unrolled(head, batch, features, hidden, chains, 0, cfg, parallel)
    for a, b in zip(dense[0], long[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dense[1], long[1], atol=1e-6, rtol=1e-5)
    assert dense[2].keys() == long[2].keys()
    for key in dense[2]:
        assert dense[2][key] == pytest.approx(long[2][key], rel=1e-5, abs=1e-5), key
    assert dense[3].keys() == long[3].keys()
    for key in dense[3]:
        torch.testing.assert_close(dense[3][key], long[3][key], atol=1e-5, rtol=1e-4)
    # Negative control: one segment a row (the packing boundaries lost).
    crossed = _unrolled(
        head, {**batch, "attention_mask": segments.bool().long()}, features, hidden, chains, 0, cfg, parallel
    )
    assert (crossed[0][0][0, 20:] - long[0][0][0, 20:]).abs().max() > 1e-3
    assert (crossed[0][0][0, :19] - long[0][0][0, :19]).abs().max() < 1e-5  # the first conversation sees the same
