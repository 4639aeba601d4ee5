"""Recipes that explain themselves: every field of every recipe a user writes has its meaning in
``--help`` (the comment on its line, or the comment block right above it)."""

from __future__ import annotations

import dataclasses
import typing

from draftsmith.adapt.config import AdaptRecipe
from draftsmith.config import field_docs, schema_help
from draftsmith.kinds import registered


def undocumented(cls: type, prefix: str = "") -> list[str]:
    """The recipe keys of config dataclass ``cls`` (nested sections walked) without a doc."""
    docs, hints, missing = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            missing += undocumented(hints[f.name], f"{prefix}{f.name}.")
        elif f.name not in docs:
            missing.append(prefix + f.name)
    return missing


def recipe_classes() -> dict[str, type]:
    classes = {name: kind.training.recipe for name, kind in registered().items() if kind.training is not None}
    return {**classes, "adapt": AdaptRecipe}


def test_every_recipe_field_of_every_kind_says_what_it_means():
    classes = recipe_classes()
    assert {"eagle", "eagle3", "peagle", "dflash", "dspark", "medusa", "draft_lm", "adapt"} <= set(classes)
    missing = {name: undocumented(cls) for name, cls in classes.items()}
    assert not any(missing.values()), {name: keys for name, keys in missing.items() if keys}


def test_a_comment_above_a_field_is_its_doc_and_a_blank_line_ends_it():
    """Negative control: a field with no comment on or right above its line has none."""

    @dataclasses.dataclass
    class Section:
        # read the first line
        # and the second
        above: int = 1
        trailing: int = 2  # said on its line
        # a comment that belongs to nothing

        bare: int = 3

    docs = field_docs(Section)
    assert docs == {"above": "read the first line and the second", "trailing": "said on its line"}
    assert undocumented(Section) == ["bare"]
    help_text = schema_help(Section)
    assert "above = 1  [int]  read the first line and the second" in help_text
