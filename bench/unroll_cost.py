"""Cost of one EAGLE-3 (or P-EAGLE) training step against the number of training-time-test passes.

    python bench/unroll_cost.py --out DIR [--recipe recipes/smollm2-eagle3.yaml] [--repeats 5] [--key value ...]

One optimiser step of the EAGLE-3 head (unrolled loss, backward, AdamW step) at the recipe's batch
on its target, with the target's features computed once beforehand (as ``features: offline``
does), for ``ttt_steps`` k = 1, 3 and 7, on the same batch: the median of ``--repeats`` timed
steps after one warm-up. The batch is the first ``training.batch_size`` conversations of the
recipe's data (ShareGPT's own replies: regeneration off, so nothing to generate first), at the
recipe's precision; further ``--key value`` pairs override the recipe (e.g.
``--drafter.out_of_vocab_targets renormalise``). Writes ``DIR/unroll_cost.json``: ``step_s_k1``, ``step_s_k3``,
``step_s_k7``, ``tokens_per_s_k1`` (real tokens a second at k = 1), ``ratio_k7_k1`` and what it ran on. A P-EAGLE
recipe (``--recipe recipes/smollm2-*.yaml`` of a parallel kind) times its parallel passes, chain-sampled as the
recipe says (``--drafter.down_sample_ratio 1``: every position).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from train_step import median_step_seconds, task_on_first_batch

from draftsmith.kinds import for_recipe
from draftsmith.train.eagle3 import Eagle3Recipe

PASSES = (1, 3, 7)


def step_seconds(task, batch: dict, passes: int, repeats: int, precision: str) -> float:
    """Median wall time of one optimiser step of ``task``'s head with ``passes`` unroll passes."""
    task.cfg.ttt_steps = task.loss_config.steps = passes
    return median_step_seconds(task, batch, repeats, precision, training=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for unroll_cost.json")
    parser.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    args, overrides = parser.parse_known_args()
    kind = yaml.safe_load(Path(args.recipe).read_text())["drafter"]["kind"]
    training = for_recipe(kind).training
    if not issubclass(training.recipe, Eagle3Recipe):
        parser.error(f"{args.recipe}: drafter.kind {kind!r}: this bench times EAGLE-3 recipes and their kin")
    recipe, task, batch = task_on_first_batch(args.recipe, kind, overrides)
    tokens = int(batch["attention_mask"].sum())
    result = {
        f"step_s_k{k}": step_seconds(task, batch, k, args.repeats, recipe.training.mixed_precision) for k in PASSES
    }
    result.update(
        {
            "tokens_per_s_k1": tokens / result["step_s_k1"],
            "ratio_k7_k1": result["step_s_k7"] / result["step_s_k1"],
            "batch": list(batch["input_ids"].shape),
            "real_tokens": tokens,
            "repeats": args.repeats,
            "precision": recipe.training.mixed_precision,
            "recipe": args.recipe,
            "overrides": overrides,
            "threads": torch.get_num_threads(),
        }
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unroll_cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
