"""The EAGLE drafter in the shared decoding engine is lossless, and drafts as the head was trained.

Greedy: on the bundled SmolLM2 (slow) an untrained head, saved and loaded through the drafter
registry, gives exactly plain greedy decoding's tokens, with the full and with a reduced draft
vocabulary. Sampling: on a tiny 8-token target the joint distribution of the first generated
tokens under EAGLE drafting matches the target's exact distribution (chi-square test at the
0.999 quantile, every generation seeded), for a full and a reduced draft vocabulary; a verifier
that accepts every draft must fail the same test (negative control).
"""

from __future__ import annotations

import collections

import pytest
import torch
from stats_helpers import chi_square, exact_joint

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.eagle import EagleDrafter
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.engine.tree import ROOT
from draftsmith.heads.eagle import EagleHead
from draftsmith.kinds import get

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "List three tips for learning a new programming language.",
]


# ---------------------------------------------------------------------------------------------
# Greedy on the bundled SmolLM2 (slow)


NEW_TOKENS = 48


@pytest.fixture(scope="module")
def plain_smollm2(smollm2):
    """Plain greedy decoding of ``PROMPTS`` on SmolLM2, once for both vocabularies: (prompt ids,
    generation) per prompt."""
    from draftsmith.data_prep.chat import render_prompt

    model, tokenizer = smollm2
    plain = SpeculativeDecoder(model, None, tokenizer)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": text}]) for text in PROMPTS]
    return [(prompt, plain.generate(prompt, NEW_TOKENS)) for prompt in prompts]


def _greedy_matches(model, tokenizer, drafter, plain) -> float:
    spec = SpeculativeDecoder(model, drafter, tokenizer)
    produced = steps = 0
    for text, (prompt, want) in zip(PROMPTS, plain):
        got = spec.generate(prompt, NEW_TOKENS)
        assert got.tokens == want.tokens, text
        assert got.stop_reason == want.stop_reason
        produced, steps = produced + sum(got.accepted), steps + got.steps
    return produced / steps


@pytest.mark.slow
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_greedy_eagle_on_smollm2_is_lossless(smollm2, plain_smollm2, tmp_path, reduced):
    model, tokenizer = smollm2
    vocab = model.config.vocab_size
    draft_vocab = None
    if reduced:
        draft_vocab = torch.unique(torch.cat([torch.arange(0, vocab, 7), torch.tensor([tokenizer.eos_token_id])]))
    head = EagleHead.for_target(model, "default", draft_vocab=draft_vocab)  # untrained (identity init)
    head.save_pretrained(tmp_path / "head")
    drafter = build_drafter(f"eagle:{tmp_path / 'head'}?depth=4&top_k=3&budget=10", model)
    assert isinstance(drafter, EagleDrafter)
    assert drafter.head.draft_vocab.numel() == (vocab if draft_vocab is None else draft_vocab.numel())
    tau = _greedy_matches(model, tokenizer, drafter, plain_smollm2)
    print(f"acceptance length {tau:.2f}")
    assert tau > 1.0  # some drafts were accepted, so the accepted-feature path ran too


# ---------------------------------------------------------------------------------------------
# Sampling on a tiny target: exact distribution


V = 8
PROMPT = [3, 5, 2, 7, 4]
LENGTH = 4  # the first token comes from the prefill: depth 2 plus the bonus token


@pytest.fixture(scope="module")
def tiny_target(tiny_pair_target):
    return tiny_pair_target


def _tiny_head(target, init: str, draft_vocab: list[int] | None = None) -> EagleHead:
    torch.manual_seed(1)
    vocab = torch.tensor(draft_vocab) if draft_vocab is not None else None
    return EagleHead.for_target(target, "tiny", draft_vocab=vocab, init=init).eval()


