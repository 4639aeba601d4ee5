"""Loading exported folders back (``eagle3:EXPORT_DIR`` and the like): the format is detected from
the exported config.json and the weights are renamed to draftsmith's.

Each format the engine reads back is here, with the file and tensor names it shares with its writer
in :mod:`draftsmith.export`, so that a head loads an export without importing the exporters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.checkpoint_files import load_tensors, load_torch, read_json
from draftsmith.errors import CheckpointError

# The key under which ``draftsmith-export`` keeps a drafter's own config inside an exported
# folder's config.json, so the engine can load the export back (see :mod:`draftsmith.export`).
EXPORT_KEY = "draftsmith_export"
SPECULATORS_EMBED = "embed_tokens.weight"  # the target's embedding, shipped in speculators folders
# A DFlash drafter's learned mask row: vLLM 0.32 reads this file beside a dflash export
# (qwen3_dflash.py, DFlashQwen3ForCausalLM._read_mask_embedding: {"embedding", "mask_token_id"}).
DFLASH_MASK_EMBEDDING = "mask_embedding.pt"
# SGLang's draft model class for each of its --speculative-algorithm values that draftsmith exports.
SGLANG_EAGLE, SGLANG_EAGLE3 = "EAGLE", "EAGLE3"
SGLANG_ARCHITECTURES = {SGLANG_EAGLE: "LlamaForCausalLMEagle", SGLANG_EAGLE3: "LlamaForCausalLMEagle3"}
SGLANG_HOT_TOKEN_MAP = "hot_token_map.pt"  # an EAGLE-1 head's draft vocabulary, for SGLang
MEDUSA_HEADS_FILE = "medusa_lm_head.pt"  # the official Medusa layout's weights
MEDUSA_OFFICIAL_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
MEDUSA_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
DRAFTSMITH_BLOCK = "blocks.{0}.{1}.linear.{2}"  # draftsmith's Medusa residual blocks


def rename_blocks(tensors: dict[str, torch.Tensor], pattern: re.Pattern, template: str) -> dict[str, torch.Tensor]:
    """The tensors whose names match ``pattern``, renamed to ``template`` filled with its groups
    (``{0}`` head, ``{1}`` block, ``{2}`` weight or bias); the others are left out."""
    renamed = {}
    for name, value in tensors.items():
        match = pattern.fullmatch(name)
        if match:
            renamed[template.format(*match.groups())] = value
    return renamed


def _speculators_state(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    tensors = load_tensors(folder / "model.safetensors")
    # EAGLE-3's table is the target's, used by reference (a block drafter's export has none); a parallel
    # EAGLE-3's, the one kind with a mask token and a table, is its own, trained.
    if "mask_token_id" not in config:
        tensors.pop(SPECULATORS_EMBED, None)
    mask = folder / DFLASH_MASK_EMBEDDING
    if mask.is_file():
        row = load_torch(mask)  # vLLM takes a bare tensor too
        tensors["mask_embedding"] = (row["embedding"] if isinstance(row, dict) else row).reshape(-1)
    if "d2t" not in tensors:  # full draft vocabulary: the identity maps
        vocab = config["transformer_layer_config"]["vocab_size"]
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
        tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return tensors


def _sglang_state(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    tensors = load_tensors(folder / "model.safetensors")
    vocab = config["vocab_size"]
    if SGLANG_ARCHITECTURES[SGLANG_EAGLE3] in config["architectures"]:
        if "d2t" not in tensors:
            tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
            tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    else:
        hot = folder / SGLANG_HOT_TOKEN_MAP
        tensors["draft_vocab"] = (
            torch.tensor(load_torch(hot), dtype=torch.long) if hot.is_file() else torch.arange(vocab)
        )
    return tensors


def _vllm_medusa_state(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    tensors = load_tensors(folder / "model.safetensors")
    state = rename_blocks(tensors, MEDUSA_VLLM_BLOCK, DRAFTSMITH_BLOCK)
    if not config["original_lm_head"]:
        state["lm_weight"] = torch.stack([tensors[f"lm_heads.{k}.weight"] for k in range(config["num_heads"])])
    state["draft_vocab"] = tensors.get("token_map", torch.arange(config["vocab_size"]))
    return state


def _medusa_state(folder: Path, config: dict) -> dict[str, torch.Tensor]:
    tensors = load_torch(folder / MEDUSA_HEADS_FILE)
    own = config[EXPORT_KEY]["config"]
    layers = config["medusa_num_layers"]
    state = rename_blocks(tensors, MEDUSA_OFFICIAL_BLOCK, DRAFTSMITH_BLOCK)
    if own["lm_head"] == "copy":
        state["lm_weight"] = torch.stack([tensors[f"{k}.{layers}.weight"] for k in range(config["medusa_num_heads"])])
    state["draft_vocab"] = torch.arange(own["vocab_size"])
    return state


@dataclass(frozen=True)
class Reader:
    """How one export format is recognised and read back."""

    matches: Callable[[dict], bool]  # is this exported config.json of the format
    native_state: Callable[[Path, dict], dict[str, torch.Tensor]]  # its weights under draftsmith names


# The formats the engine loads back, by export format name (a plain Hugging Face draft LM folder
# needs none: draft_lm:DIR loads it directly).
READERS = {
    "speculators": Reader(lambda config: "speculators_model_type" in config, _speculators_state),
    "sglang": Reader(
        lambda config: bool(set(config.get("architectures") or []) & set(SGLANG_ARCHITECTURES.values())),
        _sglang_state,
    ),
    "vllm-medusa": Reader(lambda config: config.get("model_type") == "medusa", _vllm_medusa_state),
    "medusa": Reader(lambda config: "medusa_num_heads" in config, _medusa_state),
}


def detect_format(config: dict) -> str | None:
    """The export format whose fields ``config`` (an exported config.json) has, or None."""
    found = [name for name, reader in READERS.items() if reader.matches(config)]
    return found[0] if len(found) == 1 else None


def native_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The drafter's weights under draftsmith names from the exported folder ``path``."""
    path = Path(path)
    config = read_json(path / "config.json")
    fmt = detect_format(config)
    recorded = config[EXPORT_KEY].get("format")
    if fmt is None or fmt != recorded:
        raise CheckpointError(
            f"{path}: config.json says it is a {recorded!r} export but its fields are "
            f"{'of no known format' if fmt is None else f'those of {fmt!r}'}; re-export it"
        )
    return READERS[fmt].native_state(path, config)
