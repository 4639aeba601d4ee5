"""Draft LMs: any causal LM with the target's tokenizer. One artefact, three names: trained by
``train/distill.py`` (recipes say ``drafter.kind: distill``), drafted as ``draft_lm``, exported as ``hf``."""

from __future__ import annotations

from pathlib import Path

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import draft_lm
from draftsmith.export import hf
from draftsmith.heads.draft_lm import TARGET_RECORD
from draftsmith.kinds import DrafterKind, Option, Served, Training
from draftsmith.train import distill


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves a plain Hugging Face draft LM as a draft model."""
    return Served("draft_model", depth) if fmt == hf.NAME else None


KIND = DrafterKind(
    name="draft_lm",
    summary="any causal LM with the target's tokenizer; without PATH, layers cut from the target",
    build=draft_lm.build,
    path="hub id or folder (e.g. a train/distill.py checkpoint); optional",
    options={
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
    hf_assistant=True,
    training=Training("distill", distill.DistillRecipe, distill.main, distill.build),
    title="draft LM",
    formats={hf.NAME: hf.export},
    target_file=TARGET_RECORD,
    serve=serve,
    chain=lambda depth: {"depth": depth, "top_k": 1},
    modules=("draftsmith.train.distill",),  # its trainer (recipes say drafter.kind: distill)
)
