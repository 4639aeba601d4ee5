"""Drafters for the shared decoding engine, and the registry that builds them from CLI specs.

A spec is ``KIND[:PATH][?key=value&key=value]``, e.g. ``prompt_lookup``,
``prompt_lookup?num_tokens=4&branches=3``, ``draft_lm:HuggingFaceTB/SmolLM2-135M-Instruct?depth=5``,
``draft_lm?layers=4`` (a draft cut from the target: 4 evenly spaced layers, or ``layers=0,1,2,29``), ``oracle?num_tokens=8``,
``eagle:runs/x/checkpoint-final?depth=5&top_k=3&budget=12``. ``name=`` sets the
label used in tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from transformers import PreTrainedModel

from draftsmith.eval.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.drafters.oracle import OracleDrafter
from draftsmith.eval.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.runner import CausalLMRunner

KINDS = ("prompt_lookup", "oracle", "draft_lm", "eagle", "medusa")


@dataclass
class DrafterSpec:
    """A parsed ``KIND[:PATH][?options]`` string."""

    kind: str
    path: str | None = None
    options: dict = field(default_factory=dict)
    name: str = ""


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
        raise ValueError(f"unknown drafter kind {kind!r} in {spec!r}; choose from {', '.join(KINDS)}")
    options = {key: _value(val) for key, val in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))}
    name = str(options.pop("name", _default_name(kind, path)))
    return DrafterSpec(kind, path or None, options, name)


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
                raise ValueError("draft_lm option vocab=N needs a trained draft LM (draft_lm:PATH) with token counts")
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
                    raise ValueError(f"draft_lm option layers={layers!r}: give a count or comma-separated "
                                     "layer indices, e.g. layers=4 or layers=0,1,2,29") from None
                model = derive_draft_lm(target, layers=indices)
            drafter = DraftLMDrafter(model, **options)
        elif parsed.kind == "eagle":
            from draftsmith.eval.drafters.eagle import EagleDrafter
            from draftsmith.heads.eagle import EagleHead

            if not parsed.path:
                raise ValueError("the eagle drafter needs a checkpoint: eagle:PATH")
            head = EagleHead.from_pretrained(parsed.path, target).to(next(target.parameters()).dtype)
            drafter = EagleDrafter(head, **options)
        elif parsed.kind == "medusa":
            from draftsmith.eval.drafters.medusa import MedusaDrafter

            if not parsed.path:
                raise ValueError("the medusa drafter needs a checkpoint: medusa:PATH")
            heads, choices, verifier = _medusa_parts(parsed.path, target, options.pop("choices", None),
                                                     options.pop("budget", None))
            drafter = MedusaDrafter(heads, choices, verifier=verifier, **options)
            if verifier is not None:
                drafter.verifier_label = f"target + LoRA adapter {parsed.path}/adapter (unmerged, on for this drafter only)"
        else:
            raise ValueError(f"drafter kind {parsed.kind!r} has no engine adapter")
    except TypeError as err:
        raise ValueError(f"bad option for drafter {parsed.kind!r}: {err}") from None
    drafter.name = parsed.name
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
        raise ValueError(f"{path} records no head accuracies: pass choices=FILE or run eval/calibrate_tree.py")
    return heads, optimal_choices(rank_accuracy(heads.head_accuracy), int(budget or DEFAULT_TREE_SIZE)), verifier


__all__ = [
    "Drafter", "DraftContext", "StepResult", "PromptLookupDrafter", "OracleDrafter", "DraftLMDrafter",
    "DrafterSpec", "parse_spec", "build_drafter",
]
