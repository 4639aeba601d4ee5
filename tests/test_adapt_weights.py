"""Learning where drafts fail (issue 56 item 4): the capture records which of the served drafter's drafts
the target rejected, and ``adapt.rejected_weight`` weighs those positions in the loss; w = 1 is exactly
the uniform loss. (The round on the tiny deployed head that the weights reach is in tests/test_adapt.py.)"""

from __future__ import annotations

import pytest
import torch

from draftsmith.adapt.weights import RejectedWeighted, rejected_weights, weighted
from draftsmith.data_prep.dataset import LOSS_WEIGHT, pad_batch
from draftsmith.data_prep.features import FeatureDataset, RowSelection, write_shard
from draftsmith.data_prep.traffic import (
    ACCEPTED,
    NOT_DRAFTED,
    REJECTED,
    SERVED_DRAFT,
    TrafficStore,
    draft_outcomes,
)
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.train.unroll import UnrollLoss, unroll, unrolled_loss

pytestmark = pytest.mark.usefixtures("one_thread")

A, R, N = ACCEPTED, REJECTED, NOT_DRAFTED
LAYERS = [0, 1]


def test_a_steps_outcomes_follow_its_tree_and_accepted_path():
    chain = [ROOT, 0, 1]  # a chain of 3
    assert draft_outcomes(chain, [0]) == [A, R]  # depth 2 rejected: the target's token corrects it
    assert draft_outcomes(chain, []) == [R]  # depth 1 rejected
    assert draft_outcomes(chain, [0, 1, 2]) == [A, A, A, N]  # all accepted: a bonus token, nothing drafted there
    tree = [ROOT, ROOT, 0]  # two candidates at depth 1, one child below the first
    assert draft_outcomes(tree, [1]) == [A, N]  # the accepted leaf had nothing below it
    assert draft_outcomes(tree, [0]) == [A, R]
    assert draft_outcomes(None, []) == draft_outcomes([], []) == [N]  # nothing drafted this step


class _ChainPeek(Drafter):
    """Drafts the known continuation's next ``k`` tokens as a chain (k cycling 0, 1, 2, 3), and on every
    other step one wrong token below them; records what each step must yield."""

    name = "chain_peek"

    def __init__(self, full: list[int], vocab: int):
        self.full, self.vocab, self.calls, self.expected = full, vocab, 0, [N]

    def propose(self, context: DraftContext) -> TokenTree:
        n, k, wrong = len(context.tokens), self.calls % 4, self.calls % 2 == 1
        self.calls += 1
        k = min(k, context.max_tokens)
        wrong = wrong and k < context.max_tokens
        builder, parent = TreeBuilder(), ROOT
        for token in self.full[n : n + k]:
            (parent,) = builder.add(parent, [token])
        if wrong:
            builder.add(parent, [(self.full[n + k] + 1) % self.vocab])
        self.expected += [A] * k + [R if wrong else N]
        return builder.build()


def test_the_capture_records_where_the_served_draft_was_rejected(tmp_path, make_tiny_llama):
    target = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=7)
    prompt, new = [5, 9, 3, 17, 22, 8], 20
    reference = SpeculativeDecoder(target, None, eos_ids=set()).generate(prompt, new).tokens
    store = TrafficStore.for_target(tmp_path / "traffic", target, None, "tiny", LAYERS)
    drafter = _ChainPeek(prompt + reference, 64)
    gen = SpeculativeDecoder(target, drafter, eos_ids=set(), capture=store).generate(prompt, new)
    assert gen.tokens == reference
    store.add(prompt + reference, len(prompt), torch.zeros(len(prompt) + new, 32), torch.zeros(len(prompt) + new, 64))
    store.flush()
    rows = FeatureDataset(tmp_path / "traffic" / "train")
    recorded = rows[0][SERVED_DRAFT].tolist()
    assert recorded == [N] * len(prompt) + drafter.expected[:new]
    assert R in recorded and A in recorded  # the stream exercised both
    # A request added without the record (a user's loop, or stores written before it) is all not-drafted.
    assert rows.per_token(SERVED_DRAFT)[1] == [N] * (len(prompt) + new)
    with pytest.raises(ValueError, match="one outcome"):
        store.add(prompt + reference, len(prompt), torch.zeros(len(prompt) + new, 32), None, [A])


