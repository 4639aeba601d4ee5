"""Draft trees planned for the head and the device (``depth=auto``, ``budget=auto``: the default).

A tree that pays on a GPU loses on a small CPU, and a deep tree is wasted on a weak head. The plan
reads the head's held-out top-1 accuracy at each draft depth (``depth_accuracy``, recorded in its
checkpoint by training), measures on the device at hand what a verification pass of n tokens and
one draft step cost, takes the chain depth with the best expected speedup (Leviathan et al., per
depth) and widens the tree while its verification pass stays within 10% of the chain's
(:func:`~draftsmith.eval.engine.pass_cost.plan_tree`). Pass costs are measured once per target and dtype
in a process.
"""

from __future__ import annotations

import platform
import statistics
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from scipy.optimize import isotonic_regression
from transformers import DynamicCache

from draftsmith.eval.engine.pass_cost import measure_pass_cost, plan_tree
from draftsmith.eval.engine.prepack import packed, prepack_linears
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.timing import clock

MAX_BUDGET = 16  # tree nodes considered (pass sizes 1..17 are measured)
UNROLLED_DEPTHS = 5  # deepest tree planned for a head with one recorded depth (its accuracy then holds for all)
_PASS_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TreePlan:
    """A planned draft tree and what it was planned from."""

    depth: int
    top_k: int
    budget: int
    expected_speedup: float  # Leviathan et al.'s estimate for the chain of ``depth``
    acceptance: tuple[float, ...]  # held-out top-1 at draft depths 1, 2, ...
    device: str  # what the costs were measured on

    def describe(self) -> str:
        """One line: the tree, the accuracies and device it fits, the expected speedup."""
        rates = " / ".join(f"{a:.2f}" for a in self.acceptance)
        return (
            f"tree depth {self.depth}, top_k {self.top_k}, budget {self.budget}: planned for held-out top-1 "
            f"{rates} at depths 1-{len(self.acceptance)} on {self.device}; expected {self.expected_speedup:.2f}x "
            "over plain decoding"
        )

    def record(self) -> dict:
        return asdict(self)


def device_name(device: torch.device, dtype: torch.dtype) -> str:
    """The accelerator's or CPU's name, its thread count on a CPU, and the dtype."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({str(dtype).removeprefix('torch.')})"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            model,
        )
    return f"{model}, {torch.get_num_threads()} threads ({str(dtype).removeprefix('torch.')})"


def pass_costs(target, max_budget: int = MAX_BUDGET) -> dict[int, float]:
    """Seconds of one verification pass of 1..``max_budget + 1`` tokens of ``target`` after a
    200-token prefix (measured once per target, dtype and size range)."""
    param = next(target.parameters())
    key = (param.dtype, param.device, max_budget)
    cached = _PASS_COSTS.setdefault(target, {})
    if key not in cached:
        measured = measure_pass_cost(
            CausalLMRunner(target), prefix=200, sizes=tuple(range(1, max_budget + 2)), repeats=3
        )
        cached[key] = monotone(measured)
    return cached[key]


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """``costs`` as the nearest curve (least squares) on which a larger pass never costs less: the
    isotonic regression of the measured medians over pass size.

    Medians of a few timings are that noisy here even on an idle machine (SmolLM2 on this CPU: a
    pass timed up to 20% cheaper than the next smaller one; a tiny model's 2-token pass once 2.4x its
    3-token one). A planner fed such a curve picks a deep tree for a head that is never right because a
    larger pass happened to time cheaper; a running maximum would instead carry one slow outlier to
    every larger size. Pooling the violators averages the outlier with its neighbours."""
    sizes = sorted(costs)
    fitted = isotonic_regression([costs[n] for n in sizes]).x
    return {n: float(c) for n, c in zip(sizes, fitted)}


@torch.no_grad()
def draft_step_cost(head, width: int, context: int = 200, repeats: int = 6) -> float:
    """Median seconds of one tree level of ``head``: ``width`` nodes fed its own outputs after a
    ``context``-token cache, with their draft logits; its linears packed as the engine runs them."""
    prepack_linears(head)
    param = next(head.parameters())
    feed = {
        head.feedback_input: torch.zeros(1, context, head.config.hidden_size, dtype=param.dtype, device=param.device)
    }
    cache = DynamicCache()
    head(torch.ones(1, context, dtype=torch.long, device=param.device), past_key_values=cache, use_cache=True, **feed)
    ids = torch.ones(1, width, dtype=torch.long, device=param.device)
    level = {
        head.feedback_input: torch.zeros(1, width, head.config.hidden_size, dtype=param.dtype, device=param.device)
    }
    times = []
    with packed():
        for _ in range(repeats + 1):
            start = clock(param.device)
            head.draft_logits(head(ids, past_key_values=cache, use_cache=True, **level).last_hidden_state)
            times.append(clock(param.device) - start)
            cache.crop(-width)
    return statistics.median(times[1:])


def plan_head_tree(target, head, max_budget: int = MAX_BUDGET) -> TreePlan | None:
    """The tree for ``head`` (an EAGLE or EAGLE-3 head with ``depth_accuracy``) over ``target`` on
    their device, or None when the head records no accuracy (trained without held-out data)."""
    acceptance = getattr(head, "depth_accuracy", None)
    if not acceptance:
        return None
    costs = pass_costs(target, max_budget)
    max_depth = min(len(acceptance) if len(acceptance) > 1 else UNROLLED_DEPTHS, max_budget)
    draft = draft_step_cost(head, width=3)
    depth, budget, expected = plan_tree(costs, acceptance, draft, max_depth=max_depth, max_budget=max_budget)
    top_k = min(budget, max(3, -(-budget // depth)))  # wide enough to fill the budget within the depth
    param = next(target.parameters())
    return TreePlan(
        depth,
        top_k,
        budget,
        round(expected, 3),
        tuple(round(a, 4) for a in acceptance),
        device_name(param.device, param.dtype),
    )
