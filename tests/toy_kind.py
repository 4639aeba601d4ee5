"""A toy drafter kind, all in this one file, registered by one entry-point line (tests/test_kinds.py
writes it into a distribution's metadata, as a package adding kinds declares them): its drafter
proposes the last token again ``num_tokens`` times, and its trainer only says it ran.

A built-in kind's pieces live in its own modules (``heads/<kind>.py``, ``train/<kind>.py``,
``eval/engine/drafters/<kind>.py``, ``plugins/<kind>.py``, docs/architecture.md); the line is in
draftsmith's pyproject.toml."""

from __future__ import annotations

from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.kinds import DrafterKind, Option, Training
from draftsmith.recipe import Recipe


class RepeatDrafter(Drafter):
    """Drafts the last token again, ``num_tokens`` times (a chain)."""

    def __init__(self, num_tokens: int = 3):
        self.num_tokens = num_tokens

    def propose(self, context: DraftContext) -> TokenTree:
        builder, parent = TreeBuilder(), ROOT
        for _ in range(min(self.num_tokens, context.max_tokens)):
            parent = builder.add(parent, [context.tokens[-1]])[0]
        return builder.build()


def build(spec: DrafterSpec, target) -> RepeatDrafter:
    return RepeatDrafter(**spec.options)


def train(argv: list[str] | None = None) -> str:
    """The toy's ``train/<kind>.py`` entry point: the recipe it was given, untrained."""
    return f"toy trained on {argv[0]}"


KIND = DrafterKind(
    name="toy",
    summary="a toy: the last token again, num_tokens times",
    build=build,
    options={"num_tokens": Option(3, "tokens drafted per step")},
    training=Training("toy", Recipe, train, lambda recipe: (None, None, None)),
)
