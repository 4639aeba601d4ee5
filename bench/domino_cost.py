"""Cost of one Domino training step against one DFlash step, and where Domino's goes.

    OMP_NUM_THREADS=1 python bench/domino_cost.py --out DIR [--repeats 3] [--rounds 2] [--profile]
        [--labels "target data"] [--warmup] [--key value ...]

Both drafters from their ``smollm2-*`` recipes (Domino on the references' schedule) on the same
first ``training.batch_size`` conversations (ShareGPT's own replies, regeneration off, 512 tokens),
the target's features computed once beforehand, fp32 unless ``--target.dtype`` says otherwise (the
recipe's mixed precision follows it), training steps drawing the same anchors every time.
``--labels`` times each kind under each ``drafter.labels`` given (``target``: the target's
distribution, the recipes'; ``data``: the data's tokens, SpecForge's hard labels). The steps are
timed in alternation (``--rounds`` rounds of ``--repeats`` optimiser steps each, loss + backward +
AdamW, the median after one warm-up) so a shared machine's load falls on all alike; each ratio is a
median over DFlash's under the first ``--labels``. ``--warmup`` adds a Domino step of
``drafter.backbone_warmup``'s first part (the backbone alone over the 8,192 most frequent tokens;
under ``data`` labels, which it needs). ``--profile`` also writes one step of each under
torch.profiler (CPU, two steps after two that warm up): the top operators by self time,
``DIR/profile_<name>.txt``. Further ``--key value`` pairs override both recipes.

Writes ``DIR/domino_cost.json``: per kind and labels the step medians of each round and their
median, and ``ratio``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from train_step import median_step_seconds, task_on_first_batch

KINDS = ("dflash", "domino")
OVERRIDES = ["--data.max_length", "512", "--target.dtype", "float32"]


def profile_step(task, batch: dict, precision: str, path: Path) -> None:
    """Two optimiser steps (after as many that warm up) under torch.profiler: the operators by self
    CPU time into ``path``."""
    median_step_seconds(task, batch, 1, precision, training=True, seed=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        median_step_seconds(task, batch, 1, precision, training=True, seed=0)
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--labels", default="target", help="space-separated drafter.labels values to time")
    parser.add_argument("--warmup", action="store_true", help="also time a Domino backbone warm-up step (data labels)")
    args, overrides = parser.parse_known_args()
    labels = args.labels.split()
    if not labels or not set(labels) <= {"target", "data"} or len(set(labels)) < len(labels):
        parser.error(f"--labels {args.labels!r}: give target, data or both, once each")
    if args.warmup and "data" not in labels:
        parser.error("--warmup: the backbone warm-up learns the data's tokens; add data to --labels")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {}
    for label in labels:
        for kind in KINDS:
            name = kind if len(labels) == 1 else f"{kind} ({label})"
            # Domino on the references' schedule (no backbone warm-up, whatever the recipe says)
            schedule = ["--drafter.backbone_warmup", "0"] if kind == "domino" else []
            recipe, task, batch = task_on_first_batch(
                f"recipes/smollm2-{kind}.yaml", kind, [*OVERRIDES, "--drafter.labels", label, *schedule, *overrides]
            )
            tasks[name] = task, batch, recipe.training.mixed_precision
    if args.warmup:
        warmup = ["--drafter.labels", "data", "--drafter.backbone_warmup", "0.5", *overrides]
        recipe, task, batch = task_on_first_batch("recipes/smollm2-domino.yaml", "domino", [*OVERRIDES, *warmup])
        task.on_progress(0.0)  # inside the warm-up
        tasks["domino (data-warmup)"] = task, batch, recipe.training.mixed_precision
    if args.profile:
        for name, (task, batch, precision) in tasks.items():
            profile_step(task, batch, precision, out / f"profile_{name.replace(' (', '_').rstrip(')')}.txt")
    rounds = {name: [] for name in tasks}
    for _ in range(args.rounds):
        for name, (task, batch, precision) in tasks.items():
            # Training steps (a Domino warm-up step is one only in training) drawing the same anchors
            # every time: each round times the same work.
            rounds[name].append(median_step_seconds(task, batch, args.repeats, precision, training=True, seed=0))
    report = {name: {"step_s_rounds": r, "step_s": statistics.median(r)} for name, r in rounds.items()}
    base = report[next(iter(tasks))]["step_s"]
    for name in tasks:
        report[name]["ratio"] = report[name]["step_s"] / base
    report["ratio"] = report[list(tasks)[1]]["step_s"] / base  # Domino over DFlash, the first labels
    report["precision"] = {name: precision for name, (_, _, precision) in tasks.items()}
    report["overrides"] = overrides
    report["threads"] = torch.get_num_threads()
    (out / "domino_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
