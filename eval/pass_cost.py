"""Measure what one target verification pass costs as the tree grows.

Tree sizes and speedup ceilings must come from this curve on the device at hand, not from GPU
settings: on a small CPU a 64-token pass costs several single-token passes.

    python eval/pass_cost.py --target default --dtype bfloat16 --prefix 200 --sizes 1,2,4,8,16,32,64
"""

from __future__ import annotations

import statistics

import torch

from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.runner import CausalLMRunner, tree_rows
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.target import load_target
from draftsmith.timing import clock


@torch.no_grad()
def measure_pass_cost(runner: CausalLMRunner, prefix: int = 200, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                      repeats: int = 10, vocab: int | None = None, seed: int = 0) -> dict[int, float]:
    """Median seconds of one pass of ``n`` chain-shaped tree tokens (LM head included) after ``prefix`` tokens."""
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


def affordable_budget(costs: dict[int, float], max_overhead: float = 1.25, largest: int = 12, smallest: int = 2) -> int:
    """The largest tree (draft nodes, between ``smallest`` and ``largest``) whose verification pass
    (the nodes plus the last accepted token) costs at most ``max_overhead`` single-token passes on
    the measured curve ``costs``: on a CPU where passes of 4+ tokens cost 1.5x, a 12-node tree spends
    more on verification than a young head's drafts give back."""
    fits = [n - 1 for n, seconds in costs.items() if smallest + 1 <= n <= largest + 1 and seconds <= max_overhead * costs[1]]
    return max(fits, default=smallest)


def ceiling_speedup(costs: dict[int, float], tokens_per_pass: int) -> float:
    """Best possible speedup when every pass of ``tokens_per_pass`` tokens yields that many tokens."""
    return tokens_per_pass * costs[1] / costs[tokens_per_pass]


@report_user_errors
def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    model, _ = load_target(args.target, args.dtype, args.device)
    costs = measure_pass_cost(CausalLMRunner(model), args.prefix, tuple(int(s) for s in args.sizes.split(",")), args.repeats)
    print("| tree tokens | ms per pass | x single-token pass |\n|---|---|---|")
    for n, seconds in costs.items():
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / costs[1]:.2f} |")
    return costs


if __name__ == "__main__":
    main()
