"""Typed recipes: YAML parsed into dataclasses, validated once, with command-line overrides.

Each section is checked as it is built: its keys and their types, each number against the
:class:`Range` declared on its field (``Annotated[int, COUNT]``), then the section's own
``validate()`` for what spans several fields.

Every error names the file and the full key path (``training.learning_rate``) so a typo in a
recipe fails at start-up instead of hours into a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from draftsmith.errors import UserError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a number allows (a drafter spec's option, a recipe field): ``low`` / ``high``
    bounds (None: unbounded), each closed unless ``open_low`` / ``open_high``; ``integer`` for counts."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):  # NaN, and .inf on an unbounded side (a learning rate of inf trains to NaN)
            return False
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below

    def __str__(self) -> str:
        what = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            return (
                f"{what} in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
            )
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {self.low:g}"
        return f"{what} {'<' if self.open_high else '<='} {self.high:g}" if self.high is not None else what


# The ranges most fields take. A recipe field declares its range on itself, where it is defined:
# ``batch_size: Annotated[int, COUNT] = 1`` (``Annotated[int, COUNT] | None`` keeps null allowed; the
# range of a list field bounds each of its numbers). :func:`from_dict` checks it and ``--help`` prints it.
COUNT = Range(1, integer=True)
NON_NEGATIVE_INT = Range(0, integer=True)
POSITIVE = Range(0, open_low=True)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, open_high=True)  # a share that leaves some of the whole out


class RecipeError(UserError, ValueError):
    """A recipe (or an override) that does not match its schema."""


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with 1.2 booleans: only true/false are booleans, so ``mixed_precision: no`` (a
    string field) stays the string ``"no"``; bool fields still accept yes/no/on/off."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


def read_yaml(text: str):
    """Parse YAML text with 1.2 booleans (see :class:`_Yaml12Loader`)."""
    return yaml.load(text, Loader=_Yaml12Loader)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_describe(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping for section {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _convert(value, arg, where)
            except RecipeError as err:
                errors.append(str(err))
        raise RecipeError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise RecipeError(f"{where}: expected one of {_describe(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        (item,) = get_args(tp) or (Any,)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(k, key_tp, where): _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise RecipeError(f"{where}: expected null, got {value!r}")
        return None
    if tp is bool and isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-5" as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise RecipeError(f"{where}: expected {_describe(tp)}, got {type(value).__name__} {value!r}")
    return value


def _renamed(cls: type, data: dict, prefix: str) -> dict:
    """``data`` with the keys ``cls`` accepted under an older name (``cls.RENAMED``: old -> new path
    inside the section) moved to their new place; both spellings at once is an error."""
    renamed = getattr(cls, "RENAMED", None) or {}
    if not any(old in data for old in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        value = data.pop(old)
        node = data
        *parents, leaf = new.split(".")
        for parent in parents:
            node[parent] = node = dict(node.get(parent) or {})
        if leaf in node:
            raise RecipeError(f"{prefix}{old} is the old spelling of {prefix}{new}: give only {prefix}{new}")
        node[leaf] = value
    return data


def _build(cls: type[T], data: dict, where: str) -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    data = _renamed(cls, data, prefix)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; known: {sorted(fields)}"
            raise RecipeError(f"unknown key {prefix}{key}{hint}")
    kwargs = {k: _convert(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise RecipeError(f"missing required key(s): {', '.join(prefix + m for m in missing)}")
    obj = cls(**kwargs)
    check_ranges(obj, where)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as err:
            # a whole recipe's own check names its fields itself
            raise RecipeError(f"{where}: {err}" if where else str(err)) from None
    return obj


def _declared_range(tp: Any) -> Range | None:
    """The :class:`Range` annotated on a field type: ``Annotated[T, range]``, alone or in a union with None."""
    if get_origin(tp) is Annotated:
        return next((meta for meta in tp.__metadata__ if isinstance(meta, Range)), None)
    if get_origin(tp) in (Union, types.UnionType):
        return next(filter(None, (_declared_range(arg) for arg in get_args(tp))), None)
    return None


def field_ranges(cls: type) -> dict[str, Range]:
    """The declared range of each field of config dataclass ``cls`` that has one (inherited ones included)."""
    hints = get_type_hints(cls, include_extras=True)
    ranges = {f.name: _declared_range(hints[f.name]) for f in dataclasses.fields(cls)}
    return {name: allowed for name, allowed in ranges.items() if allowed is not None}


def ranged(allowed: Range) -> Callable[[str], float]:
    """An argparse ``type`` for a flag that sets a recipe field (``eval/run.py --adapt-lr``): a number
    in the field's declared range ``allowed`` (:func:`field_ranges`), so a flag takes what the field takes."""

    def parse(raw: str) -> float:
        try:
            value = int(raw) if allowed.integer else float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {raw!r}") from None
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {raw}")
        return value

    parse.__name__ = str(allowed)
    return parse


