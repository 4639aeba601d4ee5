"""Measure what one target verification pass costs as the tree grows.

Tree sizes and speedup ceilings must come from this curve on the device at hand, not from GPU
settings: on a small CPU a 64-token pass costs several single-token passes.

    python eval/engine/pass_cost.py --target default --dtype bfloat16 --prefix 200 --sizes 1,2,4,8,16,32,64
    python eval/engine/pass_cost.py --dtype float32 --sizes 1,3,4,8,13,16,32 --prepack off   # before prepacking
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.prepack import MODES, packed
from draftsmith.eval.engine.target_runner import CausalLMRunner, tree_rows
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.target import load_target
from draftsmith.timing import clock


@torch.no_grad()
def measure_pass_cost(
    runner: CausalLMRunner,
    prefix: int = 200,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    repeats: int = 10,
    vocab: int | None = None,
    seed: int = 0,
) -> dict[int, float]:
    """Median seconds of one pass of ``n`` chain-shaped tree tokens (LM head included) after ``prefix`` tokens."""
    with packed():  # as the engine's generations run
        return _measure(runner, prefix, sizes, repeats, vocab, seed)


def _measure(runner, prefix, sizes, repeats, vocab, seed) -> dict[int, float]:
    generator = torch.Generator().manual_seed(seed)
    vocab = vocab or runner.config.vocab_size
    runner.reset()
    runner.forward(torch.randint(vocab, (prefix,), generator=generator).tolist())
    costs = {}
    for n in sizes:
        tokens = torch.randint(vocab, (n,), generator=generator).tolist()
        parents, depths = tree_rows(list(range(-1, n - 2)), list(range(1, n)))
        times = []
        for _ in range(repeats + 1):
            start = clock(runner.device)
            hidden = runner.forward(tokens, parents, depths)
            runner.logits(hidden)
            runner.commit([])
            times.append(clock(runner.device) - start)
        costs[n] = statistics.median(times[1:])
    return costs


def acceptance_at(acceptance: float | Sequence[float], depth: int) -> float:
    """The per-token acceptance rate at draft ``depth`` (1-based): a constant, or a per-depth list
    whose last value holds for deeper levels."""
    if isinstance(acceptance, (int, float)):
        return float(acceptance)
    return float(acceptance[min(depth, len(acceptance)) - 1])


def chain_speedup(costs: dict[int, float], depth: int, acceptance: float | Sequence[float], draft_cost: float) -> float:
    """Expected speedup of drafting ``depth`` tokens a step (Leviathan et al.): tokens per step
    ``1 + sum_d a_1 ... a_d`` for per-token acceptance ``a_d`` at depth d (a constant ``a`` gives
    ``(1 - a^(depth+1)) / (1 - a)``), over the step's cost in one-token passes: the measured pass over
    ``depth + 1`` tokens plus ``depth`` draft steps of ``draft_cost`` seconds."""
    tau, reach = 1.0, 1.0
    for d in range(1, depth + 1):
        reach *= acceptance_at(acceptance, d)
        tau += reach
    return tau * costs[1] / (costs[depth + 1] + depth * draft_cost)


def plan_tree(
    costs: dict[int, float],
    acceptance: float | Sequence[float],
    draft_cost: float,
    max_depth: int = 5,
    max_budget: int = 12,
    widen: float = 1.1,
) -> tuple[int, int, float]:
    """``(depth, budget, expected speedup)`` of a draft tree for this device: the chain depth with
    the best :func:`chain_speedup`, then widened to the largest ``budget`` whose verification pass
    costs at most ``widen`` times the chain's (extra branches raise acceptance at no extra draft
    steps). ``costs`` must hold every pass size from 1 to ``max_budget + 1``."""
    depth = max(range(1, max_depth + 1), key=lambda d: chain_speedup(costs, d, acceptance, draft_cost))
    budget = max(b for b in range(depth, max_budget + 1) if costs[b + 1] <= widen * costs[depth + 1])
    return depth, budget, chain_speedup(costs, depth, acceptance, draft_cost)


def priced_size(estimates: Sequence[float], costs: dict[int, float] | None, draft_seconds: float, budget: int) -> int:
    """How many of a tree's nodes to verify: ``estimates`` are the nodes' probabilities of being
    accepted with their ancestors, best first (ancestors before descendants), so the best ``n`` form a
    tree whose expected yield is ``1 + sum`` of their estimates; returned is the ``n <= budget`` with
    the most expected tokens per second of the step (the pass over ``n + 1`` tokens from ``costs``
    plus ``draft_seconds`` already spent drafting). 0 (decode plainly) when no node pays for its
    place in the pass. ``costs`` None prices every pass alike: the whole budget."""
    budget = min(budget, len(estimates))
    if costs is None:
        return budget
    budget = min(budget, max(costs) - 1)
    best, best_rate, tokens = 0, 1.0 / (costs[1] + draft_seconds), 1.0
    for n in range(1, budget + 1):
        tokens += estimates[n - 1]
        rate = tokens / (costs[n + 1] + draft_seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def ceiling_speedup(costs: dict[int, float], tokens_per_pass: int) -> float:
    """Best possible speedup when every pass of ``tokens_per_pass`` tokens yields that many tokens."""
    return tokens_per_pass * costs[1] / costs[tokens_per_pass]


@report_user_errors
def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--prepack", default="auto", choices=MODES, help="CPU linears prepacked for oneDNN (the engine's default: auto)"
    )
    args = parser.parse_args(argv)
    model, _ = load_target(args.target, args.dtype, args.device)
    costs = measure_pass_cost(
        CausalLMRunner(model, prepack=args.prepack),
        args.prefix,
        tuple(int(s) for s in args.sizes.split(",")),
        args.repeats,
    )
    print("| tree tokens | ms per pass | x single-token pass |\n|---|---|---|")
    for n, seconds in costs.items():
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / costs[1]:.2f} |")
    return costs


if __name__ == "__main__":
    main()