# Losslessness is the engine's (candidates drawn from q, verified against p), not the head's weights: one
# random head per vocabulary layout; EAGLE-3 heads (test_eagle3.py) go through the same drafter.
@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 3, 5, 6]], ids=["full_vocab", "reduced_vocab"])
def test_sampling_with_eagle_matches_exact_distribution(tiny_target, draft_vocab):
    drafter = EagleDrafter(_tiny_head(tiny_target, "random", draft_vocab), depth=2, top_k=2, budget=4)
    sampling = SamplingConfig(temperature=1.0)
    decoder = SpeculativeDecoder(tiny_target, drafter, None, sampling, eos_ids=set())
    counts, accepted, drafted = collections.Counter(), collections.Counter(), set()
    n = 800  # the planted bug still fails both layouts by 2x+ (stats_helpers)
    for i in range(n):
        gen = decoder.generate(PROMPT, LENGTH, seed=i)
        assert len(gen.tokens) == LENGTH and sum(gen.accepted) == LENGTH - 1
        counts[tuple(gen.tokens)] += 1
        accepted[tuple(gen.accepted)] += 1
        drafted.update(gen.tokens[1 : gen.accepted[0]])  # the first step's accepted draft tokens
    statistic, threshold, _ = chi_square(counts, exact_joint(tiny_target, PROMPT, LENGTH, sampling), n)
    print(f"chi2 {statistic:.1f} (threshold {threshold:.1f}); accepted {accepted.most_common(4)}")
    assert statistic < threshold
    # The drafts mattered: whole depth-2 paths accepted (+ bonus) and first drafts rejected, often.
    assert accepted[(3,)] > n / 20 and accepted[(1, 1, 1)] > n / 20, accepted
    if draft_vocab is not None:
        assert drafted and drafted <= set(draft_vocab)  # accepted drafts come from the draft vocabulary


def test_chi_square_catches_a_lossy_verifier(tiny_target, monkeypatch):
    """Negative control: accepting every EAGLE draft (then sampling the bonus) must fail the test."""
    import draftsmith.eval.engine.decode as decode_module
    from draftsmith.eval.engine.verify import verdict

    def accept_all(tree, logits, sampling, generator=None, lenience=1.0):
        path, node = [], ROOT
        while node in tree.proposals and tree.proposals[node].nodes[0] is not None:
            node = tree.proposals[node].nodes[0]
            path.append(node)
        row = path[-1] + 1 if path else 0
        return verdict(tree, path, sample(probabilities(logits[row], sampling), generator))

    monkeypatch.setattr(decode_module, "verify", accept_all)
    drafter = EagleDrafter(_tiny_head(tiny_target, "random"), depth=2, top_k=2, budget=4)
    sampling = SamplingConfig(temperature=1.0)
    decoder = SpeculativeDecoder(tiny_target, drafter, None, sampling, eos_ids=set())
    n = 400  # it fails by 5.9x here (14.6x at 1,000)
    counts = collections.Counter(tuple(decoder.generate(PROMPT, LENGTH, seed=i).tokens) for i in range(n))
    joint = exact_joint(tiny_target, PROMPT, LENGTH, sampling)
    counts = collections.Counter({k: c for k, c in counts.items() if k in joint})
    statistic, threshold, _ = chi_square(counts, joint, sum(counts.values()))
    assert statistic > 3 * threshold


def test_greedy_eagle_on_tiny_target_is_lossless(tiny_target):
    for init in ("random", "identity"):
        drafter = EagleDrafter(_tiny_head(tiny_target, init), depth=3, top_k=2, budget=6)
        plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
        spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
        produced = steps = 0
        for prompt in ([3, 5, 2, 7, 4], [1, 1, 6], list(range(V)) * 3):
            want = plain.generate(prompt, 40)
            got = spec.generate(prompt, 40)
            assert got.tokens == want.tokens
            assert len(set(want.tokens)) > 2  # a peaked target: varied text, not one repeated token
            produced, steps = produced + sum(got.accepted), steps + got.steps
        assert produced / steps > 1.2, init  # drafts were accepted along the way


# ---------------------------------------------------------------------------------------------
# Training and drafting see the same head