def check_ranges(obj: Any, where: str = "") -> None:
    """Refuse a field of config dataclass ``obj`` (the section at key path ``where``) whose value is
    outside its declared range, in one line naming the key, the range and the value (null, where the
    type allows it, is outside no range). Nested sections are not walked: each is checked as it is built."""
    prefix = f"{where}." if where else ""
    for name, allowed in field_ranges(type(obj)).items():
        value = getattr(obj, name)
        values = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, number in values:
            if number is not None and number not in allowed:
                key = f"{prefix}{name}" if index is None else f"{prefix}{name}[{index}]"
                raise RecipeError(f"{key} must be {allowed}, got {number!r}")


def from_dict(cls: type[T], data: dict, source: str = "<dict>") -> T:
    """Build dataclass ``cls`` from nested ``data``, rejecting unknown keys and wrong types."""
    try:
        return _build(cls, data or {}, "")
    except RecipeError as err:
        raise RecipeError(f"{source}: {err}") from None


def to_dict(obj: Any) -> dict:
    """The plain nested dict of a config dataclass (for logging and checkpoints)."""
    return dataclasses.asdict(obj)


def parse_overrides(args: list[str]) -> dict:
    """Turn ``--a.b 3``, ``--a.b=3`` or ``a.b=3`` into the nested dict ``{"a": {"b": 3}}``.

    Values are read as YAML, so ``1e-4``, ``true``, ``[1, 2]`` and ``null`` mean what they say.
    """
    nested: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            arg = arg[2:]
            if "=" not in arg:
                if i + 1 >= len(args):
                    raise RecipeError(f"override --{arg} has no value")
                arg = f"{arg}={args[i + 1]}"
                i += 1
        if "=" not in arg:
            raise RecipeError(f"override {arg!r} must look like key.path=value or --key.path value")
        key, raw = arg.split("=", 1)
        value = read_yaml(raw) if raw != "" else ""
        node = nested
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {key!r} conflicts with another override")
        node[parts[-1]] = value
        i += 1
    return nested


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_recipe_file(path: str | Path) -> dict:
    """The YAML recipe at ``path`` as a mapping of sections, or a one-line :class:`RecipeError`."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist")
    try:
        data = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: the top level must be a mapping of sections")
    return data


def load_recipe(
    cls: type[T],
    path: str | Path | None,
    overrides: list[str] | dict | None = None,
    aliases: dict[str, str] | None = None,
) -> T:
    """Read the YAML recipe at ``path`` into ``cls``, applying command-line ``overrides``.

    ``aliases`` maps short override names to key paths (``output_dir`` -> ``training.output_dir``).
    """
    data = read_recipe_file(path) if path else {}
    source = str(path) if path else "<defaults>"
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        for short, full in (aliases or {}).items():
            if short in extra:
                value = extra.pop(short)
                node = extra
                *parents, leaf = full.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = value
        data = merge(data, extra)
        source += " (with command-line overrides)"
    return from_dict(cls, data, source)


def dump_recipe(obj: Any, path: str | Path) -> None:
    """Write a config dataclass back to YAML (saved next to checkpoints for reproducibility)."""
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


__all__ = [
    "Range",
    "RecipeError",
    "check_ranges",
    "field_ranges",
    "ranged",
    "from_dict",
    "to_dict",
    "parse_overrides",
    "merge",
    "load_recipe",
    "dump_recipe",
]


def field_docs(cls: type) -> dict[str, str]:
    """One-line docs of a config dataclass's fields, inherited ones included, from the class body
    (the schema is documented once, where it is defined): each field line's trailing ``# comment``,
    else the block of ``#`` lines right above it (a blank line or code ends the block)."""
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines:
            if comment := re.match(r"\s+#\s?(.*)$", line):
                above.append(comment.group(1).strip())
                continue
            if match := re.match(r"\s+(\w+)\s*:[^#]*?(?:#\s*(.+))?$", line.rstrip("\n")):
                doc = (match.group(2) or " ".join(above)).strip()
                if doc:
                    docs[match.group(1)] = doc
            above = []
    return docs


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return ""
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value or "''"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def schema_help(cls: type, prefix: str = "") -> str:
    """Every field of config dataclass ``cls`` as ``section.field = default  [type]  doc (range)`` lines."""
    hints = get_type_hints(cls)
    docs, ranges = field_docs(cls), field_ranges(cls)
    lines = []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            title = (tp.__doc__ or "").strip().splitlines()[0] if tp.__doc__ else ""
            lines.append(f"\n{key}:  {title}")
            lines.append(schema_help(tp, f"{key}."))
            continue
        each = "each " if list in {get_origin(t) for t in (tp, *get_args(tp))} else ""  # a list, or a list | None
        allowed = f" ({each}{ranges[f.name]})" if f.name in ranges else ""
        lines.append(f"  {key} = {_default_text(f)}  [{_describe(tp)}]  {docs.get(f.name, '')}{allowed}".rstrip())
    return "\n".join(lines)
