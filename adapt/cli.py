"""``draftsmith-adapt RECIPE.yaml [--rounds N] [--adapt.field VALUE ...]``: adaptation rounds of a deployed head.

Each round continues training the serving head on the traffic captured since (``eval/run.py
--capture DIR``, or a :class:`~draftsmith.data_prep.traffic.TrafficStore` in your own serving loop)
with a replay share of its own training data, judges the challenger against the serving head in
draftsmith's engine on the most recent requests, and publishes it (export, then an atomic switch of
``OUT/current``) only when it wins by the recipe's margin with the confidence the requests support.
Serve ``OUT/current/export`` (vLLM) or ``OUT/current/checkpoint`` (draftsmith). Killed, it resumes.

``--watch --vllm-url URL`` runs beside a ``vllm serve``: a round each time ``adapt.held_out`` new
requests arrived (a request log's new requests' features extracted with vLLM), each promotion pushed
into the running vLLM and probed, no restart (``adapt/watch.py``; ``docs/adapt.md`` says how to start vLLM).
"""

from __future__ import annotations

import json

from draftsmith.adapt.config import AdaptRecipe
from draftsmith.adapt.rounds import Adapter, serving_head
from draftsmith.config import load_recipe, schema_help
from draftsmith.errors import ArgumentParser, UsageError, at_least, report_user_errors
from draftsmith.train.cli import split_recipe


@report_user_errors
def main(argv: list[str] | None = None) -> list[dict]:
    """Run the rounds the command line asks for; returns their records."""
    parser = ArgumentParser(
        prog="draftsmith-adapt",
        usage="draftsmith-adapt [RECIPE.yaml] [--rounds N] [--watch --vllm-url URL] [--adapt.field VALUE ...]",
        description=__doc__,
        epilog="recipe fields (any of them is a flag: --section.field VALUE):\n" + schema_help(AdaptRecipe),
    )
    parser.add_argument(
        "--rounds", type=at_least(1), default=None, help="rounds to run now (default 1; --watch: forever)"
    )
    parser.add_argument("--watch", action="store_true", help="poll the traffic and push each promotion into --vllm-url")
    parser.add_argument("--vllm-url", default=None, help="--watch: the vllm serve to push into (http://HOST:PORT)")
    parser.add_argument("--poll", type=float, default=30.0, help="--watch: seconds between looks at the traffic")
    # The recipe path and --section.field overrides are split as the training scripts split them
    # (argparse would take an override's value for a positional recipe).
    own, rest = parser.parse_known_args(argv)
    path, overrides = split_recipe(rest)
    recipe = load_recipe(AdaptRecipe, path, overrides)
    if own.watch:
        from draftsmith.adapt.watch import HttpServer, Watcher

        if not own.vllm_url:
            raise UsageError("--watch needs --vllm-url http://HOST:PORT (a vllm serve started as docs/adapt.md says)")
        return Watcher(Adapter(recipe.adapt), HttpServer(own.vllm_url)).run(own.poll, own.rounds)
    if own.vllm_url:
        raise UsageError("--vllm-url is for --watch")
    results = [r.record() for r in Adapter(recipe.adapt).run(own.rounds or 1)]
    print(json.dumps({"serving": str(serving_head(recipe.adapt.out_dir)), "rounds": results}, indent=1))
    return results


def cli() -> None:
    """The ``draftsmith-adapt`` console script: :func:`main` without its return value (the rounds'
    records, which the console-script wrapper would print and turn into exit code 1)."""
    main()


if __name__ == "__main__":
    main()
