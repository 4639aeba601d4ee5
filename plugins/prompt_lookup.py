"""Prompt lookup: n-gram lookup in the context; training-free, nothing to export."""

from __future__ import annotations

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import prompt_lookup
from draftsmith.kinds import DrafterKind, Option

KIND = DrafterKind(
    name="prompt_lookup",
    summary="n-gram lookup in the prompt and the output so far (training-free)",
    build=prompt_lookup.build,
    options={
        "num_tokens": Option(10, "tokens drafted per step", COUNT),
        "max_ngram": Option(3, "longest suffix n-gram looked up", COUNT),
        "min_ngram": Option(2, "shortest suffix n-gram looked up", COUNT),
        "branches": Option(1, "distinct continuations drafted as a tree (1: a chain)", COUNT),
    },
)
