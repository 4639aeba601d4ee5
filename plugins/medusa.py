"""Medusa heads: trained by ``train/medusa.py`` (Medusa-1, or Medusa-2 with a LoRA adapter on the
target), drafting static trees, exported to vLLM's Medusa layout (vLLM 0.32) and the official one."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from draftsmith.config import COUNT
from draftsmith.errors import UsageError
from draftsmith.eval import medusa_calibration
from draftsmith.eval.engine.drafters import medusa
from draftsmith.export import medusa as official
from draftsmith.export import vllm_medusa
from draftsmith.heads.medusa import BLOCK, BLOCK_NAME
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.train import medusa as training

ADAPTER = "adapter"  # a Medusa-2 checkpoint's LoRA adapter on the target (a peft adapter folder)


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM (0.32) serves the vllm-medusa export as ``medusa``; Medusa-2 heads and the official
    layout are refused, saying what to do instead."""
    if fmt == official.NAME:
        raise UsageError(
            f"{folder}: vLLM has no loader for the 'medusa' layout (the official Medusa format); "
            "export --format vllm-medusa and check that"
        )
    if fmt != vllm_medusa.NAME:
        return None
    if (folder / ADAPTER).is_dir():
        raise UsageError(
            f"{folder}: Medusa-2 heads verify with their LoRA-tuned target, which vLLM does not "
            "load beside them; merge the adapter into the target (peft merge_and_unload) and serve "
            "that, or check Medusa-1 heads"
        )
    return Served("medusa", depth)


def chain(depth: int) -> dict:
    """The static tree of one top-1 guess per head, ``depth`` heads deep: the chain vLLM drafts."""
    return {"choices": json.dumps([[0] * (d + 1) for d in range(depth)])}


KIND = DrafterKind(
    name="medusa",
    summary="trained Medusa heads over a static tree",
    build=medusa.build,
    path="checkpoint, vllm-medusa or medusa export folder (required)",
    options={
        "choices": Option(None, "tree file (Medusa-style [[0], [0, 0], [1], ...]); default: the calibrated tree.yaml"),
        "budget": Option(None, "use the optimal N-node tree for the heads' recorded accuracies instead", COUNT),
    },
    max_depth=lambda config: config["num_heads"],  # a head per drafted token
    training=Training("medusa", training.MedusaRecipe, training.main, training.build),
    features=Features("last", rows=True),
    title="Medusa heads",
    formats={
        vllm_medusa.NAME: partial(vllm_medusa.export, blocks=BLOCK),
        official.NAME: partial(official.export, blocks=BLOCK),
    },
    readers={
        vllm_medusa.NAME: partial(vllm_medusa.read, block_name=BLOCK_NAME),
        official.NAME: partial(official.read, block_name=BLOCK_NAME),
    },
    copied=("tree.yaml", ADAPTER),  # the calibrated tree and a Medusa-2 LoRA adapter travel along
    serve=serve,
    chain=chain,
    calibrate=medusa_calibration.calibrate_tree,
    modules=("draftsmith.eval.medusa_calibration",),  # its calibration, a harness job outside the engine
)
