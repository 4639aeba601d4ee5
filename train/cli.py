"""Command line shared by the training entry points: ``SCRIPT RECIPE.yaml [--resume] [--key.path value ...]``."""

from __future__ import annotations

import argparse

from draftsmith.config import load_recipe
from draftsmith.recipe import OVERRIDE_ALIASES


def parse_training_args(recipe_class, argv: list[str] | None = None, description: str = ""):
    """``(recipe, resume)`` from the command line; overrides are any ``--section.field value``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="YAML recipe (defaults apply where it is silent)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    args, overrides = parser.parse_known_args(argv)
    return load_recipe(recipe_class, args.recipe, overrides, aliases=OVERRIDE_ALIASES), args.resume


def run_training(recipe_class, build, argv: list[str] | None = None, description: str = ""):
    """Parse the command line, ``build(recipe) -> (task, train_set, eval_set)`` and train.

    Returns the finished :class:`~draftsmith.train.loop.Trainer` (``.history``, ``.task``,
    ``.last_checkpoint``).
    """
    from draftsmith.train.loop import Trainer, main_process_first

    recipe, resume = parse_training_args(recipe_class, argv, description)
    # Under `accelerate launch` the main process prepares the data (regeneration, tokenised
    # cache, features, token counts) while the others wait, then they find it all cached.
    with main_process_first(recipe):
        task, train_set, eval_set = build(recipe)
    trainer = Trainer(recipe, task, train_set, eval_set)
    task.target.to(trainer.accelerator.device)
    trainer.last_checkpoint = trainer.train(resume=resume)
    return trainer


def target_and_data(recipe):
    """The recipe's target (frozen), its tokenizer and the tokenised train/held-out set, after
    self-distillation when ``data.regenerate`` asks for it."""
    from draftsmith.data_prep.dataset import build_dataset
    from draftsmith.data_prep.regenerate import prepare_data_config
    from draftsmith.target import load_target

    target, tokenizer = load_target(recipe.target.name, recipe.target.dtype, chat_template=recipe.target.chat_template)
    data, _ = build_dataset(prepare_data_config(recipe.data, target, recipe.target.name, tokenizer), tokenizer)
    return target, tokenizer, data
