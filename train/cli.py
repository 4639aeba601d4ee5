"""Command line shared by the training entry points: ``SCRIPT RECIPE.yaml [--resume] [--key.path value ...]``."""

from __future__ import annotations

import sys

from draftsmith.config import load_recipe, schema_help
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.recipe import OVERRIDE_ALIASES
from draftsmith.target import move_target
from draftsmith.timing import stage
from draftsmith.train.distributed import main_process_first, resolve_precision
from draftsmith.train.loop import Trainer

# the entry points' own flags; every other word is the recipe or an override
OWN_FLAGS = ("-h", "--help", "--resume", "--prepare-only")


def parse_training_args(recipe_class, argv: list[str] | None = None, description: str = ""):
    """``(recipe, args)`` from the command line (``args.resume``, ``args.prepare_only``); overrides are
    any ``--section.field value``."""
    parser = ArgumentParser(
        description=description,
        epilog="recipe fields (any of them is a flag: --section.field "
        "VALUE; --output_dir DIR is short for --training.output_dir):\n" + schema_help(recipe_class),
    )
    parser.add_argument("recipe", nargs="?", help="YAML recipe (defaults apply where it is silent)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="prepare the data (regeneration, tokenising, an offline feature store) and stop before training",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args([w for w in argv if w in OWN_FLAGS])
    recipe_path, overrides = split_recipe([w for w in argv if w not in OWN_FLAGS])
    recipe = load_recipe(recipe_class, recipe_path, overrides, aliases=OVERRIDE_ALIASES)
    return resolve_precision(recipe), args


def split_recipe(words: list[str]) -> tuple[str | None, list[str]]:
    """``(recipe path, overrides)`` from the command line's words (its own flags taken out).

    argparse would take the value of a leading ``--section.field VALUE`` for the recipe: the recipe
    is the first word that is not such a value."""
    recipe_path, overrides, i = None, [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and "=" not in word and i + 1 < len(words):
            overrides += words[i : i + 2]
            i += 2
            continue
        if word.startswith("-") or "=" in word or recipe_path is not None:
            overrides.append(word)
        else:
            recipe_path = word
        i += 1
    return recipe_path, overrides


def run_training(recipe_class, build, argv: list[str] | None = None, description: str = ""):
    """Parse the command line, ``build(recipe) -> (task, train_set, eval_set)`` and train.

    Returns the finished :class:`~draftsmith.train.loop.Trainer` (``.history``, ``.task``,
    ``.last_checkpoint``), or with ``--prepare-only`` ``(task, train_set, eval_set)`` untrained.
    Bad input ends the program with one line on stderr and exit code 2.
    """
    return report_user_errors(_train)(argv, recipe_class, build, description)


def entry_point(recipe_class, build, description: str):
    """A kind's ``main(argv=None)``: :func:`run_training` of ``recipe_class`` with ``build``, its
    ``--help`` opening with ``description`` (the kind's module docstring)."""

    def main(argv: list[str] | None = None):
        return run_training(recipe_class, build, argv, description)

    main.__doc__ = "Train as the command line says; returns the finished trainer (``.history``, ``.task``)."
    return main


def _train(argv: list[str] | None, recipe_class, build, description: str):
    recipe, args = parse_training_args(recipe_class, argv, description)
    # Under `accelerate launch` the main process prepares the data (regeneration, tokenised
    # cache, features, token counts) while the others wait, then they find it all cached.
    with main_process_first(recipe):
        task, train_set, eval_set = build(recipe)
    if args.prepare_only:
        return task, train_set, eval_set
    trainer = Trainer(recipe, task, train_set, eval_set)
    move_target(task.target, trainer.accelerator.device)
    with stage("train: training loop"):
        trainer.last_checkpoint = trainer.train(resume=args.resume)
    return trainer
