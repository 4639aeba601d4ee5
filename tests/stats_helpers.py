"""Helpers shared by the statistical tests: the exact distribution of a tiny model's first
tokens and a chi-square comparison against it."""

from __future__ import annotations

import collections

import numpy as np
import torch
from scipy import stats

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.sampling import SamplingConfig, probabilities

QUANTILE = 0.999
# Generations per end-to-end test, sized by measured power (``python bench/sampling_power.py``;
# BENCHMARKS.md, "The test suite's time"): with a subtle verifier bug planted (after a rejection,
# resample from p instead of the residual) a test must fail by at least 2x its threshold. At 2,000
# the weakest fail by 1.7-2.5x and draw this many; a test that fails by more draws fewer, at a
# size where the bug still fails it by 2x (each such test says so).
SAMPLES = 2000


def generate_counts(decoder, prompt: list[int], length: int, n: int):
    """``n`` seeded generations of ``length`` tokens: Counters of the outputs, of the per-step
    acceptances and of the per-step tree sizes (each as a tuple per generation)."""
    counts, accepted, drafted = collections.Counter(), collections.Counter(), collections.Counter()
    for i in range(n):
        gen = decoder.generate(prompt, length, seed=i)
        assert len(gen.tokens) == length and sum(gen.accepted) == length - 1
        counts[tuple(gen.tokens)] += 1
        accepted[tuple(gen.accepted)] += 1
        drafted[tuple(gen.drafted)] += 1
    return counts, accepted, drafted


@torch.no_grad()
def exact_joint(model, prompt: list[int], length: int, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first ``length`` generated tokens) under plain sampling from ``model``, every prefix enumerated."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        probs = probabilities(logits, sampling).double().tolist()
        joint = {p + (x,): joint[p] * q for p, row in zip(prefixes, probs) for x, q in enumerate(row) if q > 0}
    return joint


def chi_square(counts: collections.Counter, joint: dict, n: int) -> tuple[float, float, int]:
    """(statistic, threshold, cells); outcomes outside the support fail at once."""
    impossible = {k: c for k, c in counts.items() if k not in joint}
    assert not impossible, f"outcomes with probability 0 were generated: {impossible}"
    observed, expected = [], []
    pooled_observed = pooled_expected = 0.0
    for outcome, p in joint.items():
        if p * n >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * n)
        else:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += p * n
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    observed, expected = np.array(observed, float), np.array(expected)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, float(stats.chi2.ppf(QUANTILE, len(observed) - 1)), len(observed)


def target_chi_square(
    target, drafter, prompt: list[int], length: int, n: int, sampling: SamplingConfig = SamplingConfig(temperature=1.0)
) -> tuple[float, float, collections.Counter]:
    """``n`` seeded generations of ``length`` tokens with ``drafter`` against ``target``'s exact joint
    distribution: (chi-square statistic, threshold, Counter of per-step acceptances)."""
    decoder = SpeculativeDecoder(target, drafter, None, sampling, eos_ids=set())
    counts, accepted, _ = generate_counts(decoder, prompt, length, n)
    statistic, threshold, _ = chi_square(counts, exact_joint(target, prompt, length, sampling), n)
    return statistic, threshold, accepted


def assert_distributed_as_target(
    target, drafter, prompt: list[int], length: int, n: int, sampling: SamplingConfig = SamplingConfig(temperature=1.0)
) -> collections.Counter:
    """:func:`target_chi_square` below its ``QUANTILE``; returns the Counter of per-step acceptances."""
    statistic, threshold, accepted = target_chi_square(target, drafter, prompt, length, n, sampling)
    print(f"chi2 {statistic:.1f} (threshold {threshold:.1f}); accepted {accepted.most_common(4)}")
    assert statistic < threshold
    return accepted
