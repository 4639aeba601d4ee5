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

from pathlib import Path

import torch

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import peagle
from draftsmith.export import speculators
from draftsmith.export.common import FUSED_COLUMNS, Source, Target
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.plugins.eagle3 import target_table, write_eagle3_family
from draftsmith.train import peagle as training


def to_speculators(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the speculators ``peagle`` folder (EAGLE-3's with P-EAGLE's part); returns the vLLM
    command that serves it drafting the chain in one pass."""
    fields = {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": source.kind,
        "mask_token_id": source.config["mask_token_id"],
    }
    columns = (*FUSED_COLUMNS, "mask_hidden")  # the mask feature lives in fc's input space
    return write_eagle3_family(
        source, target, out, tree, fields, columns, table=own_table, extra={"parallel_drafting": True}
    )


def own_table(target: Target, config: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The head's own trained table, mask row included; a checkpoint from before the table trained
    kept only its mask row (``mask_embedding``, taken out of ``tensors``), set into the target's table."""
    if "mask_embedding" not in tensors:
        return tensors[speculators.EMBEDDING].detach().to(target.dtype)
    table = target_table(target, config, tensors).clone()
    table[config["mask_token_id"]] = tensors.pop("mask_embedding").to(target.dtype)
    return table


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
    formats={speculators.NAME: to_speculators},
    readers={speculators.NAME: speculators.read},  # the table is the head's own: read back with its weights
    serve=serve,
    chain=lambda depth: {"depth": depth},  # a chain already
    builds_on=("eagle3",),  # an EAGLE-3 head drafting its chain in one pass
)
