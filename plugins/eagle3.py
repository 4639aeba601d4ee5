"""EAGLE-3 heads: trained by ``train/eagle3.py`` (training-time test), drafting EAGLE-2 dynamic
trees over the target's fused layers, exported to ``speculators`` (vLLM serves it as ``eagle3``) and SGLang."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.eagle import build_planned, tree_options
from draftsmith.export import sglang, speculators
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.kinds import DrafterKind, Features, Served, Training
from draftsmith.plugins.eagle import chain
from draftsmith.train import eagle3

PLAN_FALLBACK = {"depth": 6, "top_k": 3, "budget": 12}  # unplanned (no held-out accuracy recorded)


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves the speculators export as ``eagle3``; the SGLang one is refused, saying which to check."""
    if fmt == sglang.NAME:
        raise UsageError(
            f"{folder}: this is the SGLang layout; vLLM serves EAGLE-3 heads from "
            "`draftsmith-export CKPT --format speculators`: check that export"
        )
    return Served("eagle3", depth) if fmt == speculators.NAME else None


KIND = DrafterKind(
    name="eagle3",
    summary="a trained EAGLE-3 head (fused target layers, training-time test) growing EAGLE-2 dynamic trees",
    build=partial(build_planned, head_class=Eagle3Head, fallback=PLAN_FALLBACK),
    path="checkpoint, speculators or sglang export folder (required)",
    options=tree_options(PLAN_FALLBACK),
    has_distribution=True,
    plan_fallback=PLAN_FALLBACK,
    training=Training("eagle3", eagle3.Eagle3Recipe, eagle3.main, eagle3.build, eagle3.Eagle3Task),
    features=Features("aux", rows=True),
    title="EAGLE-3 head",
    formats={
        speculators.NAME: speculators.export_eagle3,
        sglang.NAME: partial(sglang.export, algorithm=sglang.SGLANG_EAGLE3),
    },
    serve=serve,
    chain=chain,
    builds_on=("eagle",),  # its drafter and chain are EAGLE-1's (eval/engine/drafters/eagle.py), over fused layers
)
