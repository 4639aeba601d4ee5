"""Drafter specs: parsing ``--drafter`` strings and building drafters through the kind registry.

A spec is ``KIND[:PATH][?key=value&key=value]``, e.g. ``prompt_lookup``,
``prompt_lookup?num_tokens=4&branches=3``, ``draft_lm:HuggingFaceTB/SmolLM2-135M-Instruct?depth=5``,
``draft_lm?layers=4`` (a draft cut from the target: 4 evenly spaced layers, or ``layers=0,1,2,29``),
``oracle?num_tokens=8``, ``eagle:runs/x/checkpoint-final?depth=5&top_k=3&budget=12``,
``eagle3:runs/y/checkpoint-final``. ``name=`` sets the label used in tables. Every kind also takes the engine's
draft-length policy options (:data:`POLICY_OPTIONS`, e.g. ``draft_lm:PATH?depth=8&policy=entropy``).
Each kind's options and builder are its declaration's (:mod:`draftsmith.kinds`, registered by
:mod:`draftsmith.plugins`); :func:`kinds_help` documents them all (``eval/run.py --help`` prints it).
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from transformers import PreTrainedModel

from draftsmith.config import POSITIVE, Range
from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.policies import DEFAULT_CONFIDENCE, DEFAULT_ENTROPY_TAU, POLICIES, PolicyConfig
from draftsmith.heads.common import read_config
from draftsmith.kinds import Option, registered

# Options every kind takes: how the engine drafts and verifies with it (draftsmith.eval.engine.policies).
POLICY_OPTIONS: dict[str, Option] = {
    "policy": Option("fixed", f"draft-length policy: {', '.join(POLICIES)}, or entropy,confidence (both)"),
    "entropy_tau": Option(
        DEFAULT_ENTROPY_TAU,
        "entropy policy: initial threshold in nats (then the mean entropy of rejected drafts)",
        POSITIVE,
    ),
    "confidence": Option(
        DEFAULT_CONFIDENCE,
        "confidence policy: draft only while the target's probability of its own token is >= this",
        Range(0, 1, open_low=True, open_high=True),
    ),
    "lenience": Option(
        1.0,
        "LOSSY below 1 (sampling only): accept with min(1, p/(lenience q)) (Leviathan et al.)",
        Range(0, 1, open_low=True),
    ),
}


def kinds_help() -> str:
    """The drafter kinds and their options with defaults and allowed values, as ``--help`` text."""
    lines = ["drafter specs: KIND[:PATH][?key=value&...]; every kind also takes name=LABEL (the table row) and:"]
    lines += [option.help(name) for name, option in POLICY_OPTIONS.items()]
    for name, kind in registered().items():
        path = f":PATH ({kind.path})" if kind.path else ""
        lines.append(f"  {name}{path}\n      {kind.summary}")
        lines += [option.help(key) for key, option in kind.options.items()]
    return "\n".join(lines)


def _check_ranges(spec: str, table: dict[str, Option], raw: dict[str, str], options: dict) -> None:
    """Every numeric option within its table range, or a one-line error naming it, its value and the range."""
    for key, value in options.items():
        option = table.get(key)
        if option is None or option.range is None or (option.text and isinstance(value, str)):
            continue
        if value not in option.range:
            raise UsageError(
                f"--drafter {spec!r}: {key}={raw[key]} is not allowed: {key} must be {option.range} "
                "(eval/run.py --help lists every option's range)"
            )


def _check_depth(spec: str, depth, most: int, path: str) -> None:
    """A ``depth`` the checkpoint can draft, or a one-line error with the range it allows."""
    if isinstance(depth, int) and depth > most:
        raise UsageError(
            f"--drafter {spec!r}: depth={depth} is not allowed: {path} drafts at most {most} tokens per step, "
            f"so depth must be {Range(1, most, integer=True)}"
        )


def _value(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _top_level(text: str, sep: str) -> list[int]:
    """Positions of ``sep`` in ``text`` outside parentheses (a hybrid's parts carry their own ``?``
    and ``+``); unbalanced parentheses are a one-line error."""
    found, depth = [], 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise UsageError(f"drafter spec {text!r}: a ')' closes nothing")
        if char == sep and depth == 0:
            found.append(i)
    if depth:
        raise UsageError(f"drafter spec {text!r}: a '(' is not closed")
    return found


def _partition_top(spec: str, sep: str) -> tuple[str, str, str]:
    """``str.partition`` at the first ``sep`` outside parentheses."""
    at = _top_level(spec, sep)
    return (spec[: at[0]], sep, spec[at[0] + 1 :]) if at else (spec, "", "")


def split_parts(text: str) -> list[str]:
    """``A+B+...`` split at the top level; a part in parentheses may hold ``+`` and ``?`` (its options)."""
    cuts = [-1, *_top_level(text, "+"), len(text)]
    parts = [text[a + 1 : b].strip() for a, b in zip(cuts, cuts[1:])]
    parts = [p[1:-1] if p.startswith("(") and p.endswith(")") else p for p in parts]
    if len(parts) < 2 or not all(parts):
        raise UsageError(f"hybrid spec {text!r}: give two or more drafter specs joined by '+', e.g. eagle3:PATH+suffix")
    return parts


def _default_name(kind: str, path: str) -> str:
    """``kind``, or ``kind:model`` for a path: its last part, or the run folder of a checkpoint; a
    hybrid's parts (``A+B``) each named so."""
    if not path:
        return kind
    if "+" in path:
        bodies = (_partition_top(part, "?")[0].partition(":") for part in split_parts(path))
        return f"{kind}:" + "+".join(_default_name(name, sub) for name, _, sub in bodies)
    parts = [p for p in path.rstrip("/").split("/") if p]
    if len(parts) > 1 and parts[-1].startswith("checkpoint"):
        return f"{kind}:{parts[-2]}"
    return f"{kind}:{parts[-1]}"


