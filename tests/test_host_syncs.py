"""Host overhead of the decode loop: device-to-host transfers per step, top-p without a full sort,
the inverse-CDF sampler and the preallocated cache growing past its capacity.

Syncs are counted with :func:`count_host_syncs` (it wraps ``Tensor.item/tolist/__bool__/...``),
per step between two streamer calls; on a CPU they cost nothing, on a GPU each one waits for the
device, so the bounds here are what keeps a GPU step launch-bound.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch
from tree_drafters import RandomTreeDrafter

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.host_syncs import count_host_syncs
from draftsmith.eval.engine.kv_cache import SlotCache
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.engine.target_runner import CausalLMRunner

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 3, 17, 22, 8, 40, 41]


def syncs_per_step(model, drafter, sampling, new_tokens=30) -> list[int]:
    decoder = SpeculativeDecoder(model, drafter, None, sampling, eos_ids=set())
    marks: list[int] = []
    with count_host_syncs() as counter:
        decoder.generate(PROMPT, new_tokens, streamer=lambda tokens: marks.append(counter.count), seed=0)
    return [b - a for a, b in zip(marks, marks[1:])]


def test_the_counter_counts_each_transfer_once():
    t = torch.arange(5)
    with count_host_syncs() as counter:
        t.tolist(), int(t[0]), float(t[1]), bool(t[2]), t.sum().item(), t.numpy(), t.cpu()
        t + 1  # no transfer
    assert counter.count == 7
    assert torch.Tensor.tolist is not None and t.tolist() == [0, 1, 2, 3, 4]  # restored


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_greedy_step_reads_back_once(make_tiny_llama, tree):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=10.0)
    steps = syncs_per_step(model, RandomTreeDrafter(64, seed=2) if tree else None, SamplingConfig())
    assert len(steps) >= 10
    assert steps == [1] * len(steps)  # the accepted path (or token) and nothing else


def test_confidence_gate_rides_on_the_steps_read_back(make_tiny_llama):
    """The gate's flag comes back with the verdict: still one transfer per greedy step, drafting or not."""
    from draftsmith.eval.engine.policies import PolicyConfig

    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=10.0)
    drafter = RandomTreeDrafter(64, seed=2)
    drafter.policy = PolicyConfig(confidence=0.9)
    decoder = SpeculativeDecoder(model, drafter, None, SamplingConfig(), eos_ids=set())
    marks: list[int] = []
    with count_host_syncs() as counter:
        gen = decoder.generate(PROMPT, 30, streamer=lambda tokens: marks.append(counter.count))
    assert [b - a for a, b in zip(marks, marks[1:])] == [1] * gen.steps
    assert 0 < gen.drafted.count(0) < gen.steps  # the gate both held drafting back and let it through


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_sampling_step_reads_back_at_most_twice(make_tiny_llama, tree):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=10.0)
    sampling = SamplingConfig(temperature=1.0, top_k=40, top_p=0.9)
    steps = syncs_per_step(model, RandomTreeDrafter(64, seed=2) if tree else None, sampling)
    assert len(steps) >= 10
    # The verdict, and whether top-p's cut lies among the best candidates.
    assert max(steps) <= 2 and min(steps) >= 1


def sorted_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: top-p by a full sort (what probabilities() did before)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    mass = sorted_logits.softmax(-1)
    drop_sorted = (mass.cumsum(-1) - mass) >= top_p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf")).softmax(-1)


def test_top_p_without_a_sort_matches_the_sort():
    generator = torch.Generator().manual_seed(0)
    vocab = 2000
    peaked = torch.randn(3, vocab, generator=generator) * 8  # cut among the best 256
    flat = torch.randn(2, vocab, generator=generator) * 0.1  # cut far below them: the sorted path
    for logits in (peaked, flat, torch.cat([peaked, flat])):
        for top_p in (0.5, 0.9, 0.99):
            ours = probabilities(logits, SamplingConfig(temperature=1.0, top_p=top_p))
            reference = sorted_top_p(logits, top_p)
            assert torch.equal(ours > 0, reference > 0)
            assert torch.allclose(ours, reference, atol=1e-6)
    kept = (probabilities(flat, SamplingConfig(1.0, top_p=0.9)) > 0).sum(-1)
    assert (kept > 256).all()  # the flat rows really needed more than the candidates
    # Top-k first, then top-p over what it left (1000 > the 256 candidates: the radix select).
    kth = torch.topk(flat, 1000, dim=-1).values[..., -1:]
    reference = sorted_top_p(flat.masked_fill(flat < kth, float("-inf")), 0.9)
    ours = probabilities(flat, SamplingConfig(temperature=1.0, top_k=1000, top_p=0.9))
    assert torch.equal(ours > 0, reference > 0) and torch.allclose(ours, reference, atol=1e-6)
    assert 256 < (ours > 0).sum(-1).min() and (ours > 0).sum(-1).max() < 1000


def test_inverse_cdf_sampler_follows_the_distribution_and_skips_zeros():
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    generator = torch.Generator().manual_seed(1)
    draws = sample(p.expand(60000, -1), generator).tolist()
    counts = collections.Counter(draws)
    assert set(counts) == {1, 3, 4}
    for token in (1, 3, 4):
        assert abs(counts[token] / 60000 - float(p[token])) < 0.01


def test_cache_grows_past_its_capacity_and_keeps_trees_exact(make_tiny_llama):
    """A cache of 3 rows doubling to hold a 20-token prefix and trees gives plain decoding's logits."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=5, scale=10.0)
    rng = random.Random(0)
    ids = [rng.randrange(64) for _ in range(20)]
    runner = CausalLMRunner(model)
    runner.cache = SlotCache(model.config.num_hidden_layers, capacity=3)
    runner.reset()
    runner.forward(ids[:15])
    # A tree whose second branch is the true continuation: commit it and continue as a chain.
    runner.forward([ids[15], 1, ids[16], ids[17]], [-1, 0, 0, 2], [0, 1, 1, 2])
    runner.commit([0, 2, 3])
    assert runner.cache.capacity >= 18 and runner.length == 18
    logits = runner.logits(runner.forward(ids[18:]))[-1]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, -1]
    assert (logits - reference).abs().max() < 1e-5
