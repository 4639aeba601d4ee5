"""P-EAGLE heads: EAGLE-3 heads drafting their whole chain in one pass (parallel drafting).

Exported as speculators' ``PEagleSpeculatorConfig`` (``models/peagle/{config,core}.py``; vLLM's
``update_peagle``): EAGLE-3's layout plus ``speculators_model_type: peagle``, a required
``mask_token_id`` and a ``mask_hidden`` weight (``[1, 1, len(aux) * hidden]``, in ``fc``'s input
space, so its blocks follow the aux layers' order as ``fc``'s columns do); ``embed_tokens.weight``
is the head's own trained table, mask token's row included (vLLM keeps a draft embedding that
differs from the target's). vLLM serves them as ``eagle3`` with
``parallel_drafting: true``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import peagle
from draftsmith.export import speculators
from draftsmith.export.common import FUSED_COLUMNS
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.plugins.eagle3 import to_speculators as eagle3_to_speculators
from draftsmith.train import peagle as training


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves the speculators export as ``eagle3`` drafting the chain in one pass."""
    return Served("eagle3", depth, parallel_drafting=True) if fmt == speculators.NAME else None


KIND = DrafterKind(
    name="peagle",
    summary="a trained P-EAGLE head drafting a chain of depth tokens in one forward pass (parallel drafting)",
    build=peagle.build,
    path="checkpoint or speculators export folder (required)",
    options={
        "depth": Option(
            None, "tokens drafted per step, in one pass (default and most: the depths the head was trained for)", COUNT
        ),
    },
    has_distribution=True,
    max_depth=lambda config: config["num_depths"],  # deeper mask positions were never trained
    training=Training("peagle", training.PEagleRecipe, training.main, training.build, training.PEagleTask),
    features=Features("aux", rows=True),
    title="P-EAGLE head (parallel drafting)",
    formats={
        speculators.NAME: partial(
            eagle3_to_speculators,
            architecture="PEagleSpeculator",
            parallel=True,
            columns=(*FUSED_COLUMNS, "mask_hidden"),  # the mask feature lives in fc's input space
        )
    },
    readers={speculators.NAME: partial(speculators.read, own_embedding=True)},
    serve=serve,
    chain=lambda depth: {"depth": depth},  # a chain already
    builds_on=("eagle3",),  # an EAGLE-3 head drafting its chain in one pass
)
