"""Offline target features for EAGLE training: the frozen target's hidden states, on disk.

Each split is written as shards (``shard-00000.safetensors``: the conversations' token ids,
loss masks, offsets and last hidden states in the target's dtype, plus for EAGLE-3 the fused
hidden states of its ``aux_layers``). Shards are written atomically and
skipped when present, so an interrupted extraction resumes where it stopped; ``manifest.json``
records the size. ShareGPT features of an 8B model fill hundreds of GB: use ``online`` there.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from draftsmith.assets import cache_root
from draftsmith.atomic import staged

SHARD_SIZE = 64  # conversations per shard


def features_dir(recipe, data, layers: list[int] | None = None) -> Path:
    """Where the features of ``recipe``'s target over ``data`` live (keyed by both and the layers)."""
    if recipe.drafter.features_dir:
        return Path(recipe.drafter.features_dir)
    identity = [recipe.target.name, recipe.target.dtype, {s: data[s]._fingerprint for s in data}]
    if layers:
        identity.append(list(layers))
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return cache_root() / "features" / key


@torch.no_grad()
def extract_features(
    target, data, root: Path, shard_size: int = SHARD_SIZE, show: bool = True, layers: list[int] | None = None
) -> dict:
    """Write the target's last hidden states (and with ``layers`` those layers' states, fused, as
    ``aux``) for every split of ``data`` under ``root``; resumable."""
    root = Path(root)
    decoder = target.get_decoder()
    device = next(target.parameters()).device
    manifest = {"splits": {}, "bytes": 0, "tokens": 0}
    for split in data:
        rows = data[split]
        out = root / split
        out.mkdir(parents=True, exist_ok=True)
        shards = range(0, len(rows), shard_size)
        for number, start in enumerate(tqdm(shards, desc=f"features {split}", disable=not show)):
            path = out / f"shard-{number:05d}.safetensors"
            if path.is_file():
                continue
            chunk = rows[start : start + shard_size]
            hidden, aux = [], []
            for ids in chunk["input_ids"]:
                states = decoder(input_ids=torch.tensor([ids], device=device), output_hidden_states=bool(layers))
                hidden.append(states.last_hidden_state[0].cpu())
                if layers:
                    aux.append(torch.cat([states.hidden_states[layer][0] for layer in layers], dim=-1).cpu())
            lengths = torch.tensor([len(ids) for ids in chunk["input_ids"]])
            tensors = {
                "hidden": torch.cat(hidden).contiguous(),
                "input_ids": torch.tensor([t for ids in chunk["input_ids"] for t in ids], dtype=torch.int32),
                "loss_mask": torch.tensor([m for mask in chunk["loss_mask"] for m in mask], dtype=torch.int8),
                "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            }
            if layers:
                tensors["aux"] = torch.cat(aux).contiguous()
            with staged(path) as tmp:
                save_file(tensors, str(tmp))
        files = sorted(out.glob("shard-*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        tokens = sum(len(ids) for ids in rows["input_ids"])
        manifest["splits"][split] = {"conversations": len(rows), "tokens": tokens, "shards": len(files), "bytes": size}
        manifest["bytes"] += size
        manifest["tokens"] += tokens
    with staged(root / "manifest.json") as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    if show:
        print(f"features: {manifest['tokens']:,} tokens, {manifest['bytes'] / 2**30:.2f} GiB in {root}")
    return manifest


class FeatureDataset(Dataset):
    """Rows ``{input_ids, loss_mask, hidden[, aux]}`` read lazily from one split's feature shards."""

    def __init__(self, folder: str | Path):
        self.files = sorted(Path(folder).glob("shard-*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no feature shards in {folder}; run the feature extraction first")
        self.offsets = []
        self.starts = [0]
        for file in self.files:
            with safe_open(str(file), "pt") as shard:
                offsets = shard.get_tensor("offsets")
            self.offsets.append(offsets)
            self.starts.append(self.starts[-1] + len(offsets) - 1)

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        """Token count of every row (from the shards' offsets, nothing else read)."""
        return [n for offsets in self.offsets for n in offsets.diff().tolist()]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect_right(self.starts, index) - 1
        local = index - self.starts[shard]
        lo, hi = self.offsets[shard][local].item(), self.offsets[shard][local + 1].item()
        with safe_open(str(self.files[shard]), "pt") as handle:
            row = {
                "input_ids": handle.get_slice("input_ids")[lo:hi].long(),
                "loss_mask": handle.get_slice("loss_mask")[lo:hi].bool(),
                "hidden": handle.get_slice("hidden")[lo:hi],
            }
            if "aux" in handle.keys():
                row["aux"] = handle.get_slice("aux")[lo:hi]
            return row


def training_sets(recipe, target, data, layers: list[int] | None = None):
    """``(train, held_out)``: the tokenised splits (``drafter.features: online``) or their offline
    feature caches (with ``layers``: EAGLE-3's fused states too), extracted first where missing."""
    if recipe.drafter.features != "offline":
        return data["train"], data["held_out"]
    root = features_dir(recipe, data, layers)
    extract_features(target, data, root, layers=layers)
    # No held-out conversation (a small data.limit): no shards to read, and nothing to evaluate on.
    return FeatureDataset(root / "train"), FeatureDataset(root / "held_out") if len(data["held_out"]) else None
