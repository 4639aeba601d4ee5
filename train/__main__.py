"""``draftsmith-train RECIPE.yaml [--resume] [--section.field VALUE ...]`` (or ``python -m draftsmith.train``).

Trains the drafter kind the recipe's ``drafter.kind`` names with that kind's own entry point
(``train/<kind>.py``, found through the kind registry), so the command line, ``--help`` (the
recipe schema of that kind) and the run are exactly those of ``python train/<kind>.py``.
"""

from __future__ import annotations

import inspect
import os
import shlex
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig

from draftsmith.config import read_recipe_file
from draftsmith.data_prep.served_features import serve_command
from draftsmith.errors import ArgumentParser, UsageError, report_user_errors
from draftsmith.kinds import for_recipe, registered
from draftsmith.precision import dtype_name, resolve_dtype
from draftsmith.target import default_device, resolve_target
from draftsmith.train.cli import OWN_FLAGS, parse_training_args, split_recipe
from draftsmith.train.prepare import feature_layers

USAGE = "usage: draftsmith-train RECIPE.yaml [--resume] [--section.field VALUE ...] [--debug]"


@report_user_errors
def main(argv: list[str] | None = None):
    """Dispatch to the recipe's kind; returns what its entry point returns (the finished trainer)."""
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
    ``--drafter.features offline`` then loads no target weights beyond what the head copies.

    ``draftsmith-features RECIPE.yaml --serve [--host H] [--port P] [--storage DIR]``: run the vLLM
    server that ``--drafter.features served --data.features.server http://H:P`` trains from (the
    recipe's target, dtype, layers, context and tensor parallelism; hidden-state files under DIR,
    which the trainer must see at the same path)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in argv:
        _serve([w for w in argv if w != "--serve"])
        return
    if {"-h", "--help"} & set(argv):  # the recipe's fields follow, from the kind's trainer
        print(inspect.cleandoc(features.__doc__) + "\n")
        main(argv)
        return
    _, train_set, _ = main([*argv, "--prepare-only", "--drafter.features", "offline"])
    print(f"feature store: {Path(train_set.files[0]).parent.parent}")


def _serve(argv: list[str]) -> None:
    """Replace this process with the recipe's hidden-states server (:func:`serve_command`)."""
    parser = ArgumentParser(prog="draftsmith-features RECIPE --serve")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--storage", default=None, help="where the server writes hidden states (default: a temp dir)")
    own, rest = parser.parse_known_args(argv)
    recipe_path, _ = split_recipe([w for w in rest if w not in OWN_FLAGS])
    if recipe_path is None:
        raise UsageError("give a recipe: draftsmith-features RECIPE.yaml --serve [--port P]")
    name = (read_recipe_file(recipe_path).get("drafter") or {}).get("kind")
    recipe, _ = parse_training_args(for_recipe(name, f"{recipe_path}: drafter.kind").training.recipe, rest)
    model = resolve_target(recipe.target.name, "target.name")
    storage = own.storage or tempfile.mkdtemp(prefix="draftsmith-served-")
    command = serve_command(
        model,
        dtype_name(resolve_dtype(recipe.target.dtype, default_device())),
        feature_layers(recipe),
        AutoConfig.from_pretrained(model).num_hidden_layers,
        storage,
        own.port,
        own.host,
        recipe.data.max_length + 1,
        recipe.data.features.tensor_parallel_size,
    )
    url = f"http://{own.host or 'localhost'}:{own.port}"
    print(f"train with: --drafter.features served --data.features.server {url}\n{shlex.join(command)}", flush=True)
    os.execvp(command[0], command)


def cli() -> None:
    """The ``draftsmith-train`` console script: :func:`main` without its return value (the finished
    trainer, which the console-script wrapper would print and turn into exit code 1)."""
    main()


if __name__ == "__main__":
    main()
