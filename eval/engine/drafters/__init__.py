"""Drafters for the shared decoding engine, and the registry that builds them from CLI specs.

A spec is ``KIND[:PATH][?key=value&key=value]``, e.g. ``prompt_lookup``,
``prompt_lookup?num_tokens=4&branches=3``, ``draft_lm:HuggingFaceTB/SmolLM2-135M-Instruct?depth=5``,
``draft_lm?layers=4`` (a draft cut from the target: 4 evenly spaced layers, or ``layers=0,1,2,29``),
``oracle?num_tokens=8``, ``eagle:runs/x/checkpoint-final?depth=5&top_k=3&budget=12``,
``eagle3:runs/y/checkpoint-final``. ``name=`` sets the label used in tables. Every kind also takes the engine's
draft-length policy options (:data:`POLICY_OPTIONS`, e.g. ``draft_lm:PATH?depth=8&policy=entropy``).
:data:`KINDS` documents every kind and option (``eval/run.py --help`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

from transformers import PreTrainedModel

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.engine.drafters.dflash import DFlashDrafter
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.eagle import EagleDrafter
from draftsmith.eval.engine.drafters.hierarchical import HierarchicalDrafter
from draftsmith.eval.engine.drafters.medusa import MedusaDrafter
from draftsmith.eval.engine.drafters.oracle import OracleDrafter
from draftsmith.eval.engine.drafters.peagle import PEagleDrafter
from draftsmith.eval.engine.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.engine.medusa_trees import load_choices, optimal_choices
from draftsmith.eval.engine.policies import DEFAULT_CONFIDENCE, DEFAULT_ENTROPY_TAU, POLICIES, PolicyConfig
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree_plan import plan_head_tree
from draftsmith.heads.common import read_config
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.draft_lm import derive_draft_lm, draft_vocab_from_counts, load_draft_lm
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import DEFAULT_TREE_SIZE, MedusaHeads, rank_accuracy
from draftsmith.heads.peagle import PEagleHead
from draftsmith.target import attach_adapter


@dataclass(frozen=True)
class Range:
    """The values a numeric option allows: ``low`` / ``high`` bounds (None: unbounded), each closed
    unless ``open_low`` / ``open_high``; ``integer`` for counts."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        # Written so that NaN is outside every range.
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


COUNT = Range(1, integer=True)
POSITIVE = Range(0, open_low=True)


@dataclass(frozen=True)
class Option:
    """One ``?key=value`` option of a drafter spec: its default, its meaning and, for a number, the
    values allowed (checked when the spec is parsed, before any model loads)."""

    default: object
    doc: str
    range: Range | None = None  # None: free text (a path, a file, a name)
    text: bool = False  # a numeric option that also takes text (layers=0,1,2,29), checked where it is used

    def help(self, name: str) -> str:
        """The option's ``--help`` line: ``name=default``, its meaning and its range."""
        allowed = f" ({self.range})" if self.range else ""
        return f"      {name}={'' if self.default is None else self.default}".ljust(26) + f" {self.doc}{allowed}"


@dataclass(frozen=True)
class KindHelp:
    """What a drafter kind is, what its ``:PATH`` is, and its ``?options``."""

    summary: str
    path: str  # "" when the kind takes no path
    options: dict[str, Option]
    has_distribution: bool = False  # drafts from a distribution (policy=entropy applies)


AUTO = "auto"
# The trees of heads that record no held-out accuracy (trained without held-out data) under depth=auto.
PLAN_FALLBACK = {"eagle": {"depth": 5, "top_k": 3, "budget": 12}, "eagle3": {"depth": 6, "top_k": 3, "budget": 12}}


def _tree_options(fallback: dict[str, int]) -> dict[str, Option]:
    """An EAGLE head's tree options: each a count, or ``auto`` (planned, :mod:`draftsmith.eval.engine.tree_plan`)."""
    unplanned = f"depth {fallback['depth']}, top_k {fallback['top_k']}, budget {fallback['budget']}"
    return {
        "depth": Option(
            AUTO,
            "tree depth (draft steps per verification): a count, or auto: planned from the head's "
            "held-out accuracy per depth and this device's measured pass costs (a head recording none: "
            f"{unplanned})",
            COUNT,
            text=True,
        ),
        "top_k": Option(AUTO, "children expanded per node: a count, or auto (planned)", COUNT, text=True),
        "budget": Option(AUTO, "tree nodes verified per step: a count, or auto (planned)", COUNT, text=True),
    }


