"""DFlash drafters: Qwen3 layers over ``[anchor, MASK x (block_size - 1)]`` with the target's fused
layers injected as context, drafting a block in one pass; trained by ``train/dflash.py``.

Exported as speculators' ``dflash`` (vLLM serves it with ``method: dflash``, drafting the block in
parallel by itself): Qwen3 layers (whatever the target), every layer full attention and
``sliding_window_non_causal: true`` so vLLM serves the block bidirectionally as it was trained
(vLLM applies that flag to every layer and serves causally without it); no embedding (the
target's); the reduced-vocabulary LM head with ``d2t``/``t2d``. A learned mask row
(``drafter.learn_mask_embedding``) ships as ``mask_embedding.pt`` (``{"embedding", "mask_token_id"}``),
which vLLM 0.32's DFlash loader substitutes for the target's row
(``qwen3_dflash.py``: ``_read_mask_embedding``, ``embed_input_ids``); a drafter reading the target's
row is refused where that row is near zero (never trained).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from draftsmith.checkpoint_files import load_torch
from draftsmith.config import COUNT, Range
from draftsmith.eval.engine.drafters import dflash
from draftsmith.export import speculators
from draftsmith.export.common import (
    Source,
    Target,
    ascending_aux_layers,
    refuse,
)
from draftsmith.heads.dflash import draft_config, weak_mask_row
from draftsmith.kinds import DrafterKind, Features, Option, Served, Training
from draftsmith.train import dflash as training

# A learned mask row: vLLM 0.32 reads this file beside a dflash export
# (qwen3_dflash.py, DFlashQwen3ForCausalLM._read_mask_embedding: {"embedding", "mask_token_id"}).
MASK_EMBEDDING = "mask_embedding.pt"


def to_speculators(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Write the speculators ``dflash`` folder; returns the vLLM command that serves it. A confidence
    head stays behind: neither speculators' nor vLLM's DFlash has one (vLLM drafts the whole block)."""
    fields = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "sample_from_anchor": False}
    return write_block_drafter(source, target, out, tree, fields, "dflash", without=("confidence_head.",))


def write_block_drafter(
    source: Source, target: Target, out: Path, tree: dict, fields: dict, method: str, without: tuple[str, ...] = ()
) -> list[str]:
    """Write the speculators folder of a DFlash-family drafter (DFlash's config and weights plus a
    subclass's ``fields`` and weights, less those named ``without*``); returns the vLLM command that
    serves it with ``method``."""
    speculators.check_aux_layers(source)
    config, tensors = ascending_aux_layers(source)
    tensors = {name: value for name, value in tensors.items() if not name.startswith(without)}
    vocab = config["target_config"]["vocab_size"]
    if config["draft_vocab_size"] == vocab:
        raise refuse(
            speculators.NAME,
            source.kind,
            "its draft vocabulary is the full one: speculators' DFlash model then takes "
            "the verifier's LM head in place of the drafter's trained one; train with "
            "drafter.draft_vocab_size below the vocabulary size",
        )
    mask_row = tensors.pop("mask_embedding", None)
    if mask_row is None:
        weak = weak_mask_row(target.model.get_input_embeddings().weight, config["mask_token_id"])
        if weak is not None:
            raise refuse(
                speculators.NAME,
                source.kind,
                f"its mask slots read the target's embedding row for drafter.mask_token_id = "
                f"{config['mask_token_id']}, of norm {weak[0]:.3g} beside the table's median {weak[1]:.3g} "
                "(never trained): vLLM would feed every mask slot ~0; retrain with "
                "drafter.learn_mask_embedding: true (or another drafter.mask_token_id)",
            )
    layer = draft_config(AutoConfig.for_model(**config["target_config"]), config["num_layers"]).to_dict()
    layer = {key: value for key, value in layer.items() if key not in ("torch_dtype", "_attn_implementation_autoset")}
    layer.update(dtype=target.dtype_name, layer_types=["full_attention"] * config["num_layers"])
    fields = {
        **fields,
        "block_size": config["block_size"],
        "aux_hidden_state_layer_ids": list(config["aux_layers"]),
        "mask_token_id": config["mask_token_id"],
        "sliding_window_non_causal": True,
    }
    speculators.write_folder(source, target, out, tree, config, layer, fields, tensors)
    if mask_row is not None:
        torch.save(
            {"embedding": mask_row.detach().to(target.dtype).cpu(), "mask_token_id": config["mask_token_id"]},
            out / MASK_EMBEDDING,
        )
    return [speculators.vllm_command(target, out, method, tree["depth"], {})]


def read_speculators(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    """A DFlash-family speculators folder's weights under draftsmith's names, a learned mask row
    (:data:`MASK_EMBEDDING`) included."""
    tensors = speculators.read(folder, config)
    mask = folder / MASK_EMBEDDING
    if mask.is_file():
        row = load_torch(mask)  # vLLM takes a bare tensor too
        tensors["mask_embedding"] = (row["embedding"] if isinstance(row, dict) else row).reshape(-1)
    return tensors


# How much of a drafted chain the target verifies, for DFlash-family drafters with a confidence head.
CUT_OPTIONS = {
    "cut": Option(
        None,
        "with a confidence head, how many drafted tokens the target verifies: priced (the default: the count "
        "with the most expected tokens per second, from the predicted acceptances and the target's measured "
        "pass costs), threshold (while the running product of predicted acceptances >= threshold), fixed (all)",
    ),
    "threshold": Option(0.5, "cut=threshold: the least running product of predicted acceptances verified", Range(0, 1)),
}


def serve(fmt: str, folder: Path, depth: int) -> Served | None:
    """vLLM serves the speculators export as ``dflash`` (it drafts the block in parallel by itself)."""
    return Served("dflash", depth) if fmt == speculators.NAME else None


KIND = DrafterKind(
    name="dflash",
    summary="a trained DFlash drafter: Qwen3 layers over [last token, MASK...] with the target's "
    "features injected as context, drafting the block in one forward pass",
    build=dflash.build,
    path="checkpoint or speculators export folder (required)",
    options={
        "depth": Option(
            None,
            "tokens K drafted per step, in one pass over [anchor, MASK x K] as vLLM runs it "
            "(default and most: the block size - 1, the block trained)",
            COUNT,
        ),
        **CUT_OPTIONS,
    },
    has_distribution=True,
    max_depth=lambda config: config["block_size"] - 1,  # the anchor takes the block's first slot
    training=Training("dflash", training.DFlashRecipe, training.main, training.build),
    features=Features("aux", rows=True),
    title="DFlash drafter",
    formats={speculators.NAME: to_speculators},
    readers={speculators.NAME: read_speculators},
    serve=serve,
    chain=lambda depth: {"depth": depth},  # a chain already
)
