"""Stored target features: the frozen target's hidden states on disk, written once, read by training.

A store is a folder with one folder per split of sharded safetensors files
(``shard-00000.safetensors``: the conversations' token ids, loss masks, offsets and last hidden
states, plus for EAGLE-3-style heads the states of their ``aux_layers`` concatenated in the order
the head fuses them) and ``identity.json``: the target, tokenizer, layers and storage it was
written for, checked before a store is resumed or read. Shards are written atomically and skipped
when present and readable (a truncated one is written again), so an interrupted extraction resumes
where it stopped; ``manifest.json``, written last, records the sizes and marks the store complete.

Two engines fill a store: ``hf`` (the target in this process, one conversation at a time, prefilled
:data:`PREFILL_TOKENS` at a time against its KV cache, only the head's layers kept) and ``vllm``
(the serving engine's ``extract_hidden_states``; :mod:`draftsmith.data_prep.vllm_features`).
Storage is the target's dtype, ``bfloat16``, or ``float8`` (e4m3 with a scale per token and layer:
half of bf16). A shard closes at :data:`SHARD_SIZE` conversations or :data:`SHARD_TOKENS` tokens, so
what is held before a write is bounded by tokens, not by how long the conversations are. The store
states its size before it is written (:func:`store_bytes`) and refuses one past
``data.features.max_gb``. ShareGPT features of an 8B model fill hundreds of GB: compute them
``online`` or ``served`` there.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import DynamicCache

from draftsmith.assets import cache_root
from draftsmith.atomic import staged
from draftsmith.checkpoint_files import open_tensors, read_json
from draftsmith.data_prep.dataset import tokenizer_identity
from draftsmith.errors import UserError
from draftsmith.recipe import DataConfig, TargetConfig
from draftsmith.target import target_record
from draftsmith.timing import clock

SHARD_SIZE = 64  # conversations per shard
# tokens per shard at most (a longer conversation gets a shard of its own): a shard's states are held until
# it is written. Above 64 conversations of 4K tokens, so stores of shorter conversations shard as they did.
SHARD_TOKENS = 1 << 18
PREFILL_TOKENS = 2048  # hf: tokens of a conversation prefilled at a time (its KV cache holds the rest)
SAFETENSORS_ENTRY = 96  # bytes of a shard's JSON header per tensor (name, dtype, shape, offsets), about
STORAGE = {"bfloat16": torch.bfloat16}  # storage dtypes other than the target's own (float8 is quantised apart)
SHARD_KEYS = ("hidden", "input_ids", "loss_mask", "offsets")
FLOAT8 = torch.float8_e4m3fn
# Which recipe field to change when a store's identity does not match the recipe's.
IDENTITY_FIELDS = {
    "data": "data (its conversations, limit, max_length, held-out set, regeneration)",
    "target": "target.name",
    "tokenizer": "target.name / target.chat_template",
    "layers": "drafter.aux_layers",
    "storage": "data.features.storage_dtype",
}

# The features of a chunk of conversations (token-id lists): per conversation ``(hidden, aux)``,
# ``hidden`` the last hidden states ``[tokens, hidden]`` (after the final norm: what the LM head
# reads) and ``aux`` the layers' states concatenated ``[tokens, layers * hidden]`` (or None).
Compute = Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor | None]]]


def features_dir(
    target: TargetConfig, data, layers: list[int] | None = None, storage: str = "auto", folder: str | None = None
) -> Path:
    """Where the features of ``target`` over ``data`` live (keyed by both, the layers and the
    storage dtype), or ``folder`` (``drafter.features_dir``) where the recipe names one."""
    if folder:
        return Path(folder)
    identity = [target.name, target.dtype, {s: data[s]._fingerprint for s in data}]
    if layers:
        identity.append(list(layers))
    if storage != "auto":
        identity.append(storage)
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return cache_root() / "features" / key


@dataclass(frozen=True)
class FeatureSource:
    """What the feature sets need of a training run, and no more: its ``target`` and ``data``
    sections, where the features come from (``mode``, the recipe's ``drafter.features``: online,
    offline or served) and the store's folder where the recipe names one (``folder``,
    ``drafter.features_dir``). Training builds it from the recipe
    (:func:`draftsmith.train.prepare.feature_source`)."""

    target: TargetConfig
    data: DataConfig
    mode: str = "online"
    folder: str | None = None

    def store_dir(self, data, layers: list[int] | None = None) -> Path:
        """:func:`features_dir` of the tokenised splits ``data`` for this source's target, storage and folder."""
        return features_dir(self.target, data, layers, self.data.features.storage_dtype, self.folder)


