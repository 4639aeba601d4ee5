"""Cost of one Domino training step against one DFlash step, and where Domino's goes.

    OMP_NUM_THREADS=1 python bench/domino_cost.py --out DIR [--repeats 3] [--rounds 2] [--profile]

Both drafters from their ``smollm2-*`` recipes on the same first ``training.batch_size``
conversations (ShareGPT's own replies, regeneration off, 512 tokens), the target's features
computed once beforehand, fp32, the same held-out anchors every step. The two kinds' steps are
timed in alternation (``--rounds`` rounds of ``--repeats`` optimiser steps each, loss + backward +
AdamW, the median after one warm-up) so a shared machine's load falls on both alike; the ratio is
Domino's median over DFlash's. ``--profile`` also writes one step of each under torch.profiler
(CPU, two steps after two that warm up): the top operators by self time, ``DIR/profile_<kind>.txt``.

Writes ``DIR/domino_cost.json``: per kind the step medians of each round and their median, and
``ratio``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from train_step import first_batch, median_step_seconds

from draftsmith.train.cli import parse_training_args
from draftsmith.train.dflash import DFlashRecipe
from draftsmith.train.dflash import build as build_dflash
from draftsmith.train.domino import DominoRecipe
from draftsmith.train.domino import build as build_domino

KINDS = {"dflash": (DFlashRecipe, build_dflash), "domino": (DominoRecipe, build_domino)}
OVERRIDES = [
    "--data.regenerate.enabled", "false", "--data.limit", "64", "--data.max_length", "512",
    "--target.dtype", "float32", "--drafter.features", "online", "--tracking.report_to", "none",
]  # fmt: skip


def task_and_batch(kind: str) -> tuple:
    """The ``kind`` recipe's task and its first batch, with the target's features attached."""
    recipe_class, build = KINDS[kind]
    recipe, _ = parse_training_args(recipe_class, [f"recipes/smollm2-{kind}.yaml", *OVERRIDES])
    task, train_set, _ = build(recipe)
    batch = first_batch(train_set, recipe.training.batch_size)
    with torch.no_grad():
        batch["aux"], batch["hidden"] = task.target_features(batch)
    return task, batch


def profile_step(task, batch: dict, path: Path) -> None:
    """Two optimiser steps (after as many that warm up) under torch.profiler: the operators by self
    CPU time into ``path``."""
    median_step_seconds(task, batch, 1, "no", training=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        median_step_seconds(task, batch, 1, "no", training=False)
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {kind: task_and_batch(kind) for kind in KINDS}
    if args.profile:
        for kind, (task, batch) in tasks.items():
            profile_step(task, batch, out / f"profile_{kind}.txt")
    rounds = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind, (task, batch) in tasks.items():
            # training=False draws the same anchors every step: each round times the same work.
            rounds[kind].append(median_step_seconds(task, batch, args.repeats, "no", training=False))
    report = {kind: {"step_s_rounds": rounds[kind], "step_s": statistics.median(rounds[kind])} for kind in KINDS}
    report["ratio"] = report["domino"]["step_s"] / report["dflash"]["step_s"]
    report["threads"] = torch.get_num_threads()
    (out / "domino_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
