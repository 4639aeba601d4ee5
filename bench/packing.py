"""Supervised tokens a second of training with packing (``training.packing``) against length grouping.

    python bench/packing.py [--recipe recipes/smollm2-eagle3.yaml] [--steps 8] [--out DIR] [--key value ...]

Trains the recipe's head twice, on the same data for the same number of optimiser steps: once with
``training.group_by_length`` (padded batches of similar lengths) and once with ``training.packing``
(whole conversations packed into ``batch_size`` rows of ``data.max_length``, no pads but each row's
tail). Regeneration and tracking are off, nothing is held out (``--data.limit`` conversations of
ShareGPT's own replies, 200 by default). Prints one JSON object (and writes ``DIR/packing.json``
with ``--out``): each run's supervised tokens, loop seconds and supervised tokens a second, the
packed/grouped ratio, and what it ran on. Further ``--key value`` pairs override the recipe for
both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from draftsmith.train import eagle3


def run(recipe: str, steps: int, packing: bool, out: Path, extra: list[str]) -> dict:
    """One training run; its supervised tokens, loop seconds and their rate."""
    argv = [
        recipe,
        "--output_dir",
        str(out),
        "--data.regenerate.enabled",
        "false",
        "--data.limit",
        "200",
        "--data.held_out_fraction",
        "0.0",
        "--tracking.report_to",
        "none",
        "--training.max_minutes",
        "null",
        "--training.max_steps",
        str(steps),
        "--training.log_every",
        str(steps),
        "--training.group_by_length",
        "false" if packing else "true",
        "--training.packing",
        "true" if packing else "false",
        *extra,
    ]
    trainer = eagle3.main(argv)
    state = trainer.state
    return {
        "supervised_tokens": state.tokens,
        "loop_s": round(state.seconds, 2),
        "supervised_tokens_per_s": round(state.tokens / state.seconds, 1),
        "batch_size": trainer.recipe.training.batch_size,
        "max_length": trainer.recipe.data.max_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml")
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps of each run")
    parser.add_argument("--out", help="folder for packing.json")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        grouped = run(args.recipe, args.steps, False, Path(tmp) / "grouped", extra)
        packed = run(args.recipe, args.steps, True, Path(tmp) / "packed", extra)
    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "overrides": extra,
        "group_by_length": grouped,
        "packing": packed,
        "ratio_packed_to_grouped": round(packed["supervised_tokens_per_s"] / grouped["supervised_tokens_per_s"], 3),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "packing.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
