"""Medusa drafting: every head guesses one future position from the target's last hidden state,
and a static tree (Medusa ``choices``) combines their ranked guesses.

Node ``(r1, ..., rd)`` is head d-1's rank-rd guess below node ``(r1, ..., r(d-1))``. Greedy
decoding takes each head's top-k; sampling draws each head's candidates without replacement from
its warped distribution, so the engine's recursive rejection sampling keeps the output
distributed as the target's (lossless; Medusa's typical acceptance is not offered).

Its static trees are here too: trees given as choices (paths of candidate ranks,
``[[0], [0, 0], [1], ...]``), filled from the heads' ranked candidates, and the optimal choices for
measured head accuracies, and their calibration to the device (:func:`calibrate_tree`, what
``eval/calibrate_tree.py`` runs for a Medusa checkpoint).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader
from transformers import PreTrainedModel

from draftsmith.config import RecipeError, from_dict, read_yaml
from draftsmith.data_prep.dataset import build_dataset, pad_batch
from draftsmith.data_prep.regenerate import prepare_data_config
from draftsmith.data_prep.sharegpt import DataError
from draftsmith.errors import ArgumentParser, CheckpointError, UsageError, at_least
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.pass_cost import measure_pass_cost
from draftsmith.eval.engine.sampling import choose
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import ROOT, Proposal, TokenTree
from draftsmith.heads.medusa import (
    DEFAULT_TREE_SIZE,
    TOP_K_RECORDED,
    MedusaHeads,
    head_positions,
    rank_accuracy,
    top_k_hits,
)
from draftsmith.precision import DTYPE_CHOICES, dtype_name
from draftsmith.recipe import DataConfig, TargetConfig
from draftsmith.target import adapter_active, attach_adapter, load_target
from draftsmith.timing import clock


def load_choices(source: str | list) -> list[tuple[int, ...]]:
    """Medusa-style choices (``[[0], [0, 0], [1], ...]``) from a list, a literal or a JSON/YAML file.

    Each choice is a path of candidate ranks; every prefix of a choice must itself be a choice.
    A file may also hold a mapping with a ``choices`` key (what tree calibration writes).
    """
    if isinstance(source, str):
        path = Path(source)
        if path.suffix in (".json", ".yaml", ".yml") and not path.is_file():
            raise UsageError(f"tree choices file {source} does not exist")
        # JSON is YAML, and so is the Python-literal style Medusa repos use.
        source = yaml.safe_load(path.read_text() if path.is_file() else source)
        if isinstance(source, dict) and "choices" in source:
            source = source["choices"]
        if not isinstance(source, list):
            raise UsageError(f"tree choices must be a list of lists of ranks, got {type(source).__name__}")
    choices = sorted({tuple(int(r) for r in c) for c in source}, key=lambda c: (len(c), c))
    present = set(choices)
    for choice in choices:
        if not choice or any(r < 0 for r in choice):
            raise UsageError(f"tree choice {list(choice)} must be a non-empty list of ranks >= 0")
        if len(choice) > 1 and choice[:-1] not in present:
            raise UsageError(f"tree choice {list(choice)} has no parent {list(choice[:-1])} in the choices")
    return choices


def choice_slots(choices: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """How many ranked candidates each path prefix needs: ``{prefix: max rank + 1}``."""
    need: dict[tuple[int, ...], int] = {}
    for choice in choices:
        prefix = choice[:-1]
        need[prefix] = max(need.get(prefix, 0), choice[-1] + 1)
    return need


def static_tree(
    choices: list[tuple[int, ...]], candidates: list[list[int]], probs: list[torch.Tensor | None] | None = None
) -> TokenTree:
    """A Medusa static tree: node ``(r1, ..., rd)`` holds ``candidates[d-1][rd]``.

    ``candidates[d]`` are the ranked guesses for depth d+1 (one head's), shared by every parent
    at that depth; ``probs[d]`` the distribution they were drawn from (None when greedy). Each
    parent's proposal is the first ``max rank + 1`` of them, a valid draw without replacement.
    """
    # Drop choices deeper than the heads given or ranked past the candidates drawn (prefixes share
    # their ranks, so what stays is still closed under taking parents).
    choices = [c for c in choices if len(c) <= len(candidates) and all(r < len(candidates[d]) for d, r in enumerate(c))]
    node = {(): ROOT}
    tree = TokenTree()
    for choice in sorted(choices, key=lambda c: (len(c), c)):
        node[choice] = len(tree.tokens)
        tree.tokens.append(int(candidates[len(choice) - 1][choice[-1]]))
        tree.parents.append(node[choice[:-1]])
        tree.depths.append(len(choice))
    for prefix, slots in choice_slots(choices).items():
        depth = len(prefix)
        tree.proposals[node[prefix]] = Proposal(
            [int(t) for t in candidates[depth][:slots]],
            [node.get(prefix + (r,)) for r in range(slots)],
            probs[depth] if probs else None,
        )
    return tree


def optimal_choices(rank_accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The ``budget``-node tree with the largest expected acceptance length (Medusa's construction).

    ``rank_accuracy[d][r]`` is the probability that the rank-r guess of head d is the right token.
    Taking heads as independent, node ``(r1, ..., rd)`` is accepted with probability
    ``prod rank_accuracy[i][r_i]``, and the expected acceptance length is 1 plus the sum over
    nodes. That probability never grows from a parent to its child, so the ``budget`` best nodes
    (found best-first from the root) include their ancestors and are the optimum.
    """
    heap = [(-rank_accuracy[0][r], (r,)) for r in range(len(rank_accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, choice = heapq.heappop(heap)
        chosen.append(choice)
        if len(choice) < len(rank_accuracy):
            for r, acc in enumerate(rank_accuracy[len(choice)]):
                heapq.heappush(heap, (neg * acc, choice + (r,)))
    return sorted(chosen, key=lambda c: (len(c), c))


def expected_acceptance(choices: list[tuple[int, ...]], rank_accuracy: list[list[float]]) -> float:
    """Expected tokens per step of a static tree under independent per-head rank accuracies."""
    total = 1.0
    for choice in choices:
        p = 1.0
        for depth, rank in enumerate(choice):
            p *= rank_accuracy[depth][rank]
        total += p
    return total


class MedusaDrafter(Drafter):
    """Medusa heads over a static tree of ``choices``.

    ``verifier``: the target this drafter must be verified by when it is not the engine's own
    (Medusa-2 heads come with a LoRA-tuned target: the base target with the adapter attached,
    switched on only while this drafter decodes).
    """

    needs_hidden = True

    def __init__(
        self,
        heads: MedusaHeads,
        choices: list[tuple[int, ...]],
        name: str = "medusa",
        verifier: PreTrainedModel | None = None,
    ):
        if not choices:
            raise UsageError("medusa: a Medusa tree needs at least one choice")
        too_deep = max(len(c) for c in choices)
        if too_deep > heads.num_heads:
            raise UsageError(
                f"medusa: the tree is {too_deep} levels deep but the checkpoint has {heads.num_heads} heads"
            )
        self.heads = heads.eval()
        self.choices = list(choices)
        self.depth = too_deep
        slots = choice_slots(self.choices)
        self.width = [max(n for prefix, n in slots.items() if len(prefix) == d) for d in range(self.depth)]
        self.name, self.verifier = name, verifier
        self._last: torch.Tensor | None = None

    def verifying(self):
        return adapter_active(self.verifier) if self.verifier is not None else super().verifying()

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self._last = hidden[-1]

    def accept(self, result: StepResult) -> None:
        self._last = result.hidden[-1]

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        depth = min(self.depth, context.max_tokens)
        if depth < 1:
            return TokenTree()
        dtype = next(self.heads.parameters()).dtype
        logits = self.heads.logits(self._last.to(dtype)[None])[:depth, 0]  # [depth, V]
        candidates, probs = [], []
        for d in range(depth):
            tokens, q = choose(logits[d : d + 1], self.width[d], context.sampling, context.generator)
            candidates.append(tokens[0].tolist())
            probs.append(q[0] if q is not None else None)
        return static_tree(self.choices, candidates, None if context.sampling.greedy else probs)


def build(spec: DrafterSpec, target: PreTrainedModel) -> MedusaDrafter:
    """The drafter of ``medusa:PATH?...``, verified by the target with the checkpoint's LoRA adapter
    when it has one (Medusa-2)."""
    options = dict(spec.options)
    heads, choices, verifier = _parts(spec.path, target, options.pop("choices", None), options.pop("budget", None))
    drafter = MedusaDrafter(heads, choices, verifier=verifier, **options)
    if verifier is not None:
        drafter.verifier_label = f"target + LoRA adapter {spec.path}/adapter (unmerged, on for this drafter only)"
    return drafter


def _parts(path: str, target: PreTrainedModel, choices, budget):
    """Heads, tree and (for Medusa-2 checkpoints) the target with its LoRA adapter to verify with.

    The tree is ``choices`` (a file or a literal), else the optimal ``budget``-node tree for the
    heads' recorded held-out accuracies, else the checkpoint's calibrated ``tree.yaml``, else the
    optimal tree of Medusa's default size (63 nodes).
    """
    heads = MedusaHeads.from_pretrained(path, target).to(next(target.parameters()).dtype)
    adapter = Path(path) / "adapter"
    verifier = attach_adapter(target, adapter) if adapter.is_dir() else None
    if verifier is not None:
        heads.bind(verifier)
    if choices is not None:
        return heads, load_choices(str(choices)), verifier
    calibrated = Path(path) / "tree.yaml"
    if budget is None and calibrated.is_file():
        return heads, load_choices(str(calibrated)), verifier
    if not heads.head_accuracy:
        raise CheckpointError(f"{path} records no head accuracies: pass choices=FILE or run eval/calibrate_tree.py")
    return heads, optimal_choices(rank_accuracy(heads.head_accuracy), int(budget or DEFAULT_TREE_SIZE)), verifier


# Calibration to the device


@torch.no_grad()
def measure_head_accuracy(target, heads: MedusaHeads, rows, batch_size: int = 1) -> list[list[float]]:
    """Per head, top-1..top-10 accuracy against the data's tokens over ``rows``, the heads reading
    ``target``'s last hidden states (as Medusa training's held-out evaluation measures them)."""
    tokens = [0.0] * heads.num_heads
    hits: list[dict[int, float]] = [{} for _ in range(heads.num_heads)]
    for batch in DataLoader(rows, batch_size=batch_size, collate_fn=pad_batch):
        batch = {k: v.to(heads.draft_vocab.device) for k, v in batch.items()}
        positions, labels = head_positions(batch, heads.num_heads)
        hidden = target.get_decoder()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        for k, (logits, gold) in enumerate(zip(heads(hidden.to(next(heads.parameters()).dtype), positions), labels)):
            found = top_k_hits(heads, logits, gold, min(TOP_K_RECORDED, logits.shape[-1]))
            tokens[k] += float(len(gold))
            for r, count in enumerate(found.tolist(), start=1):
                hits[k][r] = hits[k].get(r, 0.0) + (float(count) if len(gold) else 0.0)
    return [[hits[k][r] / max(tokens[k], 1.0) for r in range(1, TOP_K_RECORDED + 1)] for k in range(heads.num_heads)]


def recipe_sections(checkpoint: Path) -> tuple[TargetConfig, DataConfig]:
    """The ``target`` and ``data`` sections of the recipe a checkpoint was trained with (all that
    calibration reads of it; the drafter section's schema belongs to training)."""
    path = checkpoint / "recipe.yaml"
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist")
    recipe = read_yaml(path.read_text()) or {}
    return (
        from_dict(TargetConfig, recipe.get("target") or {}, f"{path} (target)"),
        from_dict(DataConfig, recipe.get("data") or {}, f"{path} (data)"),
    )


@torch.no_grad()
def measure_draft_cost(heads: MedusaHeads, repeats: int = 20) -> float:
    """Median seconds of one Medusa draft step (all heads' logits and their top-k)."""
    param = next(heads.parameters())
    hidden = torch.randn(1, heads.hidden_size, dtype=param.dtype, device=param.device)
    times = []
    for _ in range(repeats + 1):
        start = clock(param.device)
        heads.logits(hidden).topk(TOP_K_RECORDED, dim=-1)
        times.append(clock(param.device) - start)
    return statistics.median(times[1:])


def interpolate(costs: dict[int, float], n: int) -> float:
    """Pass cost at ``n`` tokens, linear between the measured sizes."""
    sizes = sorted(costs)
    return float(np.interp(n, sizes, [costs[s] for s in sizes]))


def calibrate(rank_acc: list[list[float]], costs: dict[int, float], draft_cost: float, max_budget: int) -> list[dict]:
    """Per budget: expected acceptance length, pass cost and estimated speedup over plain decoding."""
    curve = []
    for n in range(1, max_budget + 1):
        choices = optimal_choices(rank_acc, n)
        tau = expected_acceptance(choices, rank_acc)
        step = interpolate(costs, n + 1) + draft_cost
        curve.append(
            {
                "budget": n,
                "expected_acceptance": tau,
                "step_ms": step * 1e3,
                "estimated_speedup": tau * costs[1] / step,
                "choices": choices,
            }
        )
    return curve


def pass_sizes(raw: str) -> list[int]:
    """``--sizes``: comma-separated pass sizes in tokens, each at least 1 (a bad one is argparse's one-line error)."""
    try:
        sizes = [int(size) for size in raw.split(",")]
    except ValueError:
        sizes = [0]  # not a number: refused below, as a size of 0 is
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 1, got {raw!r}")
    return sizes


def calibrate_tree(argv: list[str]) -> dict:
    """Medusa's ``python eval/calibrate_tree.py CHECKPOINT [...]``: each head's top-k accuracy on the
    checkpoint's held-out data, every budget's optimal tree under those accuracies
    (:func:`optimal_choices`), the measured cost of a verification pass of n+1 tokens on this device
    and of one draft step, so the estimated speedup ``E(n) * t(1) / (t(n+1) + t_draft)``; the best
    budget's tree, the curve and the accuracies go to ``CHECKPOINT/tree.yaml``, the drafter's default."""
    parser = ArgumentParser(prog="eval/calibrate_tree.py", description="Calibrate a Medusa tree to the device.")
    parser.add_argument("checkpoint", help="a Medusa checkpoint folder")
    parser.add_argument("--target", default=None, help="default: the target named in the checkpoint's recipe")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--limit", type=at_least(1), default=None, help="held-out conversations to measure accuracy on")
    parser.add_argument("--max-budget", type=at_least(1), default=64, help="largest tree (nodes) considered")
    parser.add_argument(
        "--sizes",
        type=pass_sizes,
        default="1,2,3,4,6,8,12,16,24,32,48,64,80",
        help="pass sizes (tokens) measured; others are interpolated",
    )
    parser.add_argument("--out", default=None, help="default: CHECKPOINT/tree.yaml")
    args = parser.parse_args(argv)

    checkpoint = Path(args.checkpoint)
    recipe_target, recipe_data = recipe_sections(checkpoint)
    target_name = args.target or recipe_target.name
    target, tokenizer = load_target(target_name, args.dtype, args.device, recipe_target.chat_template)
    adapter = checkpoint / "adapter"
    verifier = attach_adapter(target, adapter, active=True) if adapter.is_dir() else target
    heads = MedusaHeads.from_pretrained(checkpoint, verifier).to(verifier.dtype)

    data_cfg = prepare_data_config(recipe_data, verifier, recipe_target.name, tokenizer)
    held_out = build_dataset(data_cfg, tokenizer)[0]["held_out"]
    if not len(held_out):
        raise DataError(
            f"{checkpoint / 'recipe.yaml'}: its data section (data.limit={recipe_data.limit}, "
            f"data.held_out_fraction={recipe_data.held_out_fraction}) holds no held-out conversation to "
            "measure the heads on; raise either there, or give the drafter a tree with medusa:PATH?choices=FILE"
        )
    if args.limit:
        held_out = held_out.select(range(min(args.limit, len(held_out))))
    accuracy = measure_head_accuracy(verifier, heads, held_out)
    rank_acc = rank_accuracy(accuracy)

    sizes = sorted(set(args.sizes) | {1})
    sizes = [s for s in sizes if s <= args.max_budget + 1] + [s for s in sizes if s > args.max_budget + 1][:1]
    costs = measure_pass_cost(CausalLMRunner(verifier), sizes=tuple(sizes))
    draft_cost = measure_draft_cost(heads)
    curve = calibrate(rank_acc, costs, draft_cost, args.max_budget)
    best = max(curve, key=lambda row: row["estimated_speedup"])

    print(f"held-out top-k accuracy per head ({len(held_out)} conversations):")
    for k, row in enumerate(accuracy):
        print(f"  head {k + 1}: top-1 {row[0]:.3f}  top-5 {row[4]:.3f}  top-10 {row[9]:.3f}")
    print(
        f"\nverification pass cost on {next(verifier.parameters()).device} "
        f"({dtype_name(next(verifier.parameters()).dtype)}), draft step {draft_cost * 1e3:.2f} ms"
    )
    print("| tokens | ms per pass | x single-token pass |\n|---|---|---|")
    for n, seconds in costs.items():
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / costs[1]:.2f} |")
    print("\n| tree nodes | expected accept len | ms per step | est. speedup |\n|---|---|---|---|")
    for row in curve:
        if row["budget"] in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 63, 64) or row is best:
            mark = "  <- chosen" if row is best else ""
            print(
                f"| {row['budget']} | {row['expected_acceptance']:.2f} | {row['step_ms']:.1f} | "
                f"{row['estimated_speedup']:.2f}{mark} |"
            )

    result = {
        "choices": [list(c) for c in best["choices"]],
        "budget": best["budget"],
        "expected_acceptance": round(best["expected_acceptance"], 4),
        "estimated_speedup": round(best["estimated_speedup"], 4),
        "measured_on": {
            "device": str(next(verifier.parameters()).device),
            "dtype": dtype_name(next(verifier.parameters()).dtype),
            "torch_threads": torch.get_num_threads(),
        },
        "head_accuracy": [[round(v, 4) for v in row] for row in accuracy],
        "pass_cost_ms": {n: round(s * 1e3, 3) for n, s in costs.items()},
        "draft_cost_ms": round(draft_cost * 1e3, 3),
        "curve": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "choices"} for row in curve
        ],
    }
    out = Path(args.out) if args.out else checkpoint / "tree.yaml"
    out.write_text(yaml.safe_dump(result, sort_keys=False, default_flow_style=None))
    print(
        f"\nchose {best['budget']} nodes (expected acceptance {best['expected_acceptance']:.2f}, "
        f"estimated {best['estimated_speedup']:.2f}x); wrote {out}"
    )
    return result
