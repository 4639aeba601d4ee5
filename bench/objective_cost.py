"""What each token objective costs per training step, against forward KL (the default).

    python bench/objective_cost.py --out DIR [--recipe recipes/smollm2-eagle3.yaml] [--repeats 3]
        [--objectives "kl_div rkl jsd ..."] [--key value ...]

One optimiser step (loss, backward, AdamW) of the recipe's head at its batch on its target, the
target's features computed once beforehand (as ``features: offline`` does), under each objective
in turn on the same batch and the same head: the median of ``--repeats`` timed steps after one
warm-up each. ``kl_div`` is timed first and again last (the first timing of a process runs slower:
both are reported, the ratio uses the later). Further ``--key value`` pairs override the recipe.
Writes ``DIR/objective_cost.json`` and prints a Markdown table: seconds a step and the ratio to
``kl_div``'s, so equal-minutes comparisons can be read as so many steps each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from train_step import median_step_seconds, task_on_first_batch

from draftsmith.train.objectives import describe, parse_objective

DEFAULT = 'kl_div rkl jsd ce tv nla lk_hybrid {"ce":0.1,"tv":0.9} {"kl_div":0.5,"tv":0.5}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for objective_cost.json")
    parser.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--objectives", default=DEFAULT, help="space-separated names or JSON mixes (no spaces)")
    args, overrides = parser.parse_known_args()
    forward_kl = {"kl_div": 1.0}
    try:
        others = [m for m in (parse_objective(o, "--objectives") for o in args.objectives.split()) if m != forward_kl]
    except ValueError as err:
        parser.error(str(err))
    kind = yaml.safe_load(Path(args.recipe).read_text())["drafter"]["kind"]
    recipe, task, batch = task_on_first_batch(args.recipe, kind, overrides)
    if not hasattr(task, "loss_config"):
        parser.error(f"{args.recipe}: drafter.kind {kind!r} takes no token objective")
    precision = recipe.training.mixed_precision
    runs = [("kl_div (first)", forward_kl), *((describe(m), m) for m in others), ("kl_div (again, last)", forward_kl)]
    seconds: dict[str, float] = {}
    for name, mix in runs:
        task.loss_config.objective = mix
        seconds[name] = median_step_seconds(task, batch, args.repeats, precision, training=True)
    base = seconds["kl_div (again, last)"]
    result = {
        "recipe": args.recipe,
        "overrides": overrides,
        "batch": list(batch["input_ids"].shape),
        "precision": precision,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "step_seconds": seconds,
        "ratio_to_kl_div": {name: t / base for name, t in seconds.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "objective_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"| objective | step, s | / kl_div |  ({kind}, batch {result['batch']}, {precision})")
    print("|---|---:|---:|")
    for name, t in seconds.items():
        print(f"| `{name}` | {t:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