class RecordingEagleDrafter(EagleDrafter):
    """Records, at every proposal, the sequence so far and the draft distribution below its last token."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[tuple[list[int], torch.Tensor]] = []

    def propose(self, context):
        tree = super().propose(context)
        if len(tree):  # none on the last step, with one new token left to produce
            self.records.append((list(context.tokens), tree.proposals[ROOT].probs))
        return tree


@pytest.mark.parametrize("draft_vocab", [None, [0, 1, 2, 3, 5, 8, 13, 21, 34, 40]], ids=["full_vocab", "reduced_vocab"])
def test_drafting_distributions_equal_a_training_forward_over_the_same_sequence(make_tiny_llama, draft_vocab):
    """The engine's incremental head (its own KV cache fed with accepted tokens and the target's
    features, step by step) must compute what the training forward computes over the whole
    sequence at once (``EagleTask``: padded batch, target features, ``head(ids[1:], f[:-1])``)."""
    from draftsmith.data_prep.dataset import pad_batch
    from draftsmith.train.eagle import EagleRecipe, EagleTask

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=2, seed=3, scale=10.0)
    head = _tiny_head(target, "random", draft_vocab)
    drafter = RecordingEagleDrafter(head, depth=3, top_k=2, budget=5)
    sampling = SamplingConfig(temperature=1.0)
    gen = SpeculativeDecoder(target, drafter, None, sampling, eos_ids=set()).generate([3, 9, 4, 17, 6], 30, seed=0)
    assert gen.steps < 29 and len(drafter.records) >= gen.steps - 1  # some steps accepted several tokens
    task = EagleTask(EagleRecipe(), target, head)
    for tokens, drafted in drafter.records:
        batch = pad_batch([{"input_ids": tokens, "loss_mask": [1] * len(tokens)}])
        with torch.no_grad():
            features = task.target_features(batch)
            pred = head(batch["input_ids"][:, 1:], features[:, :-1], attention_mask=batch["attention_mask"][:, 1:])
            trained = probabilities(head.logits(pred.last_hidden_state[0, -1]), sampling)
        torch.testing.assert_close(drafted, trained, atol=1e-5, rtol=1e-4)


def test_steps_without_a_draft_still_reach_the_heads_cache(tiny_target):
    """Under a confidence gate the target decodes some steps alone; the head must still see every
    (token, feature) pair, or its later drafts would read a context with holes."""
    from draftsmith.eval.engine.policies import PolicyConfig

    drafter = EagleDrafter(_tiny_head(tiny_target, "identity"), depth=2, top_k=2, budget=4)
    drafter.policy = PolicyConfig(confidence=0.7)
    gen = SpeculativeDecoder(tiny_target, drafter, eos_ids=set()).generate(PROMPT, 40)
    assert gen.tokens == SpeculativeDecoder(tiny_target, None, eos_ids=set()).generate(PROMPT, 40).tokens
    assert 0 < gen.drafted.count(0) < len(gen.drafted)  # some steps drafted, some did not
    pairs = drafter.runner.length + len(drafter._tokens)  # in the head's cache + waiting for the next proposal
    # One pair per token after the first (the last step may have produced a few past the limit).
    assert len(PROMPT) + len(gen.tokens) - 1 <= pairs <= len(PROMPT) + len(gen.tokens) - 1 + 2


# ---------------------------------------------------------------------------------------------
# Trees planned for the head and the device (depth=auto, the default)


def test_default_tree_is_planned_from_the_heads_recorded_accuracy(tiny_target, tmp_path, capsys):
    """``eagle:PATH`` plans its tree from the checkpoint's held-out accuracy per depth and this
    device's measured costs: a head that is never right drafts one token a step; counts given in
    the spec win over the plan; a head without recorded accuracy drafts the fixed fallback tree
    and says why."""
    head = _tiny_head(tiny_target, "random")
    head.save_pretrained(tmp_path / "unplanned")
    head.depth_accuracy = [0.0, 0.0, 0.0]
    head.save_pretrained(tmp_path / "hopeless")
    assert EagleHead.from_pretrained(tmp_path / "hopeless").depth_accuracy == [0.0, 0.0, 0.0]

    planned = build_drafter(f"eagle:{tmp_path / 'hopeless'}", tiny_target)
    assert planned.depth == 1 and 1 <= planned.budget <= 16 and planned.top_k >= 1
    assert "planned for held-out top-1 0.00 / 0.00 / 0.00 at depths 1-3" in planned.tree_label
    given = build_drafter(f"eagle:{tmp_path / 'hopeless'}?depth=3&top_k=2", tiny_target)
    assert (given.depth, given.top_k) == (3, 2) and given.budget >= 3
    fixed = build_drafter(f"eagle:{tmp_path / 'hopeless'}?depth=2&top_k=2&budget=4", tiny_target)
    assert (fixed.depth, fixed.top_k, fixed.budget, fixed.tree_label) == (2, 2, 4, "")
    fallback = build_drafter(f"eagle:{tmp_path / 'unplanned'}", tiny_target)
    assert (fallback.depth, fallback.top_k, fallback.budget) == tuple(get("eagle").plan_fallback.values())
    assert "records no held-out accuracy per draft depth" in fallback.tree_label
    out = capsys.readouterr().out
    assert planned.tree_label in out and fallback.tree_label in out
