"""EAGLE-1 heads: trained by ``train/eagle.py``, drafting EAGLE-2 dynamic trees, exported to SGLang.

vLLM cannot serve them: its EAGLE-1 model has no ``fc`` bias.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.eagle import build_planned, tree_options
from draftsmith.export import sglang, speculators
from draftsmith.heads.eagle import EagleHead
from draftsmith.kinds import DrafterKind, Features, Served, Training
from draftsmith.train import eagle

# The tree of a head that records no held-out accuracy (trained without held-out data) under depth=auto.
PLAN_FALLBACK = {"depth": 5, "top_k": 3, "budget": 12}


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves no EAGLE-1 export: a one-line refusal saying what to do instead."""
    if fmt != sglang.NAME:
        return None
    raise UsageError(
        f"{folder}: vLLM cannot serve draftsmith's EAGLE-1 heads: vLLM's EAGLE-1 model "
        "(model_executor/models/llama_eagle.py) builds fc without a bias, and these heads train one; "
        "serve this export in SGLang, or train an EAGLE-3 head and export --format speculators"
    )


def chain(depth: int) -> dict:
    """The spec options of a chain of ``depth`` top-1 drafts (what vLLM drafts): a one-wide tree."""
    return {"depth": depth, "top_k": 1, "budget": depth}


KIND = DrafterKind(
    name="eagle",
    summary="a trained EAGLE head growing EAGLE-2 dynamic trees",
    build=partial(build_planned, head_class=EagleHead, fallback=PLAN_FALLBACK),
    path="checkpoint or sglang export folder (required)",
    options=tree_options(PLAN_FALLBACK),
    has_distribution=True,
    plan_fallback=PLAN_FALLBACK,
    training=Training("eagle", eagle.EagleRecipe, eagle.main, eagle.build),
    features=Features("last", rows=True),
    title="EAGLE-1 head",
    formats={sglang.NAME: partial(sglang.export, algorithm=sglang.SGLANG_EAGLE)},
    readers={sglang.NAME: sglang.read},
    refused={
        speculators.NAME: f"speculators {speculators.VERSION} has no EAGLE-1 model (its EAGLE family starts at EAGLE-3)"
    },
    serve=serve,
    chain=chain,
)