def store_identity(
    target_name: str, target, tokenizer, layers: list[int] | None, storage: str = "auto", data=None
) -> dict:
    """What a store's features depend on: the tokenised ``data`` (its splits' fingerprints), the
    target's weights (embedding signature), its tokenizer and chat template, the layers and the
    storage dtype."""
    return {
        "data": {split: data[split]._fingerprint for split in data} if data is not None else None,
        "target": [target_name, target_record(target, target_name)["embedding_signature"]],
        # without the folder it was read from
        "tokenizer": tokenizer_identity(tokenizer).split("|", 1)[1] if tokenizer is not None else None,
        "layers": list(layers or []),
        "storage": storage,
    }


def check_identity(root: Path, identity: dict) -> None:
    """Refuse a store written for another target, tokenizer, layers or storage (one line naming the
    recipe field); a store without an identity yet is claimed for ``identity``."""
    file = root / "identity.json"
    if not file.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with staged(file) as tmp:
            tmp.write_text(json.dumps(identity, indent=1))
        return
    stored = read_json(file, f"delete the store {root} to extract it again")
    for key, field in IDENTITY_FIELDS.items():
        # A head that reads the last hidden state only (EAGLE-1, Medusa) shares any store of its target;
        # stores written before they recorded their data are checked on the rest.
        if (key == "layers" and not identity["layers"]) or (key == "data" and None in (stored.get(key), identity[key])):
            continue
        if stored.get(key) != identity[key]:
            theirs = stored.get(key)
            raise UserError(
                f"features store {root} was written for {key} {_brief(theirs)}, but the recipe gives "
                f"{_brief(identity[key])} ({field}): set drafter.features_dir to another folder, or delete this one"
            )


def _brief(value) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], list):  # [name, signature]: the name says it
        return repr(value[0])
    return repr(value)


def is_complete(root: Path, data) -> bool:
    """Whether the store at ``root`` holds every conversation of every split of ``data``."""
    manifest = Path(root) / "manifest.json"
    if not manifest.is_file():
        return False
    splits = read_json(manifest, _re_extract(root))["splits"]
    return all(splits.get(split, {}).get("conversations") == len(data[split]) for split in data)


def _re_extract(root: Path) -> str:
    """What to do about a damaged file of the store at ``root``."""
    return f"delete {root / 'manifest.json'} and run again: the store's damaged shards are extracted again"


