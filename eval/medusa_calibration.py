"""Medusa's tree calibrated to the device (what ``python eval/calibrate_tree.py CHECKPOINT`` runs for a
Medusa checkpoint, through ``DrafterKind.calibrate``): each head's held-out accuracy, every budget's
optimal static tree, this device's pass and draft costs, the fastest tree written to
``CHECKPOINT/tree.yaml``, which the drafter then uses by default.

Medusa's own module (declared in its kind's ``modules``), in the harness: it loads the target,
builds the held-out data and owns a command line, none of which belongs in the decoding engine.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader

from draftsmith.config import RecipeError, from_dict, read_yaml
from draftsmith.data_prep.dataset import build_dataset, pad_batch
from draftsmith.data_prep.regenerate import prepare_data_config
from draftsmith.data_prep.sharegpt import DataError
from draftsmith.errors import ArgumentParser, at_least
from draftsmith.eval.engine.drafters.medusa import expected_acceptance, optimal_choices
from draftsmith.eval.engine.pass_cost import measure_pass_cost
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.heads.medusa import (
    TOP_K_RECORDED,
    MedusaHeads,
    head_positions,
    rank_accuracy,
    top_k_hits,
)
from draftsmith.precision import DTYPE_CHOICES, dtype_name
from draftsmith.recipe import DataConfig, TargetConfig
from draftsmith.target import attach_adapter, load_target
from draftsmith.timing import clock


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
