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
