"""Predict a drafting method's speedup from what its parts cost on this device, and pick draft
lengths and thresholds with it.

A step of a drafting method is one target pass over ``[root] + tree`` (n + 1 rows, costing
``c(n + 1)`` on the pass-cost curve :mod:`draftsmith.eval.engine.pass_cost` measures) plus its drafting
(``d`` seconds, measured per step); it yields tau tokens where plain decoding yields one per
``c(1)``. So a method's predicted speedup is ``tau c(1) / mean over steps of (c(n + 1) + d)``.
Comparing it with the measured speedup shows what the model leaves out (prefill, the engine's own
host work).

For a chain of g tokens each accepted with probability a, drafted at c target-steps per token,
Leviathan et al.'s expected speedup is ``(1 - a^(g+1)) / ((1 - a)(g c + 1))``; on devices where
the verification pass grows with its length the ``1`` becomes ``c(g + 1) / c(1)``
(:func:`~draftsmith.eval.engine.pass_cost.chain_speedup`). Its maximum over g is the best fixed depth,
and the break-even acceptance of a single draft token is the confidence below which drafting
cannot pay (the natural ``confidence=`` threshold).
"""

from __future__ import annotations

from draftsmith.eval.engine.pass_cost import chain_speedup
from draftsmith.eval.measure import Run


def predicted_speedup(runs: list[Run], costs: dict[int, float]) -> float | None:
    """Speedup predicted for one method's runs from the pass-cost curve ``costs`` (seconds by rows)
    and its measured drafting time; None without drafting times or with trees past the curve."""
    steps = [n for r in runs for n in r.drafted]
    if not steps or any(r.draft_seconds is None for r in runs) or max(steps) + 1 not in costs:
        return None
    tokens = sum(sum(r.accepted) for r in runs)
    seconds = sum(costs[n + 1] for n in steps) + sum(r.draft_seconds for r in runs)
    return tokens * costs[1] / seconds


def best_depth(acceptance: float, draft_cost: float, costs: dict[int, float], max_depth: int = 8) -> tuple[int, float]:
    """``(depth, predicted speedup)`` of the best fixed chain for per-token ``acceptance`` and
    ``draft_cost`` seconds per draft token (0 when no depth pays: then do not draft)."""
    depths = [g for g in range(1, max_depth + 1) if g + 1 in costs]
    best = max(depths, key=lambda g: chain_speedup(costs, g, acceptance, draft_cost))
    speedup = chain_speedup(costs, best, acceptance, draft_cost)
    return (best, speedup) if speedup > 1.0 else (0, 1.0)


def break_even_acceptance(costs: dict[int, float], draft_cost: float) -> float:
    """The acceptance probability at which drafting one token just pays: ``(1 + a) c(1) =
    c(2) + d``. Below it the target should decode alone (a confidence gate's threshold)."""
    return min(max((costs[2] + draft_cost) / costs[1] - 1.0, 0.0), 1.0)


def cost_model_lines(summary: dict, runs: list[Run], costs: dict[int, float]) -> list[str]:
    """Add ``predicted_speedup`` to each drafting method of ``summary`` and return one line per
    method with what the model recommends: the best fixed depth for its first-token acceptance and
    draft cost, and the break-even acceptance (the confidence gate's natural threshold)."""
    lines = []
    for method, stats in summary["methods"].items():
        own = [r for r in runs if r.method == method]
        predicted = predicted_speedup(own, costs)
        if predicted is None:
            continue
        stats["predicted_speedup"] = predicted
        # A step that drafts nothing still ran the drafter once (a policy looked and declined).
        forwards = sum(max(n, 1) for r in own for n in r.drafted)
        if not any(n for r in own for n in r.drafted):
            continue
        draft_cost = sum(r.draft_seconds for r in own) / forwards
        # Over the steps that drafted: a policy's declined steps say nothing about the drafter.
        drafted = [a for r in own for a, n in zip(r.accepted, r.drafted) if n]
        acceptance = sum(a > 1 for a in drafted) / len(drafted)
        depth, speedup = best_depth(acceptance, draft_cost, costs)
        lines.append(
            f"cost model, {method}: first draft token accepted in {acceptance:.0%} of drafting steps, a "
            f"draft node costs "
            f"{draft_cost / costs[1]:.2f} target steps: best fixed chain depth {depth} (predicted {speedup:.2f}x); "
            f"drafting pays only above {break_even_acceptance(costs, draft_cost):.0%} acceptance"
        )
    return lines