KINDS: dict[str, KindHelp] = {
    "prompt_lookup": KindHelp(
        "n-gram lookup in the prompt and the output so far (training-free)",
        "",
        {
            "num_tokens": Option(10, "tokens drafted per step", COUNT),
            "max_ngram": Option(3, "longest suffix n-gram looked up", COUNT),
            "min_ngram": Option(2, "shortest suffix n-gram looked up", COUNT),
            "branches": Option(1, "distinct continuations drafted as a tree (1: a chain)", COUNT),
        },
    ),
    "oracle": KindHelp(
        "the target's own greedy continuation: the engine's ceiling (diagnostic)",
        "",
        {
            "num_tokens": Option(8, "tokens drafted per step", COUNT),
        },
    ),
    "draft_lm": KindHelp(
        "any causal LM with the target's tokenizer; without PATH, layers cut from the target",
        "hub id or folder (e.g. a train/distill.py checkpoint); optional",
        {
            "depth": Option(4, "draft tokens per step (tree depth)", COUNT),
            "top_k": Option(1, "children per node (1: a chain; more: an EAGLE-2-style dynamic tree)", COUNT),
            "budget": Option(None, "tree nodes kept (default: depth x top_k)", COUNT),
            "layers": Option(
                4, "without PATH: a count of evenly spaced target layers, or indices like 0,1,2,29", COUNT, text=True
            ),
            "vocab": Option(
                None, "draft over the N most frequent tokens of a distill checkpoint's training replies", COUNT
            ),
        },
        has_distribution=True,
    ),
    "eagle": KindHelp(
        "a trained EAGLE head growing EAGLE-2 dynamic trees",
        "checkpoint or sglang export folder (required)",
        _tree_options(PLAN_FALLBACK["eagle"]),
        has_distribution=True,
    ),
    "eagle3": KindHelp(
        "a trained EAGLE-3 head (fused target layers, training-time test) growing EAGLE-2 dynamic trees",
        "checkpoint, speculators or sglang export folder (required)",
        _tree_options(PLAN_FALLBACK["eagle3"]),
        has_distribution=True,
    ),
    "peagle": KindHelp(
        "a trained P-EAGLE head drafting a chain of depth tokens in one forward pass (parallel drafting)",
        "checkpoint or speculators export folder (required)",
        {
            "depth": Option(
                None,
                "tokens drafted per step, in one pass (default and most: the depths the head was trained for)",
                COUNT,
            ),
        },
        has_distribution=True,
    ),
    "dflash": KindHelp(
        "a trained DFlash drafter: Qwen3 layers over [last token, MASK...] with the target's "
        "features injected as context, drafting the block in one forward pass",
        "checkpoint or speculators export folder (required)",
        {
            "depth": Option(None, "tokens drafted per step, in one pass (default and most: the block size - 1)", COUNT),
        },
        has_distribution=True,
    ),
    "hierarchical": KindHelp(
        "HSDDW hierarchical drafting: draft LM M1 drafts under its entropy rule, a stronger draft LM M2 "
        "pre-verifies its tokens, the target verifies what M2 kept",
        "",
        {
            "m1": Option(
                None,
                "M1: hub id or folder of a draft LM (e.g. a train/distill.py checkpoint); default: cut from the target",
            ),
            "m2": Option(None, "M2: as m1, the stronger one"),
            "vocab": Option(
                None, "with m1=/m2= distill checkpoints: each drafts over its N most frequent training tokens", COUNT
            ),
            # Untrained cuts of SmolLM2 (30 layers) are accepted only from ~26 layers up: a 6-layer M2
            # never was (acceptance length 1.00), a 28-layer one makes the default draft above 1.0.
            "m1_layers": Option(
                6, "without m1: M1 is this many evenly spaced target layers, or indices like 0,1,2,29", COUNT, text=True
            ),
            "m2_layers": Option(
                28,
                "without m2: M2 is this many evenly spaced target layers, or indices like 0,1,2,29",
                COUNT,
                text=True,
            ),
            "depth": Option(8, "most tokens sent to the target per step", COUNT),
            "m1_depth": Option(4, "most tokens M1 drafts before M2 pre-verifies them", COUNT),
            "m1_tau": Option(
                DEFAULT_ENTROPY_TAU,
                "M1's initial entropy threshold (nats; then the mean M1 entropy of M2's rejections and M1's declines)",
                POSITIVE,
            ),
            "m2_tau": Option(
                DEFAULT_ENTROPY_TAU,
                "M2's initial entropy threshold (nats; then the mean M2 entropy of the target's "
                "rejections and M2's declines)",
                POSITIVE,
            ),
        },
    ),
    "medusa": KindHelp(
        "trained Medusa heads over a static tree",
        "checkpoint, vllm-medusa or medusa export folder (required)",
        {
            "choices": Option(
                None, "tree file (Medusa-style [[0], [0, 0], [1], ...]); default: the calibrated tree.yaml"
            ),
            "budget": Option(None, "use the optimal N-node tree for the heads' recorded accuracies instead", COUNT),
        },
    ),
}


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
    for kind, info in KINDS.items():
        path = f":PATH ({info.path})" if info.path else ""
        lines.append(f"  {kind}{path}\n      {info.summary}")
        lines += [option.help(name) for name, option in info.options.items()]
    return "\n".join(lines)


