"""Drafters for the shared decoding engine, and the registry that builds them from CLI specs.

A spec is ``KIND[:PATH][?key=value&key=value]``, e.g. ``prompt_lookup``,
``prompt_lookup?num_tokens=4&branches=3``, ``draft_lm:HuggingFaceTB/SmolLM2-135M-Instruct?depth=5``,
``draft_lm?layers=4`` (a draft cut from the target: 4 evenly spaced layers, or ``layers=0,1,2,29``), ``oracle?num_tokens=8``,
``eagle:runs/x/checkpoint-final?depth=5&top_k=3&budget=12``, ``eagle3:runs/y/checkpoint-final``. ``name=`` sets the
label used in tables. Every kind also takes the engine's draft-length policy options (:data:`POLICY_OPTIONS`,
e.g. ``draft_lm:PATH?depth=8&policy=entropy``). :data:`KINDS` documents every kind and option
(``eval/run.py --help`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from transformers import PreTrainedModel

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.drafters.oracle import OracleDrafter
from draftsmith.eval.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.policies import DEFAULT_CONFIDENCE, DEFAULT_ENTROPY_TAU, POLICIES, PolicyConfig
from draftsmith.eval.runner import CausalLMRunner
from draftsmith.heads.common import read_config


@dataclass(frozen=True)
class KindHelp:
    """What a drafter kind is, what its ``:PATH`` is, and its ``?options`` as ``name: (default, doc)``."""

    summary: str
    path: str  # "" when the kind takes no path
    options: dict[str, tuple[object, str]]
    has_distribution: bool = False  # drafts from a distribution (policy=entropy applies)


KINDS: dict[str, KindHelp] = {
    "prompt_lookup": KindHelp("n-gram lookup in the prompt and the output so far (training-free)", "", {
        "num_tokens": (10, "tokens drafted per step"),
        "max_ngram": (3, "longest suffix n-gram looked up"),
        "min_ngram": (2, "shortest suffix n-gram looked up"),
        "branches": (1, "distinct continuations drafted as a tree (1: a chain)"),
    }),
    "oracle": KindHelp("the target's own greedy continuation: the engine's ceiling (diagnostic)", "", {
        "num_tokens": (8, "tokens drafted per step"),
    }),
    "draft_lm": KindHelp("any causal LM with the target's tokenizer; without PATH, layers cut from the target",
                         "hub id or folder (e.g. a train/distill.py checkpoint); optional", {
        "depth": (4, "draft tokens per step (tree depth)"),
        "top_k": (1, "children per node (1: a chain; more: an EAGLE-2-style dynamic tree)"),
        "budget": (None, "tree nodes kept (default: depth x top_k)"),
        "layers": (4, "without PATH: a count of evenly spaced target layers, or indices like 0,1,2,29"),
        "vocab": (None, "draft over the N most frequent tokens of a distill checkpoint's training replies"),
    }, has_distribution=True),
    "eagle": KindHelp("a trained EAGLE head growing EAGLE-2 dynamic trees", "checkpoint or sglang export folder (required)", {
        "depth": (5, "tree depth (draft steps per verification)"),
        "top_k": (3, "children expanded per node"),
        "budget": (12, "tree nodes verified per step"),
    }, has_distribution=True),
    "eagle3": KindHelp("a trained EAGLE-3 head (fused target layers, training-time test) growing EAGLE-2 dynamic trees",
                       "checkpoint, speculators or sglang export folder (required)", {
        "depth": (6, "tree depth (draft steps per verification)"),
        "top_k": (3, "children expanded per node"),
        "budget": (12, "tree nodes verified per step"),
    }, has_distribution=True),
    "hierarchical": KindHelp(
        "HSDDW hierarchical drafting: draft LM M1 drafts under its entropy rule, a stronger draft LM M2 "
        "pre-verifies its tokens, the target verifies what M2 kept", "", {
            "m1": (None, "M1: hub id or folder of a draft LM (e.g. a train/distill.py checkpoint); default: cut from the target"),
            "m2": (None, "M2: as m1, the stronger one"),
            "vocab": (None, "with m1=/m2= distill checkpoints: each drafts over its N most frequent training tokens"),
            "m1_layers": (2, "without m1: M1 is this many evenly spaced target layers"),
            "m2_layers": (6, "without m2: M2 is this many evenly spaced target layers"),
            "depth": (8, "most tokens sent to the target per step"),
            "m1_depth": (4, "most tokens M1 drafts before M2 pre-verifies them"),
            "m1_tau": (DEFAULT_ENTROPY_TAU, "M1's initial entropy threshold (nats; then adapts to M2's rejections)"),
            "m2_tau": (DEFAULT_ENTROPY_TAU, "M2's initial entropy threshold (nats; then adapts to the target's rejections)"),
        }),
    "medusa": KindHelp("trained Medusa heads over a static tree", "checkpoint, vllm-medusa or medusa export folder (required)", {
        "choices": (None, "tree file (Medusa-style [[0], [0, 0], [1], ...]); default: the calibrated tree.yaml"),
        "budget": (None, "use the optimal N-node tree for the heads' recorded accuracies instead"),
    }),
}


# Options every kind takes: how the engine drafts and verifies with it (draftsmith.eval.policies).
POLICY_OPTIONS: dict[str, tuple[object, str]] = {
    "policy": ("fixed", f"draft-length policy: {', '.join(POLICIES)}, or entropy,confidence (both)"),
    "entropy_tau": (DEFAULT_ENTROPY_TAU, "entropy policy: initial threshold in nats (then the mean entropy of rejected drafts)"),
    "confidence": (DEFAULT_CONFIDENCE, "confidence policy: draft only while the target's probability of its own token is >= this"),
    "lenience": (1.0, "LOSSY below 1 (sampling only): accept with min(1, p/(lenience q)) (Leviathan et al.)"),
}


def kinds_help() -> str:
    """The drafter kinds and their options with defaults, as ``--help`` text."""
    lines = ["drafter specs: KIND[:PATH][?key=value&...]; every kind also takes name=LABEL (the table row) and:"]
    for option, (default, doc) in POLICY_OPTIONS.items():
        lines.append(f"      {option}={default}".ljust(26) + f" {doc}")
    for kind, info in KINDS.items():
        path = f":PATH ({info.path})" if info.path else ""
        lines.append(f"  {kind}{path}\n      {info.summary}")
        for option, (default, doc) in info.options.items():
            lines.append(f"      {option}={'' if default is None else default}".ljust(26) + f" {doc}")
    return "\n".join(lines)


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
        raise UsageError(f"--drafter {spec!r}: unknown option(s) {', '.join(unknown)} for {kind}; "
                         f"its options: {', '.join([*KINDS[kind].options, *POLICY_OPTIONS, 'name'])}")
    policy = PolicyConfig.from_options(spec, options)
    if policy.entropy_tau and kind == "hierarchical":
        raise UsageError(f"--drafter {spec!r}: the hierarchical drafter has its own entropy rules; set m1_tau= and m2_tau=")
    if policy.entropy_tau and not KINDS[kind].has_distribution:
        raise UsageError(f"--drafter {spec!r}: policy=entropy needs a drafter that drafts from a distribution "
                         f"({', '.join(k for k, v in KINDS.items() if v.has_distribution)}); {kind} has none")
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
    from draftsmith.heads.draft_lm import derive_draft_lm, draft_vocab_from_counts, load_draft_lm

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
            elif isinstance(layers, int):
                model = derive_draft_lm(target, num_layers=layers)
            else:  # exact indices, as a recipe's drafter.layers: layers=0,1,2,29
                try:
                    indices = [int(i) for i in str(layers).split(",")]
                except ValueError:
                    raise UsageError(f"draft_lm option layers={layers!r}: give a count or comma-separated "
                                     "layer indices, e.g. layers=4 or layers=0,1,2,29") from None
                model = derive_draft_lm(target, layers=indices)
            drafter = DraftLMDrafter(model, **options)
        elif parsed.kind == "hierarchical":
            from draftsmith.eval.drafters.hierarchical import HierarchicalDrafter

            param = next(target.parameters())
            vocab = options.pop("vocab", None)
            models = []
            for m in ("m1", "m2"):  # a trained draft LM, or layers cut from the target
                path = options.pop(m, None)
                layers = int(options.pop(f"{m}_layers", KINDS["hierarchical"].options[f"{m}_layers"][0]))
                if path is None and vocab is not None:
                    raise UsageError(f"hierarchical option vocab=N needs trained draft LMs (m1=PATH&m2=PATH); {m} has none")
                models.append(load_draft_lm(str(path), param.dtype, param.device) if path is not None
                              else derive_draft_lm(target, num_layers=layers))
                if vocab is not None:
                    options[f"{m}_vocab"] = draft_vocab_from_counts(str(path), int(vocab), models[-1])
            if min(float(options.get("m1_tau", 1.0)), float(options.get("m2_tau", 1.0))) <= 0:
                raise UsageError("hierarchical options m1_tau and m2_tau must be > 0 (nats)")
            drafter = HierarchicalDrafter(*models, **options)
        elif parsed.kind == "eagle":
            from draftsmith.eval.drafters.eagle import EagleDrafter
            from draftsmith.heads.eagle import EagleHead

            head = EagleHead.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = EagleDrafter(head, **options)
        elif parsed.kind == "eagle3":
            from draftsmith.eval.drafters.eagle import EagleDrafter
            from draftsmith.heads.eagle3 import Eagle3Head

            head = Eagle3Head.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = EagleDrafter(head, **options)
        elif parsed.kind == "medusa":
            from draftsmith.eval.drafters.medusa import MedusaDrafter

            heads, choices, verifier = _medusa_parts(parsed.path, target, options.pop("choices", None),
                                                     options.pop("budget", None))
            drafter = MedusaDrafter(heads, choices, verifier=verifier, **options)
            if verifier is not None:
                drafter.verifier_label = f"target + LoRA adapter {parsed.path}/adapter (unmerged, on for this drafter only)"
        else:
            raise ValueError(f"drafter kind {parsed.kind!r} has no engine adapter")
    except TypeError as err:  # an option value of the wrong type reaching a constructor
        raise UsageError(f"bad option for drafter {parsed.kind!r}: {err}") from None
    drafter.name = parsed.name
    drafter.policy = parsed.policy
    return drafter


def _medusa_parts(path: str, target: PreTrainedModel, choices, budget):
    """Heads, tree and (for Medusa-2 checkpoints) the target with its LoRA adapter to verify with.

    The tree is ``choices`` (a file or a literal), else the optimal ``budget``-node tree for the
    heads' recorded held-out accuracies, else the checkpoint's calibrated ``tree.yaml``, else the
    optimal tree of Medusa's default size (63 nodes).
    """
    from pathlib import Path

    from draftsmith.eval.tree import load_choices, optimal_choices
    from draftsmith.heads.medusa import DEFAULT_TREE_SIZE, MedusaHeads, rank_accuracy
    from draftsmith.target import attach_adapter

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
    "Drafter", "DraftContext", "StepResult", "PromptLookupDrafter", "OracleDrafter", "DraftLMDrafter",
    "DrafterSpec", "KINDS", "kinds_help", "parse_spec", "build_drafter",
]