def parse_spec(spec: str) -> DrafterSpec:
    """Parse a drafter spec string (see the module docstring); every value the kind cannot honour,
    its checkpoint's limits included, is refused here, before any model loads."""
    body, _, query = _partition_top(spec, "?")
    name, _, path = body.partition(":")
    kinds = registered()
    if name not in kinds:
        raise UsageError(f"--drafter {spec!r}: unknown drafter kind {name!r}; choose from {', '.join(kinds)}")
    kind = kinds[name]
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise UsageError(f"--drafter {spec!r}: options must look like ?key=value&key=value") from None
    options = {key: _value(val) for key, val in pairs}
    unknown = sorted(set(options) - set(kind.options) - set(POLICY_OPTIONS) - {"name"})
    if unknown:
        raise UsageError(
            f"--drafter {spec!r}: unknown option(s) {', '.join(unknown)} for {name}; "
            f"its options: {', '.join([*kind.options, *POLICY_OPTIONS, 'name'])}"
        )
    _check_ranges(spec, {**kind.options, **POLICY_OPTIONS}, dict(pairs), options)
    policy = PolicyConfig.from_options(spec, options)
    if policy.entropy_tau and kind.entropy_note:
        raise UsageError(f"--drafter {spec!r}: {kind.entropy_note}")
    if policy.entropy_tau and not kind.has_distribution:
        raise UsageError(
            f"--drafter {spec!r}: policy=entropy needs a drafter that drafts from a distribution "
            f"({', '.join(k for k, v in kinds.items() if v.has_distribution)}); {name} has none"
        )
    label = str(options.pop("name", _default_name(name, path) + policy.label()))
    if policy.lossy and "lossy" not in label:  # a lossy row is never mistaken for a lossless one
        label += "(lossy)"
    if kind.path.endswith("(required)"):
        if not path:
            raise UsageError(f"--drafter {spec!r}: the {name} drafter needs a checkpoint: {name}:PATH")
        config = read_config(path, name)  # a wrong or missing folder fails here, before any model loads
        if kind.max_depth is not None:
            _check_depth(spec, options.get("depth"), kind.max_depth(config), path)
    if kind.path == "" and path:
        raise UsageError(f"--drafter {spec!r}: the {name} drafter takes no path")
    return DrafterSpec(name, path or None, options, label, policy)


def build_drafter(spec: str | DrafterSpec, target: PreTrainedModel) -> Drafter:
    """A drafter for ``target`` from a spec string (or a parsed spec), built by its kind's declaration."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    kinds = registered()
    if parsed.kind not in kinds:
        raise UsageError(f"drafter kind {parsed.kind!r} is not registered; choose from {', '.join(kinds)}")
    try:
        drafter = kinds[parsed.kind].build(parsed, target)
    except TypeError as err:  # an option value of the wrong type reaching a constructor
        raise UsageError(f"bad option for drafter {parsed.kind!r}: {err}") from None
    drafter.name = parsed.name
    drafter.policy = parsed.policy
    return drafter


__all__ = [
    "Drafter",
    "DraftContext",
    "StepResult",
    "DrafterSpec",
    "POLICY_OPTIONS",
    "kinds_help",
    "parse_spec",
    "build_drafter",
    "split_parts",
]