def _check_ranges(spec: str, kind: str, raw: dict[str, str], options: dict) -> None:
    """Every numeric option within its table range, or a one-line error naming it, its value and the range."""
    table = {**KINDS[kind].options, **POLICY_OPTIONS}
    for key, value in options.items():
        option = table.get(key)
        if option is None or option.range is None or (option.text and isinstance(value, str)):
            continue
        if value not in option.range:
            raise UsageError(
                f"--drafter {spec!r}: {key}={raw[key]} is not allowed: {key} must be {option.range} "
                "(eval/run.py --help lists every option's range)"
            )


@dataclass
class DrafterSpec:
    """A parsed ``KIND[:PATH][?options]`` string."""

    kind: str
    path: str | None = None
    options: dict = field(default_factory=dict)
    name: str = ""
    policy: PolicyConfig = PolicyConfig()


def _value(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _default_name(kind: str, path: str) -> str:
    """``kind``, or ``kind:model`` for a path: its last part, or the run folder of a checkpoint."""
    if not path:
        return kind
    parts = [p for p in path.rstrip("/").split("/") if p]
    if len(parts) > 1 and parts[-1].startswith("checkpoint"):
        return f"{kind}:{parts[-2]}"
    return f"{kind}:{parts[-1]}"


def parse_spec(spec: str) -> DrafterSpec:
    """Parse a drafter spec string (see the module docstring)."""
    body, _, query = spec.partition("?")
    kind, _, path = body.partition(":")
    if kind not in KINDS:
        raise UsageError(f"--drafter {spec!r}: unknown drafter kind {kind!r}; choose from {', '.join(KINDS)}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise UsageError(f"--drafter {spec!r}: options must look like ?key=value&key=value") from None
    options = {key: _value(val) for key, val in pairs}
    unknown = sorted(set(options) - set(KINDS[kind].options) - set(POLICY_OPTIONS) - {"name"})
    if unknown:
        raise UsageError(
            f"--drafter {spec!r}: unknown option(s) {', '.join(unknown)} for {kind}; "
            f"its options: {', '.join([*KINDS[kind].options, *POLICY_OPTIONS, 'name'])}"
        )
    _check_ranges(spec, kind, dict(pairs), options)
    policy = PolicyConfig.from_options(spec, options)
    if policy.entropy_tau and kind == "hierarchical":
        raise UsageError(
            f"--drafter {spec!r}: the hierarchical drafter has its own entropy rules; set m1_tau= and m2_tau="
        )
    if policy.entropy_tau and not KINDS[kind].has_distribution:
        raise UsageError(
            f"--drafter {spec!r}: policy=entropy needs a drafter that drafts from a distribution "
            f"({', '.join(k for k, v in KINDS.items() if v.has_distribution)}); {kind} has none"
        )
    name = str(options.pop("name", _default_name(kind, path) + policy.label()))
    if policy.lossy and "lossy" not in name:  # a lossy row is never mistaken for a lossless one
        name += "(lossy)"
    if KINDS[kind].path.endswith("(required)"):
        if not path:
            raise UsageError(f"--drafter {spec!r}: the {kind} drafter needs a checkpoint: {kind}:PATH")
        read_config(path, kind)  # a wrong or missing folder fails here, before any model loads
    if KINDS[kind].path == "" and path:
        raise UsageError(f"--drafter {spec!r}: the {kind} drafter takes no path")
    return DrafterSpec(kind, path or None, options, name, policy)


def build_drafter(spec: str | DrafterSpec, target: PreTrainedModel) -> Drafter:
    """A drafter for ``target`` from a spec string."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    options = dict(parsed.options)
    try:
        if parsed.kind == "prompt_lookup":
            drafter = PromptLookupDrafter(**options)
        elif parsed.kind == "oracle":
            drafter = OracleDrafter(CausalLMRunner(target), **options)
        elif parsed.kind == "draft_lm":
            layers = options.pop("layers", 4)
            vocab = options.pop("vocab", None)
            if vocab is not None and not parsed.path:
                raise UsageError("draft_lm option vocab=N needs a trained draft LM (draft_lm:PATH) with token counts")
            if parsed.path:
                param = next(target.parameters())
                model = load_draft_lm(parsed.path, param.dtype, param.device)
                if vocab is not None:
                    options["draft_vocab"] = draft_vocab_from_counts(parsed.path, int(vocab), model)
            else:
                model = _cut_from_target(target, layers, "draft_lm option layers")
            drafter = DraftLMDrafter(model, **options)
        elif parsed.kind == "hierarchical":
            param = next(target.parameters())
            vocab = options.pop("vocab", None)
            models = []
            for m in ("m1", "m2"):  # a trained draft LM, or layers cut from the target
                path = options.pop(m, None)
                layers = options.pop(f"{m}_layers", KINDS["hierarchical"].options[f"{m}_layers"].default)
                if path is None and vocab is not None:
                    raise UsageError(
                        f"hierarchical option vocab=N needs trained draft LMs (m1=PATH&m2=PATH); {m} has none"
                    )
                models.append(
                    load_draft_lm(str(path), param.dtype, param.device)
                    if path is not None
                    else _cut_from_target(target, layers, f"hierarchical option {m}_layers")
                )
                if vocab is not None:
                    options[f"{m}_vocab"] = draft_vocab_from_counts(str(path), int(vocab), models[-1])
            drafter = HierarchicalDrafter(*models, **options)
        elif parsed.kind == "eagle":
            head = EagleHead.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = _eagle_drafter(parsed, options, target, head)
        elif parsed.kind == "eagle3":
            head = Eagle3Head.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = _eagle_drafter(parsed, options, target, head)
        elif parsed.kind == "peagle":
            head = PEagleHead.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = PEagleDrafter(head, **options)
        elif parsed.kind == "dflash":
            head = DFlashHead.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = DFlashDrafter(head, **options)
        elif parsed.kind == "medusa":
            heads, choices, verifier = _medusa_parts(
                parsed.path, target, options.pop("choices", None), options.pop("budget", None)
            )
            drafter = MedusaDrafter(heads, choices, verifier=verifier, **options)
            if verifier is not None:
                drafter.verifier_label = (
                    f"target + LoRA adapter {parsed.path}/adapter (unmerged, on for this drafter only)"
                )
        else:
            raise ValueError(f"drafter kind {parsed.kind!r} has no engine adapter")
    except TypeError as err:  # an option value of the wrong type reaching a constructor
        raise UsageError(f"bad option for drafter {parsed.kind!r}: {err}") from None
    drafter.name = parsed.name
    drafter.policy = parsed.policy
    return drafter


def _eagle_drafter(parsed: DrafterSpec, options: dict, target: PreTrainedModel, head) -> Drafter:
    """An EAGLE drafter whose ``auto`` tree options (the default) come from the tree planned for
    ``head`` on ``target``'s device (:func:`~draftsmith.eval.engine.tree_plan.plan_head_tree`); counts given
    in the spec win over the plan."""
    tree = {key: options.pop(key, AUTO) for key in ("depth", "top_k", "budget")}
    for key, value in tree.items():
        if isinstance(value, str) and value != AUTO:
            raise UsageError(
                f"--drafter {parsed.kind}:{parsed.path}: {key}={value} is not allowed: give a count or auto"
            )
    label = ""
    if AUTO in tree.values():
        plan = plan_head_tree(target, head)
        if plan is None:
            planned = PLAN_FALLBACK[parsed.kind]
            label = (
                f"{parsed.path} records no held-out accuracy per draft depth (trained without held-out data): "
                f"unplanned tree depth {planned['depth']}, top_k {planned['top_k']}, budget {planned['budget']}"
            )
        else:
            planned = {"depth": plan.depth, "top_k": plan.top_k, "budget": plan.budget}
            label = plan.describe()
        given = {key: value for key, value in tree.items() if value != AUTO}
        tree = {key: given.get(key, planned[key]) for key in tree}
        if "budget" not in given:  # a depth given deeper than the plan's still gets a node per level
            tree["budget"] = max(tree["budget"], tree["depth"])
        print(f"{parsed.name}: {label}" + (f" (given: {given})" if given else ""))
    drafter = EagleDrafter(head, **tree, **options)
    drafter.tree_label = label
    return drafter


def _cut_from_target(target: PreTrainedModel, layers, field: str) -> PreTrainedModel:
    """A draft LM of the target's own layers: ``layers`` is a count (evenly spaced, first and last
    kept) or comma-separated indices (``0,1,8,29``), as a spec's option gives it."""
    if isinstance(layers, int):
        return derive_draft_lm(target, num_layers=layers)
    try:
        indices = [int(i) for i in str(layers).split(",")]
    except ValueError:
        raise UsageError(
            f"{field}={layers!r}: give a count or comma-separated layer indices, e.g. 4 or 0,1,2,29"
        ) from None
    return derive_draft_lm(target, layers=indices)


def _medusa_parts(path: str, target: PreTrainedModel, choices, budget):
    """Heads, tree and (for Medusa-2 checkpoints) the target with its LoRA adapter to verify with.

    The tree is ``choices`` (a file or a literal), else the optimal ``budget``-node tree for the
    heads' recorded held-out accuracies, else the checkpoint's calibrated ``tree.yaml``, else the
    optimal tree of Medusa's default size (63 nodes).
    """
    heads = MedusaHeads.from_pretrained(path, target).to(next(target.parameters()).dtype)
    adapter = Path(path) / "adapter"
    verifier = attach_adapter(target, adapter) if adapter.is_dir() else None
    if verifier is not None:
        heads.bind(verifier)
    if choices is not None:
        return heads, load_choices(str(choices)), verifier
    calibrated = Path(path) / "tree.yaml"
    if budget is None and calibrated.is_file():
        return heads, load_choices(str(calibrated)), verifier
    if not heads.head_accuracy:
        raise CheckpointError(f"{path} records no head accuracies: pass choices=FILE or run eval/calibrate_tree.py")
    return heads, optimal_choices(rank_accuracy(heads.head_accuracy), int(budget or DEFAULT_TREE_SIZE)), verifier


__all__ = [
    "Drafter",
    "DraftContext",
    "StepResult",
    "PromptLookupDrafter",
    "OracleDrafter",
    "DraftLMDrafter",
    "DrafterSpec",
    "KINDS",
    "POLICY_OPTIONS",
    "Option",
    "Range",
    "kinds_help",
    "parse_spec",
    "build_drafter",
]
