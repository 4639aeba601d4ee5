"""Batched decoding: every row decodes exactly as the same prompt alone (fp32, tiny random target).

Prompts of different lengths (right-padded prefill, holes in the shared cache), drafters whose
accepted rows are scattered through their trees (per-row compaction), rows that stop early,
and sampling with per-row generators: each row must give the single-prompt decoder's tokens and
per-step acceptance.
"""

from __future__ import annotations

import random

import pytest
from tree_drafters import GreedyPrefixDrafter, RandomTreeDrafter

from draftsmith.errors import UsageError
from draftsmith.eval.engine.batch_decode import BatchDecoder
from draftsmith.eval.engine.decode import SpeculativeDecoder, autoregressive_greedy
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.oracle import OracleDrafter
from draftsmith.eval.engine.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.engine.policies import PolicyConfig
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.target_runner import CausalLMRunner

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64
NEW = 24


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    # Repeated n-grams so that prompt lookup finds continuations; lengths 5 to 31.
    return [[rng.randrange(2, 12) for _ in range(length)] for length in (5, 31, 12, 20)]


@pytest.fixture(scope="module")
def model(make_tiny_llama):
    return make_tiny_llama(vocab_size=V, hidden_size=32, layers=2, seed=4, scale=10.0)


def alone(model, prompt, drafter, sampling=SamplingConfig(), seed=None, eos_ids=None):
    return SpeculativeDecoder(model, drafter, None, sampling, eos_ids=eos_ids).generate(prompt, NEW, seed=seed)


@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "oracle", "scattered", "mixed"])
def test_greedy_rows_equal_single_prompt_decoding(model, kind):
    runner = CausalLMRunner(model)

    def make(i, prompt):
        if kind == "plain" or (kind == "mixed" and i % 2):
            return None
        if kind in ("prompt_lookup", "mixed"):
            return PromptLookupDrafter(num_tokens=4, branches=2)
        if kind == "oracle":
            return OracleDrafter(runner, num_tokens=5)
        return GreedyPrefixDrafter(prompt, autoregressive_greedy(runner, prompt, NEW), V, seed=i)

    batch = BatchDecoder(model, eos_ids=set()).generate(prompts(), NEW, [make(i, p) for i, p in enumerate(prompts())])
    for i, prompt in enumerate(prompts()):
        single = alone(model, prompt, make(i, prompt), eos_ids=set())
        assert batch[i].tokens == single.tokens and len(batch[i].tokens) == NEW
        assert batch[i].accepted == single.accepted
    if kind in ("oracle", "scattered"):
        assert max(max(g.accepted) for g in batch) > 2  # trees were really accepted in several rows


def test_rows_stop_on_their_own(model):
    """With EOS on, rows end at different steps; the others go on exactly as alone."""
    eos = {t for g in BatchDecoder(model, eos_ids=set()).generate(prompts(), NEW) for t in g.tokens[3:6]}
    batch = BatchDecoder(model, eos_ids=eos).generate(prompts(), NEW, [PromptLookupDrafter(num_tokens=4)] * 4)
    lengths = set()
    for i, prompt in enumerate(prompts()):
        single = alone(model, prompt, PromptLookupDrafter(num_tokens=4), eos_ids=eos)
        assert batch[i].tokens == single.tokens and batch[i].stop_reason == single.stop_reason
        lengths.add(len(single.tokens))
    assert len(lengths) > 1 and "eos" in {g.stop_reason for g in batch}


@pytest.mark.parametrize("drafter", ["plain", "random_tree", "draft_lm"])
def test_sampling_rows_equal_single_prompt_runs_with_their_seeds(model, make_tiny_llama, drafter):
    """Each row draws from its own generator in the single decoder's order: equal outputs, hence
    the exactness that tests/test_sampling_lossless.py shows for the single decoder. Random trees
    are deterministic proposals (mostly rejected); a draft LM close to the target draws from q
    (mostly accepted, 3 deep)."""
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    seeds = [11, 12, 13, 14]
    draft = make_tiny_llama(vocab_size=V, hidden_size=32, layers=2, seed=4, scale=8.0)

    def make(i):
        if drafter == "plain":
            return None
        return RandomTreeDrafter(V, seed=i) if drafter == "random_tree" else DraftLMDrafter(draft, depth=3)

    batch = BatchDecoder(model, sampling=sampling, eos_ids=set()).generate(
        prompts(), NEW, [make(i) for i in range(4)], seeds=seeds
    )
    outputs = set()
    for i, prompt in enumerate(prompts()):
        single = alone(model, prompt, make(i), sampling, seed=seeds[i], eos_ids=set())
        assert batch[i].tokens == single.tokens and batch[i].accepted == single.accepted
        outputs.add(tuple(single.tokens))
    assert len(outputs) == 4
    if drafter == "draft_lm":
        assert sum(sum(g.accepted) for g in batch) > 2 * sum(g.steps for g in batch)  # tau > 2


def test_feature_drafters_and_policies_are_refused(model):
    class NeedsFeatures(PromptLookupDrafter):
        needs_hidden = True

    with pytest.raises(UsageError, match="features"):
        BatchDecoder(model).generate(prompts()[:1], 4, [NeedsFeatures()])
    lenient = PromptLookupDrafter()
    lenient.policy = PolicyConfig(lenience=0.5)
    with pytest.raises(UsageError, match="policy"):
        BatchDecoder(model).generate(prompts()[:1], 4, [lenient])