def test_a_store_written_before_the_record_reads_as_uniform(tmp_path):
    """Old shards hold no served_draft: rows come without it, and weighted rows without loss weights."""
    identity = {"layers": [], "storage": "auto"}
    path = tmp_path / "train" / "shard-000000.safetensors"
    path.parent.mkdir(parents=True)
    write_shard(path, [[1, 2, 3, 4]], [[0, 0, 1, 1]], [(torch.ones(4, 8), None)], identity)
    rows = FeatureDataset(tmp_path / "train")
    assert SERVED_DRAFT not in rows[0] and rows.per_token(SERVED_DRAFT) == [None]
    row = RejectedWeighted(RowSelection([(rows, 0)]), 4.0)[0]
    assert LOSS_WEIGHT not in row and LOSS_WEIGHT not in pad_batch([row])


def test_rejected_positions_get_weight_w_and_the_others_one():
    outcomes = torch.tensor([N, N, A, R, A, A, N, R], dtype=torch.int8)
    assert rejected_weights(outcomes, 3.0).tolist() == [1, 1, 1, 3, 1, 1, 1, 3]
    assert rejected_weights(outcomes, 1.0).tolist() == [1.0] * 8
    # Rows with and without weights in one batch: 1 where a row has none (replay), and on the padding.
    with_weights = {"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.bool)}
    with_weights[LOSS_WEIGHT] = torch.tensor([1.0, 3.0, 1.0, 3.0])
    plain = {"input_ids": torch.arange(3), "loss_mask": torch.ones(3, dtype=torch.bool)}
    batch = pad_batch([with_weights, plain])
    assert batch[LOSS_WEIGHT].tolist() == [[1, 3, 1, 3], [1, 1, 1, 1]]
    assert weighted(plain, 1.0) is plain  # w = 1: the rows as they are, no weights at all


def _head_and_outputs(make_tiny_llama):
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = Eagle3Head.for_target(target, "tiny", aux_layers=[0, 1, 2], init="random").eval()
    ids = [3, 9, 4, 17, 6, 11, 2, 30, 7, 12]
    states = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([states.hidden_states[layer] for layer in (0, 1, 2)], dim=-1)
    pad = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        outputs = [o.detach() for o in unroll(head, torch.tensor([ids]), aux[:, :-1], pad, 3, head.feedback_input)]
    return head, outputs, states.last_hidden_state.detach(), len(ids), pad


def test_the_loss_is_the_weighted_mean_and_w_one_is_exactly_uniform(make_tiny_llama):
    """On real tensors (a random EAGLE-3 head over a tiny target): each token's loss from a mask of it
    alone; the weighted loss is sum(w_t * loss_t) / sum(w_t), rejected tokens at w, accepted at 1."""
    head, outputs, last, n, pad = _head_and_outputs(make_tiny_llama)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 3:] = True  # the reply: tokens 3..9
    outcomes = torch.tensor([[N, N, N, N, A, R, A, A, R, N]], dtype=torch.int8)
    cfg = UnrollLoss()
    with torch.no_grad():
        uniform, metrics = unrolled_loss(head, outputs, last, mask, pad, cfg, True)
        ones, ones_metrics = unrolled_loss(head, outputs, last, mask, pad, cfg, True, weights=torch.ones(1, n))
        assert torch.equal(uniform, ones) and metrics == ones_metrics  # the negative control: bit for bit
        w = 5.0
        weights = rejected_weights(outcomes, w)
        weighted_loss, weighted_metrics = unrolled_loss(head, outputs[:1], last, mask, pad, cfg, True, weights=weights)
        singles = {}
        for t in range(3, n):  # every reply token is scored at depth 1 (from position t - 2)
            alone = torch.zeros_like(mask)
            alone[0, t] = True
            singles[t] = unrolled_loss(head, outputs[:1], last, alone, pad, cfg, True)[0]
        expected = sum(weights[0, t] * loss for t, loss in singles.items()) / sum(weights[0, t] for t in singles)
        torch.testing.assert_close(weighted_loss, expected)
        plain_one = unrolled_loss(head, outputs[:1], last, mask, pad, cfg, True)[0]
        assert not torch.allclose(weighted_loss, plain_one)  # the weights moved it
        # Metrics stay counts of the scored tokens, unweighted.
        assert weighted_metrics["top1"] == unrolled_loss(head, outputs[:1], last, mask, pad, cfg, True)[1]["top1"]
        # Every depth and P-EAGLE's pooled mean take them too; w = 1 there is exact as well.
        pooled = UnrollLoss(pool_depths=True)
        base = unrolled_loss(head, outputs, last, mask, pad, pooled, True)[0]
        ones = unrolled_loss(head, outputs, last, mask, pad, pooled, True, weights=torch.ones(1, n))[0]
        assert torch.equal(base, ones)
        assert not torch.allclose(base, unrolled_loss(head, outputs, last, mask, pad, pooled, True, weights=weights)[0])
        deep = unrolled_loss(head, outputs, last, mask, pad, cfg, True, weights=weights)[0]
        assert not torch.allclose(deep, uniform)
