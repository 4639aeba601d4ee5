"""Recipes that explain themselves: every field of every recipe a user writes has its meaning in
``--help`` (the comment on its line, or the comment block right above it), and every number its
allowed range, declared once on the field (``Annotated[int, COUNT]``), printed beside the meaning
and checked wherever a recipe is read (its file, a command-line override)."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Annotated

import pytest
from cli_helpers import assert_user_error, user_error

from draftsmith.adapt.cli import main as adapt_main
from draftsmith.adapt.config import AdaptRecipe
from draftsmith.config import (
    COUNT,
    FRACTION,
    POSITIVE,
    RecipeError,
    check_ranges,
    field_docs,
    field_ranges,
    load_recipe,
    schema_help,
)
from draftsmith.kinds import registered
from draftsmith.recipe import Recipe
from draftsmith.train.dspark import main as dspark_main


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


def numbers(tp) -> set[type]:
    """The number types (int, float) a field of type ``tp`` holds: itself, a list's elements, either or null."""
    if typing.get_origin(tp) in (typing.Union, type(int | None)):
        return set().union(*(numbers(arg) for arg in typing.get_args(tp)))
    if typing.get_origin(tp) is list:
        return numbers(typing.get_args(tp)[0])
    return {tp} & {int, float}


def unranged(cls: type, prefix: str = "") -> list[str]:
    """The recipe keys of config dataclass ``cls`` (nested sections walked) that hold numbers and declare no range."""
    hints, ranges, missing = typing.get_type_hints(cls), field_ranges(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            missing += unranged(hints[f.name], f"{prefix}{f.name}.")
        elif numbers(hints[f.name]) and f.name not in ranges:
            missing.append(prefix + f.name)
    return missing


def test_every_numeric_recipe_field_of_every_kind_declares_its_range():
    missing = {name: unranged(cls) for name, cls in recipe_classes().items()}
    assert not any(missing.values()), {name: keys for name, keys in missing.items() if keys}


def test_a_numeric_field_without_a_declared_range_is_reported():
    """Negative control: of a section's numbers, the one with no ``Annotated`` range is reported;
    text, flags and a choice among numbers (a Literal) are not numbers to bound."""

    @dataclasses.dataclass
    class Section:
        counted: Annotated[int, COUNT] = 1  # a count
        optional: Annotated[float, POSITIVE] | None = None  # a bound number or null
        shares: Annotated[list[float], FRACTION] = dataclasses.field(default_factory=list)  # each bounded
        bare: int = 2  # no range
        bare_list: list[float] | None = None  # nor here
        name: str = "x"  # text
        flag: bool = True  # a flag
        stage: typing.Literal[0, 1, 2] = 0  # a choice

    assert unranged(Section) == ["bare", "bare_list"]
    assert field_ranges(Section) == {"counted": COUNT, "optional": POSITIVE, "shares": FRACTION}


def sections(obj, prefix: str = ""):
    """``(key path, section)`` of config dataclass instance ``obj`` and every section nested in it."""
    yield prefix.rstrip("."), obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from sections(value, f"{prefix}{f.name}.")


@pytest.mark.parametrize("name", sorted(recipe_classes()))
def test_every_default_is_inside_its_declared_range_and_integers_take_integer_ranges(name):
    cls = recipe_classes()[name]
    for where, section in sections(cls()):
        check_ranges(section, where)
        hints = typing.get_type_hints(type(section))
        for field_name, allowed in field_ranges(type(section)).items():
            assert numbers(hints[field_name]) == {int if allowed.integer else float}, (where, field_name, allowed)


def test_an_out_of_range_number_is_refused_in_one_line_naming_the_key_the_range_and_the_value(capsys, tmp_path):
    """From the recipe file and from a command-line override alike: exit code 2, one line on stderr.
    A float's open bound (0 is not > 0), an integer count, a list's element, a bound a kind narrows
    (DSpark's block_size), an adapt recipe's; null stays allowed where the type allows it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("drafter:\n  kind: dspark\ntraining:\n  learning_rate: 0\n")
    source = re.escape(str(recipe))
    message = rf"{source}: training\.learning_rate must be a number > 0, got 0\.0$"
    assert_user_error(capsys, message, dspark_main, [str(recipe)])
    recipe.write_text("drafter:\n  kind: dspark\n")
    for override, message in {
        ("--training.batch_size", "0"): r"training\.batch_size must be an integer >= 1, got 0",
        ("--training.adam_betas", "[0.9, 1]"): r"training\.adam_betas\[1\] must be a number in \[0, 1\), got 1\.0",
        ("--drafter.block_size", "65"): r"drafter\.block_size must be an integer in \[2, 64\], got 65",
        ("--data.regenerate.top_p", "0"): r"data\.regenerate\.top_p must be a number in \(0, 1\], got 0\.0",
        ("--drafter.decay_gamma", ".nan"): r"drafter\.decay_gamma must be a number > 0, got nan",
        ("--training.learning_rate", ".inf"): r"training\.learning_rate must be a number > 0, got inf",
    }.items():
        pattern = rf"{source} \(with command-line overrides\): {message}$"
        line = assert_user_error(capsys, pattern, dspark_main, [str(recipe), *override])
        assert line.count(" must be ") == 1, line
    adapt = tmp_path / "adapt.yaml"
    adapt.write_text("adapt:\n  head: h\n  traffic: t\n  confidence: 1\n")
    assert_user_error(capsys, r"adapt\.confidence must be a number in \[0\.5, 1\), got 1\.0$", adapt_main, [str(adapt)])
    # null where the type allows it, and a value on the bound, are inside
    recipe = load_recipe(Recipe, None, ["data.limit=null", "training.max_minutes=0.5", "data.held_out_fraction=0"])
    assert (recipe.data.limit, recipe.training.max_minutes, recipe.data.held_out_fraction) == (None, 0.5, 0.0)
    with pytest.raises(RecipeError, match=r"data\.limit must be an integer >= 1, got 0$"):
        load_recipe(Recipe, None, ["data.limit=0"])


def test_a_flag_that_sets_a_recipe_field_takes_that_fields_declared_range(capsys):
    """eval/run.py --adapt-lr and --adapt-rejected-weight set adapt.learning_rate and
    adapt.rejected_weight without reading a recipe, --temperature eval.temperature: out of the fields'
    ranges (NaN included) they are one line, exit 2; inside, they parse (negative control)."""
    from draftsmith.eval.run import parse_args

    base = ["--drafter", "eagle3:x", "--adapt", "4"]
    for flag, value, allowed in (
        ("--adapt-lr", "-1", "a number > 0"),
        ("--adapt-lr", "nan", "a number > 0"),
        ("--adapt-rejected-weight", "0.5", "a number >= 1"),
        ("--adapt-rejected-weight", "x", None),
    ):
        why = f"must be {allowed}, got {value}" if allowed else f"expected a number >= 1, got {value!r}"
        assert_user_error(
            capsys, rf"argument {flag}: {re.escape(why)} \(see --help\)$", parse_args, [*base, flag, value]
        )
    args = parse_args([*base, "--adapt-lr", "1e-4", "--adapt-rejected-weight", "4"])
    assert (args.adapt_lr, args.adapt_rejected_weight) == (1e-4, 4.0)
    # eval.temperature's flag: NaN is refused as a negative is (it reached the model and crashed there)
    for value in ("-1", "nan"):
        line = user_error(capsys, parse_args, ["--drafter", "prompt_lookup", "--temperature", value])
        assert line.endswith(f"error: --temperature must be >= 0, got {float(value)} (see --help)"), line
    assert parse_args(["--drafter", "prompt_lookup", "--temperature", "0.7"]).sampling.temperature == 0.7


def test_help_prints_each_numbers_range_beside_its_meaning(capsys):
    with pytest.raises(SystemExit):
        dspark_main(["--help"])
    text = capsys.readouterr().out
    for line in (
        "training.learning_rate = 3.0e-05  [float]  peak AdamW learning rate (a number > 0)",
        "training.adam_betas = [0.9, 0.95]  [list[float]]  AdamW (beta1, beta2) (each a number in [0, 1))",
        "data.limit = null  [int | null]  use only the first N valid conversations (an integer >= 1)",
        "drafter.block_size = 7  [int]",
        "drafter.decay_gamma = 4.0  [float]  DFlash's gamma (speculators' default) (a number > 0)",
    ):
        assert line in text, line
    assert re.search(r"drafter\.block_size = 7 .*\(an integer in \[2, 64\]\)$", text, re.M)
    assert "\n  tracking.project = draftsmith  [str]  W&B project\n" in text  # text has no range
    with pytest.raises(SystemExit):
        adapt_main(["--help"])
    assert re.search(
        r"adapt\.confidence = 0\.9  \[float\]  .*\(a number in \[0\.5, 1\)\)$", capsys.readouterr().out, re.M
    )
