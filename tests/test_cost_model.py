"""The cost model: predictions computed by hand from known costs, and the defaults it picks."""

from __future__ import annotations

import pytest

from draftsmith.eval.cost_model import best_depth, break_even_acceptance, cost_model_lines, predicted_speedup
from draftsmith.eval.measure import Run
from draftsmith.eval.report import summarise

# A device where a pass over n rows costs 10 + 2 (n - 1) ms.
COSTS = {n: 0.010 + 0.002 * (n - 1) for n in range(1, 12)}


def run(method, accepted, drafted, draft_seconds):
    return Run(
        method,
        "p",
        "c",
        1,
        sum(accepted) + 1,
        len(accepted),
        1.0,
        accepted,
        drafted=drafted,
        draft_seconds=draft_seconds,
    )


def test_predicted_speedup_by_hand():
    # Steps: 3 nodes -> 3 tokens, 0 nodes (target alone) -> 1, 3 nodes -> 1; drafting 6 ms in all.
    runs = [run("m", [3, 1, 1], [3, 0, 3], 0.006)]
    seconds = COSTS[4] + COSTS[1] + COSTS[4] + 0.006
    assert predicted_speedup(runs, COSTS) == pytest.approx(5 * 0.010 / seconds)
    assert predicted_speedup([run("m", [1], [20], 0.0)], COSTS) is None  # a tree past the measured curve
    assert predicted_speedup([Run("hf", "p", "c", 1, 2, 1, 1.0, [1])], COSTS) is None  # nothing recorded


def test_best_depth_is_leviathans_optimum():
    # Per-token acceptance 0.8, drafts at 1 ms (0.1 target steps): expected tokens (1 - a^(g+1)) / (1 - a)
    # over step cost (10 + 2 g + g) ms; the best g by brute force.
    a, d = 0.8, 0.001
    speed = {g: (1 - a ** (g + 1)) / (1 - a) * 0.010 / (COSTS[g + 1] + g * d) for g in range(1, 9)}
    depth, predicted = best_depth(a, d, COSTS)
    assert depth == max(speed, key=speed.get) and predicted == pytest.approx(max(speed.values()))
    assert best_depth(0.05, d, COSTS) == (0, 1.0)  # nothing pays: do not draft


def test_break_even_acceptance():
    # (1 + a) 10 ms = 12 ms + 1 ms  ->  a = 0.3
    assert break_even_acceptance(COSTS, 0.001) == pytest.approx(0.3)
    assert break_even_acceptance({1: 1.0, 2: 3.0}, 0.0) == 1.0  # clipped: drafting never pays


def test_cost_model_lines_add_predictions_to_the_summary():
    runs = [run("baseline", [1, 1], [0, 0], None), run("m", [3, 1, 1], [3, 0, 3], 0.006)]
    summary = summarise(runs)
    lines = cost_model_lines(summary, runs, COSTS)
    assert "predicted_speedup" in summary["methods"]["m"] and "predicted_speedup" not in summary["methods"]["baseline"]
    # Two steps drafted (the target decoded one alone) and one of them accepted its first draft token.
    assert len(lines) == 1 and "first draft token accepted in 50% of drafting steps" in lines[0]
