"""``draftsmith-train RECIPE.yaml [--resume] [--section.field VALUE ...]`` (or ``python -m draftsmith.train``).

Trains the drafter kind the recipe's ``drafter.kind`` names with that kind's own entry point
(``train/<kind>.py``, found through the kind registry), so the command line, ``--help`` (the
recipe schema of that kind) and the run are exactly those of ``python train/<kind>.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.config import read_recipe_file
from draftsmith.errors import UsageError, report_user_errors
from draftsmith.kinds import for_recipe, registered
from draftsmith.plugins import register_builtin
from draftsmith.train.cli import OWN_FLAGS, split_recipe

USAGE = "usage: draftsmith-train RECIPE.yaml [--resume] [--section.field VALUE ...] [--debug]"


@report_user_errors
def main(argv: list[str] | None = None):
    """Dispatch to the recipe's kind; returns what its entry point returns (the finished trainer)."""
    register_builtin()
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe, _ = split_recipe([w for w in argv if w not in OWN_FLAGS])
    trainable = ", ".join(kind.training.recipe_kind for kind in registered().values() if kind.training)
    if recipe is None:
        if "-h" in argv or "--help" in argv:
            print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2)[1]}\nKinds a recipe's drafter.kind may name: {trainable}.")
            return None
        raise UsageError(f"give a recipe ({USAGE.removeprefix('usage: ')}); recipes train one of: {trainable}")
    name = (read_recipe_file(recipe).get("drafter") or {}).get("kind")
    if name is None:
        raise UsageError(f"{recipe}: drafter.kind is not set; set it to one of: {trainable}")
    return for_recipe(name, f"{recipe}: drafter.kind").training.main(argv)


@report_user_errors
def features(argv: list[str] | None = None):
    """``draftsmith-features RECIPE.yaml [--section.field VALUE ...]``: fill the recipe's offline
    feature store (``data.features.engine``: vLLM where it is installed) and stop; training with
    ``--drafter.features offline`` then loads no target weights beyond what the head copies."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _, train_set, _ = main([*argv, "--prepare-only", "--drafter.features", "offline"])
    print(f"feature store: {Path(train_set.files[0]).parent.parent}")


if __name__ == "__main__":
    main()