def _readable(path: Path) -> bool:
    """Whether a shard is whole: its header parses, names every key and accounts for every byte
    (a truncated file's header still parses; its size gives it away)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return False
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    return set(SHARD_KEYS) <= set(header) and path.stat().st_size == 8 + size + end


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[tokens, groups * h]`` as float8 e4m3 and a float32 scale per token and group."""
    chunks = x.float().unflatten(-1, (groups, -1))
    scale = chunks.abs().amax(-1).clamp(min=1e-12) / torch.finfo(FLOAT8).max
    return (chunks / scale.unsqueeze(-1)).to(FLOAT8).flatten(-2), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize`, in ``dtype``."""
    return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def write_shard(
    path: Path,
    input_ids: list[list[int]],
    loss_mask: list[list[int]],
    states: list[tuple[torch.Tensor, torch.Tensor | None]],
    identity: dict,
    per_token: dict[str, list[list[int]]] | None = None,
) -> dict[str, torch.Tensor]:
    """One shard file (written atomically) of conversations' token ids, loss masks and features
    (per conversation ``(hidden, aux)`` host tensors, :data:`Compute`'s), stored as the store's
    ``identity`` says (its layers and storage dtype); returns the tensors written. ``per_token``:
    further int8 values, one per token of each conversation, under their names (a traffic store's
    ``served_draft``); :class:`FeatureDataset` hands them back in its rows."""
    lengths = torch.tensor([len(ids) for ids in input_ids])
    tensors = {
        "input_ids": torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for mask in loss_mask for m in mask], dtype=torch.int8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    for name, values in (per_token or {}).items():
        if [len(v) for v in values] != lengths.tolist():
            raise ValueError(f"{name}: one value per token of each conversation")
        tensors[name] = torch.tensor([x for row in values for x in row], dtype=torch.int8)
    kept = STORAGE.get(identity["storage"])  # cast per conversation: no copy of the shard in the compute dtype
    hidden = torch.cat([h if kept is None else h.to(kept) for h, _ in states]).contiguous()
    aux = torch.cat([a if kept is None else a.to(kept) for _, a in states]).contiguous() if identity["layers"] else None
    if identity["storage"] == "float8":
        tensors["hidden"], tensors["hidden_scale"] = quantize(hidden, 1)
        if aux is not None:
            tensors["aux"], tensors["aux_scale"] = quantize(aux, max(1, len(identity["layers"])))
    else:
        tensors["hidden"] = hidden
        if aux is not None:
            tensors["aux"] = aux
    with staged(path) as tmp:
        save_file(tensors, str(tmp))
    return tensors


def shard_bounds(lengths: list[int], shard_size: int = SHARD_SIZE, shard_tokens: int = SHARD_TOKENS) -> list[range]:
    """The conversations of each shard of a split whose conversations have ``lengths`` tokens: in
    order, at most ``shard_size`` of them and ``shard_tokens`` tokens a shard (a longer conversation
    alone). A function of the lengths alone, so a resumed store's shards line up with the first run's."""
    bounds, start, tokens = [], 0, 0
    for index, length in enumerate(lengths):
        if index > start and (index - start == shard_size or tokens + length > shard_tokens):
            bounds.append(range(start, index))
            start, tokens = index, 0
        tokens += length
    return bounds + [range(start, len(lengths))] if start < len(lengths) else bounds


@dataclass(frozen=True)
class StoreSize:
    """What a store's size follows from beyond its data and identity: the target's ``hidden_size``
    and the ``dtype`` it computes in; and the bound it may not pass (``max_gb``,
    ``data.features.max_gb``; None: none)."""

    hidden_size: int
    dtype: torch.dtype
    max_gb: float | None = None


def store_bytes(data, identity: dict, size: StoreSize, shard_size: int = SHARD_SIZE) -> int:
    """The bytes the store of ``identity`` (its layers and storage) over every split of ``data`` will
    take on disk: per token the last hidden state and each layer's in the storage dtype (float8: and
    a float32 scale each), its token id and loss-mask byte; per conversation an offset; per shard
    the safetensors header."""
    states = 1 + len(identity["layers"])  # the last hidden state, then each of the head's layers
    float8 = identity["storage"] == "float8"
    itemsize = FLOAT8.itemsize if float8 else STORAGE.get(identity["storage"], size.dtype).itemsize
    per_token = states * size.hidden_size * itemsize + (4 * states if float8 else 0) + 4 + 1
    # input_ids, loss_mask, offsets; hidden and aux (float8: each with its scales)
    tensors = 3 + (1 + bool(identity["layers"])) * (2 if float8 else 1)
    total = 0
    for split in data:
        lengths = [len(ids) for ids in data[split]["input_ids"]]
        shards = shard_bounds(lengths, shard_size)
        total += sum(lengths) * per_token + 8 * (len(lengths) + len(shards))
        total += len(shards) * (8 + tensors * SAFETENSORS_ENTRY)
    return total


def check_size(root: Path, data, identity: dict, size: StoreSize, shard_size: int = SHARD_SIZE, show: bool = True):
    """State the size the store at ``root`` will take (:func:`store_bytes`) and refuse it, in one
    line naming ``data.features.max_gb``, past ``size.max_gb``."""
    expected = store_bytes(data, identity, size, shard_size) / 2**30
    if size.max_gb is not None and expected > size.max_gb:
        raise UserError(
            f"the features store {root} would take {expected:.2f} GiB, above data.features.max_gb = {size.max_gb:g}: "
            "raise it, store bfloat16 or float8 (data.features.storage_dtype), lower data.max_length or data.limit, "
            "or compute the features online or served (drafter.features)"
        )
    if show:
        print(f"features: the store {root} will take {expected:.2f} GiB")


def write_store(
    data,
    root: Path,
    compute: Compute,
    identity: dict,
    shard_size: int = SHARD_SIZE,
    show: bool = True,
    size: StoreSize | None = None,
) -> dict:
    """Write the features ``compute`` gives for every split of ``data`` under ``root``; resumable.

    ``identity`` (:func:`store_identity`) is checked against the store's (a mismatch is refused)
    and decides the storage dtype. With ``size`` the store's size is stated before anything is
    written, and refused past its bound (:func:`check_size`). Returns the manifest (conversations,
    tokens, shards, bytes; and ``written_tokens`` and ``seconds``: what this call computed and
    wrote, and how long it took).
    """
    root = Path(root)
    check_identity(root, identity)
    if size is not None:
        check_size(root, data, identity, size, shard_size, show)
    manifest = {"splits": {}, "bytes": 0, "tokens": 0, "written_tokens": 0, "seconds": 0.0}
    for split in data:
        rows = data[split]
        out = root / split
        out.mkdir(parents=True, exist_ok=True)
        shards = shard_bounds([len(ids) for ids in rows["input_ids"]], shard_size)
        for number, members in enumerate(tqdm(shards, desc=f"features {split}", disable=not show)):
            path = out / f"shard-{number:05d}.safetensors"
            if path.is_file() and _readable(path):
                continue
            chunk = rows[members.start : members.stop]
            began = clock("cpu")  # compute() hands back host tensors: nothing left queued on a device
            states = compute(chunk["input_ids"])
            tensors = write_shard(path, chunk["input_ids"], chunk["loss_mask"], states, identity)
            manifest["seconds"] += clock("cpu") - began
            manifest["written_tokens"] += len(tensors["input_ids"])
        files = sorted(out.glob("shard-*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        tokens = sum(len(ids) for ids in rows["input_ids"])
        manifest["splits"][split] = {"conversations": len(rows), "tokens": tokens, "shards": len(files), "bytes": size}
        manifest["bytes"] += size
        manifest["tokens"] += tokens
    with staged(root / "manifest.json") as tmp:
        # What the store holds, not what this call did: a resumed store's manifest is an uninterrupted one's.
        kept = {key: value for key, value in manifest.items() if key not in ("written_tokens", "seconds")}
        tmp.write_text(json.dumps(kept, indent=1))
    if show:
        rate = manifest["written_tokens"] / max(manifest["seconds"], 1e-9)
        print(
            f"features: {manifest['tokens']:,} tokens, {manifest['bytes'] / 2**30:.2f} GiB in {root} "
            f"({manifest['written_tokens']:,} written now, {rate:,.0f} tokens/s)"
        )
    return manifest


def layer_states(decoder, layers: list[int] | None, input_ids: torch.Tensor, **inputs):
    """``(aux, last)`` of a forward pass of the target's ``decoder`` over ``input_ids`` (with further
    ``inputs``: masks, positions, a KV cache): the states of ``layers`` (HF ``hidden_states`` ids)
    concatenated (None without layers) and the last hidden states. The decoder returns the outputs
    of the layers before ``layers`` only (transformers' ``output_hidden_states`` as a list of layer
    indices: ``hidden_states[L]`` is layer ``L - 1``'s output, N's the final norm's); layer 0, the
    embeddings, is embedded apart. Every other layer's states are dropped as the pass goes."""
    outputs = sorted({layer - 1 for layer in layers or [] if layer > 0})
    out = decoder(input_ids=input_ids, output_hidden_states=outputs, **inputs)
    if not layers:
        return None, out.last_hidden_state
    fused = [decoder.embed_tokens(input_ids) if layer == 0 else out.hidden_states[layer - 1] for layer in layers]
    return torch.cat(fused, dim=-1), out.last_hidden_state


def hf_compute(
    target, layers: list[int] | None, keep: torch.dtype | None = None, prefill: int = PREFILL_TOKENS
) -> Compute:
    """:data:`Compute` by the target in this process, one conversation at a time, prefilled
    ``prefill`` tokens at a time against its KV cache, only ``layers``' states kept
    (:func:`layer_states`), each piece's moved to the host in ``keep`` (None: the target's dtype) at
    once. What a conversation holds at a time is its KV cache, one piece's activations and its kept
    states, not every layer's states of the whole conversation."""
    decoder = target.get_decoder()
    device = next(target.parameters()).device

    def host(x: torch.Tensor) -> torch.Tensor:
        return x[0].to("cpu", keep or x.dtype)

    @torch.no_grad()
    def compute(chunk: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out = []
        for ids in chunk:
            cache = DynamicCache(config=target.config)
            hidden, aux = [], []
            for start in range(0, len(ids), prefill):
                piece = torch.tensor([ids[start : start + prefill]], device=device)
                fused, last = layer_states(decoder, layers, piece, past_key_values=cache, use_cache=True)
                hidden.append(host(last))
                if layers:
                    aux.append(host(fused))
            out.append((torch.cat(hidden), torch.cat(aux) if layers else None))
        return out

    return compute


def extract_features(
    target,
    data,
    root: Path,
    shard_size: int = SHARD_SIZE,
    show: bool = True,
    layers: list[int] | None = None,
    identity: dict | None = None,
    max_gb: float | None = None,
) -> dict:
    """Write ``target``'s features (last hidden states and, with ``layers``, those layers' states
    fused as ``aux``) for every split of ``data`` under ``root`` in this process; resumable.
    ``identity``: the store's (:func:`store_identity`; default: ``target`` by its config's name).
    The store's size is stated first, and refused past ``max_gb`` (``data.features.max_gb``)."""
    if identity is None:
        identity = store_identity(str(target.config.name_or_path), target, None, layers, data=data)
    dtype = next(target.parameters()).dtype
    size = StoreSize(target.config.hidden_size, dtype, max_gb)
    compute = hf_compute(target, layers, STORAGE.get(identity["storage"]))
    return write_store(data, root, compute, identity, shard_size, show, size)


SERVED_DRAFT = "served_draft"  # shard key: the served drafter's outcome at each token (int8; data_prep.traffic)
PER_TOKEN = (SERVED_DRAFT,)  # int8 per-token keys a shard may hold beside its features (write_shard)


class FeatureDataset(Dataset):
    """Rows ``{input_ids, loss_mask, hidden[, aux][, served_draft]}`` read lazily from one split's
    feature shards (float8 stores come back in float32; ``served_draft`` where the shard holds it: a
    traffic store's, :mod:`draftsmith.data_prep.traffic`)."""

    def __init__(self, folder: str | Path, files: list[Path] | None = None):
        self.files = sorted(Path(folder).glob("shard-*.safetensors")) if files is None else list(files)
        if not self.files:
            raise FileNotFoundError(f"no feature shards in {folder}; run the feature extraction first")
        self.offsets = []
        self.starts = [0]
        self._fix = _re_extract(Path(folder).parent)
        for file in self.files:
            with open_tensors(file, self._fix) as shard:
                offsets = shard.get_tensor("offsets")
            self.offsets.append(offsets)
            self.starts.append(self.starts[-1] + len(offsets) - 1)

    @classmethod
    def from_files(cls, files: list[Path]) -> FeatureDataset:
        """The rows of these shards (of one split's folder), in this order."""
        return cls(files[0].parent, files)

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        """Token count of every row (from the shards' offsets, nothing else read)."""
        return [n for offsets in self.offsets for n in offsets.diff().tolist()]

    def token_rows(self) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of every row, the features left unread."""
        rows = []
        for file, offsets in zip(self.files, self.offsets):
            with open_tensors(file, self._fix) as handle:
                ids, mask = handle.get_tensor("input_ids").tolist(), handle.get_tensor("loss_mask").tolist()
            bounds = offsets.tolist()
            rows += [(ids[lo:hi], mask[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        return rows

    def per_token(self, name: str) -> list[list[int] | None]:
        """The per-token values ``name`` (:data:`PER_TOKEN`) of every row, None for the rows of a
        shard without them, the features left unread."""
        rows: list[list[int] | None] = []
        for file, offsets in zip(self.files, self.offsets):
            bounds = offsets.tolist()
            with open_tensors(file, self._fix) as handle:
                if name not in set(handle.keys()):
                    rows += [None] * (len(bounds) - 1)
                    continue
                values = handle.get_tensor(name).tolist()
            rows += [values[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        return rows

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect_right(self.starts, index) - 1
        local = index - self.starts[shard]
        lo, hi = self.offsets[shard][local].item(), self.offsets[shard][local + 1].item()
        with open_tensors(self.files[shard], self._fix) as handle:
            keys = set(handle.keys())
            row = {
                "input_ids": handle.get_slice("input_ids")[lo:hi].long(),
                "loss_mask": handle.get_slice("loss_mask")[lo:hi].bool(),
            }
            for name in ("hidden", "aux"):
                if name not in keys:
                    continue
                values = handle.get_slice(name)[lo:hi]
                scale = f"{name}_scale"
                row[name] = dequantize(values, handle.get_slice(scale)[lo:hi]) if scale in keys else values
            for name in PER_TOKEN:
                if name in keys:
                    row[name] = handle.get_slice(name)[lo:hi]
            return row


class RowSelection(Dataset):
    """Chosen rows of feature datasets, in the order given (``picks``: ``(dataset, row)`` pairs), each
    cut to its first ``max_length`` tokens (None: whole): e.g. a training round's recent traffic and
    a replay share of older data."""

    def __init__(self, picks: list[tuple[FeatureDataset, int]], max_length: int | None = None):
        self.picks, self.max_length = picks, max_length
        lengths = {id(d): d.lengths() for d, _ in picks}
        self._lengths = [min(lengths[id(d)][i], max_length or math.inf) for d, i in picks]

    def __len__(self) -> int:
        return len(self.picks)

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def __getitem__(self, index: int) -> dict:
        dataset, row = self.picks[index]
        return {key: value[: self.max_length] for key, value in dataset[row].items()}
