"""The main job: train a drafter for the bundled SmolLM2 target on ShareGPT (the kind its recipe's
``drafter.kind`` names: an EAGLE head by default), then benchmark it on MT-bench against plain
decoding, prompt lookup and suffix decoding, and beside them the hybrid of the head and suffix
decoding in one tree (``hybrid:KIND:CHECKPOINT+suffix``), and print the acceptance table and the
wall time of every stage.

    python eval/demo.py                      # what `make demo` runs
    python eval/demo.py --train-minutes 10 --per-category 2 --max-new-tokens 256 --eval-minutes 0

Training is bounded by wall-clock time (``training.max_minutes``), not by steps, and so is the
benchmark (``--eval-minutes``: no question starts after it), so the job takes about as long on a
slow CPU as on a fast one: the head gets what the machine can give it in that time, and a slow
machine's table holds fewer questions (it says how many ran). The dtype is chosen by measurement
(``auto``): bf16 where it is fast, else fp32. So is the EAGLE tree (``depth=auto``,
:mod:`draftsmith.eval.engine.tree_plan`): its depth maximises Leviathan et al.'s expected speedup
for this head's held-out accuracy, this device's verification cost curve and draft-step cost, and it
is widened while the verification pass stays within 10% of the chain's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from draftsmith.config import RecipeError
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.run import main as eval_main
from draftsmith.kinds import for_recipe
from draftsmith.timing import stage_table

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-eagle-demo.yaml"
# A head trained for minutes on a CPU loses to training-free drafting; what more training gives is
# measured elsewhere, and the table says where, so that a newcomer does not read the demo's head as
# the ceiling (figures: BENCHMARKS.md's first table, whose rows these are).
LONGER = """\
The head above trained for minutes on this CPU, so it is weak. What longer training gives (BENCHMARKS.md,
"Current best figure per drafter kind and policy"; MT-bench 16 x 256, bf16, 2-core CPU):
  EAGLE-3, 60 min of CPU training: accept len 1.91, 1.25x; with suffix decoding in one tree (hybrid): 2.86, 1.81x
  suffix decoding alone: 1.92, 1.71x; prompt lookup alone: 1.85, 1.75x
A GPU-trained head has no figure yet (docs/gpu_runbook.md prepares that run)."""


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    """Train, benchmark, print the table and the stage times; returns the benchmark summary."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(RECIPE), help="recipe of the drafter to train (any trainable kind)")
    parser.add_argument("--out-dir", default="runs/demo", help="training output (the head: OUT_DIR/checkpoint-final)")
    parser.add_argument("--results", default="results/demo", help="benchmark output folder")
    parser.add_argument("--train-minutes", type=float, default=None, help="training budget (default: the recipe's)")
    parser.add_argument("--per-category", type=int, default=1, help="MT-bench questions per category (8 categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per MT-bench question")
    parser.add_argument(
        "--eval-minutes",
        type=float,
        default=2.0,
        help="start no MT-bench question after this many minutes of decoding, so that the job's length "
        "does not depend on the CPU (the table says how many ran; 0: no limit)",
    )
    parser.add_argument("--dtype", default="auto", help="target dtype for training and decoding")
    args, train_overrides = parser.parse_known_args(argv)
    if not args.eval_minutes >= 0:
        parser.error(f"--eval-minutes must be >= 0 (0: no limit), got {args.eval_minutes}")
    overrides = ["--output_dir", args.out_dir, "--target.dtype", args.dtype, *train_overrides]
    if args.train_minutes is not None:
        overrides += ["--training.max_minutes", str(args.train_minutes)]
    kind = for_recipe(_recipe_kind(args.recipe), f"{args.recipe}: drafter.kind")
    trainer = kind.training.main([args.recipe, *overrides])
    summary = eval_main(
        [
            "--target",
            trainer.recipe.target.name,
            "--dtype",
            trainer.recipe.target.dtype,
            "--bench",
            "mt_bench",
            "--per-category",
            str(args.per_category),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--temperature",
            "0",
            "--drafter",
            f"{kind.name}:{trainer.last_checkpoint}",
            "--drafter",
            "prompt_lookup",
            "--drafter",
            "suffix",
            "--drafter",
            # switch: the head drafts only in steps where its measured yield beats suffix's alone; with a head of
            # minutes it was 0.98x suffix where merge was 0.95x (BENCHMARKS.md, the main job's section)
            f"hybrid:{kind.name}:{trainer.last_checkpoint}+suffix",
            "--out",
            args.results,
            *(["--max-minutes", str(args.eval_minutes)] if args.eval_minutes else []),
        ]
    )
    print(f"\n{LONGER}\n\nwall time per stage:\n{stage_table()}")
    return summary


def _recipe_kind(path: str) -> str:
    """The recipe's ``drafter.kind`` (the trainer then reads and validates the whole recipe)."""
    try:
        return yaml.safe_load(Path(path).read_text())["drafter"]["kind"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as error:
        raise RecipeError(f"{path}: no readable drafter.kind ({error}); give a training recipe") from None


if __name__ == "__main__":
    main()
