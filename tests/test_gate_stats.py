"""The gate's verdict on acceptance counts (no vLLM needed: the counts are what vLLM and our engine report)."""

from __future__ import annotations

import pytest

from draftsmith.export.gate_stats import (
    FAILED,
    INCONCLUSIVE,
    MARGIN_CAP,
    MARGIN_FLOOR,
    PASSED,
    PositionCounts,
    decides,
    judge,
    margin,
    overall,
    prompts_to_decide,
)


def test_the_weak_p_eagle_reproduction_no_longer_passes():
    # Issue 35's export with random fc and layers: vLLM accepted none of ~350 first drafts, we ~10.
    broken = PositionCounts(vllm_drafts=350, vllm_accepted=0, ours_drafts=350, ours_accepted=10)
    position = judge(broken)
    assert position.verdict == FAILED and position.p_value < 0.01 and position.margin == MARGIN_FLOOR
    deeper = [judge(PositionCounts(350, 0, 40, 0)) for _ in range(6)]
    verdict, reasons = overall([position, *deeper], broken, 3)
    assert verdict == FAILED
    assert reasons == [
        f"position 1: vLLM accepted 0 of 350 drafts (0.000), draftsmith 10 of 350 (0.029): differ by more than the "
        f"margin 0.010 (Fisher p = {position.p_value:.2g}; failed)"
    ]


def test_a_good_export_passes_within_the_margin_however_long_the_run():
    # bf16 rounding moves a few drafts: on 100k drafts the difference is statistically clear, yet small.
    long_run = PositionCounts(100_000, 22_100, 100_000, 21_500)
    position = judge(long_run)
    assert position.p_value < 0.01 and position.verdict == PASSED and position.margin == MARGIN_CAP
    assert overall([position], long_run, 5000) == (PASSED, [])


def test_a_large_difference_the_counts_cannot_confirm_is_inconclusive():
    counts = PositionCounts(20, 0, 20, 2)
    position = judge(counts)
    assert position.verdict == INCONCLUSIVE and position.p_value > 0.01
    verdict, reasons = overall([position], counts, 2)
    assert verdict == INCONCLUSIVE and "may differ" in reasons[0]


def test_a_weak_head_that_agrees_is_inconclusive_and_says_how_many_prompts_decide():
    weak = PositionCounts(100, 3, 100, 3)  # rates agree, but a dead export (0 of 100) would pass too
    assert judge(weak).verdict == PASSED and not decides(weak)
    needed = prompts_to_decide(weak, prompts=4)
    scale = needed / 4
    assert judge(PositionCounts(round(100 * scale), 0, round(100 * scale), round(3 * scale))).verdict == FAILED
    fewer = (needed - 1) / 4
    assert judge(PositionCounts(round(100 * fewer), 0, round(100 * fewer), round(3 * fewer))).verdict != FAILED
    verdict, reasons = overall([judge(weak)], weak, 4)
    assert verdict == INCONCLUSIVE
    assert reasons == [
        f"too little evidence: draftsmith accepted 3 of 100 first drafts, so an export that vLLM never accepts "
        f"would not fail on these 4 prompts; about {needed} prompts (--limit {needed}) would decide it"
    ]


def test_a_head_that_never_accepts_cannot_be_decided_by_more_prompts():
    dead = PositionCounts(200, 0, 200, 1)  # 0.5 %: within the margin's floor of zero
    assert prompts_to_decide(dead, prompts=8) is None
    verdict, reasons = overall([judge(dead)], dead, 8)
    assert verdict == INCONCLUSIVE and reasons[-1].endswith("train the head longer, or check a stronger one")


@pytest.mark.parametrize(
    ("rates", "expected"), [((0.0, 0.0), MARGIN_FLOOR), ((0.1, 0.05), 0.02), ((0.5, 0.45), MARGIN_CAP)]
)
def test_margin_is_relative_between_floor_and_cap(rates, expected):
    assert margin(*rates) == pytest.approx(expected)


def test_our_engine_counts_the_steps_vllm_runs():
    """vLLM starts a step while fewer than max_new_tokens tokens are out and drafts its full depth on
    it; the gate decodes further with our engine and counts those steps only (the first token comes
    from the prompt's pass). Each step here accepts 3 tokens: out after the steps 1, 4, 7, 10, ..."""
    from draftsmith.export.serve_check import position_counts, steps_started_before

    assert steps_started_before([3] * 6, 8) == 3  # starts at 1, 4, 7; not at 10
    assert steps_started_before([3] * 6, 7) == 2  # 7 tokens are out before the third: vLLM stops
    assert steps_started_before([3] * 2, 100) == 2  # an EOS ended it first: every step counts
    assert steps_started_before([], 5) == 0
    # Those steps' chains are counted whole, at every position they drafted.
    hits, drafts = position_counts([[3, 1, 4]], [[3, 3, 3]], 3)
    assert drafts == [3, 3, 3] and hits == [2, 2, 1]  # 2 drafts accepted, then none, then 3
