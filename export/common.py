"""What every export shares: the drafter checkpoint being exported, its target, the folder written.

An exported folder is what the serving engine reads (its own config fields and weight names) plus,
under :data:`~draftsmith.heads.common.EXPORT_KEY` in ``config.json``, the drafter's own draftsmith
config, so the engine here can load the export back (``eagle3:EXPORTED_DIR``) and check it
against its target.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from draftsmith.checkpoint_files import load_tensors, read_json
from draftsmith.errors import CheckpointError, UsageError
from draftsmith.heads.common import check_target
from draftsmith.heads.exported import EXPORT_KEY
from draftsmith.kinds import registered
from draftsmith.target import DEFAULT_TARGET, DEFAULT_TARGET_HUB_ID, resolve_target

# Where a plain Hugging Face export (whose config.json is the model's own) keeps draftsmith's record.
EXPORT_SIDECAR = "draftsmith_export.json"
WEIGHTS = "model.safetensors"
# A fused head's weights over the concatenated aux layers (fc reads [aux_1 ; ... ; aux_n]).
FUSED_COLUMNS = ("fc.weight",)
PER_AUX_LAYER = re.compile(r"(fc_norm\.)(\d+)(\..+)")  # one module per aux layer, numbered in its order
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
HUB_CACHE_FOLDER = re.compile(r"models--([\w.-]+?)--([\w.-]+)/snapshots/")


@dataclass
class Source:
    """A drafter checkpoint to export: its kind, its own config and weights (draftsmith names)."""

    path: Path
    kind: str  # a registered drafter kind's name (draftsmith.kinds)
    config: dict  # the checkpoint's config.json (a draft LM's is a plain Hugging Face config)
    record: dict  # the target record written at training time (draftsmith.target.target_record)

    @cached_property
    def state(self) -> dict[str, torch.Tensor]:
        return load_tensors(self.path / WEIGHTS)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's floating-point weights (what target weights are cast to)."""
        return next(v.dtype for v in self.state.values() if v.is_floating_point())


def read_source(path: str | Path) -> Source:
    """The drafter checkpoint in folder ``path``; a one-line error when it is not one."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a drafter checkpoint: it has no config.json (give a checkpoint-N "
            "or checkpoint-final folder written by training)"
        )
    config = read_json(file)
    if EXPORT_KEY in config:
        raise CheckpointError(
            f"{path} is already an export ({config[EXPORT_KEY].get('format')}); export the "
            f"training checkpoint it came from ({config[EXPORT_KEY].get('source')})"
        )
    if "draftsmith_kind" in config:
        return Source(path, config["draftsmith_kind"], config, config.get("target") or {})
    # Kinds whose checkpoints are plain Hugging Face folders name their target in a file of their own.
    records = {kind.target_file: kind.name for kind in registered().values() if kind.target_file}
    for file, kind in records.items():
        if (path / file).is_file():
            return Source(path, kind, config, read_json(path / file))
    raise CheckpointError(
        f"{path} is not a draftsmith drafter checkpoint: its config.json names no "
        f"draftsmith_kind and it has no {' or '.join(records) or 'target record'}"
    )


@dataclass
class Target:
    """The target a drafter was trained for, as a local folder (the exports name it; no hub needed)."""

    name: str  # as recorded in the checkpoint
    folder: Path
    source: Source = field(repr=False)
    hub_id_override: str | None = None  # --target-hub-id

    @property
    def hub_id(self) -> str | None:
        """The target's hub id (``--target-hub-id``, the recorded hub id, the bundled target's
        origin, or read off a hub-cache folder ``models--ORG--NAME/snapshots/REV``), else None."""
        if self.hub_id_override:
            return self.hub_id_override
        if self.name == DEFAULT_TARGET:
            return DEFAULT_TARGET_HUB_ID
        if HUB_ID.fullmatch(self.name) and not Path(self.name).expanduser().exists():
            return self.name
        cached = HUB_CACHE_FOLDER.search(self.folder.as_posix())
        return f"{cached.group(1)}/{cached.group(2)}" if cached else None

    @property
    def verifier_name(self) -> str:
        """What engines are told the verifier is: its hub id, else (one machine only) its local folder."""
        return self.hub_id or str(self.folder)

    @cached_property
    def model(self) -> PreTrainedModel:
        """The target in fp32 on the CPU, checked against the checkpoint's record."""
        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32).eval()
        check_target(self.source.record, model, self.source.path)
        return model

    @cached_property
    def saved_config(self) -> dict:
        return read_json(self.folder / "config.json")

    @property
    def architectures(self) -> list[str]:
        return self.saved_config.get("architectures") or []

    @property
    def dtype_name(self) -> str:
        """The dtype the target is saved in (what engines load it in), not the one training loaded it in."""
        return str(self.saved_config.get("dtype") or self.saved_config.get("torch_dtype") or "float32")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    def engine_layer_config(self, layer: dict) -> dict:
        """A drafter layer config (a copy of the target's, as loaded for training) with the target's own dtype."""
        layer = {key: value for key, value in layer.items() if key != "torch_dtype"}
        layer["dtype"] = self.dtype_name
        return layer


def find_target(source: Source, override: str | None = None, hub_id: str | None = None) -> Target:
    """The local folder of ``source``'s target: ``override`` (``--target``), else the recorded name
    (``default``, a folder, a ``.gguf`` file or a hub id present in the local hub cache);
    ``hub_id`` (``--target-hub-id``) names it for engines elsewhere."""
    name = source.record.get("name")
    if hub_id is not None and not HUB_ID.fullmatch(hub_id):
        raise UsageError(f"--target-hub-id {hub_id!r}: not a hub id (ORG/NAME)")
    if override:
        folder = Path(override).expanduser()
        if not (folder / "config.json").is_file():
            raise UsageError(f"--target {override}: not a model folder (no config.json)")
        return Target(name or str(folder), folder.resolve(), source, hub_id)
    if not name:
        raise CheckpointError(
            f"{source.path} does not record its target's name (config.json 'target.name'); "
            "give the target's local folder with --target DIR"
        )
    resolved = resolve_target(name, field=f"{source.path}: target")
    if Path(resolved).is_dir():
        return Target(name, Path(resolved).resolve(), source, hub_id)
    from huggingface_hub import snapshot_download

    try:
        return Target(name, Path(snapshot_download(resolved, local_files_only=True)), source, hub_id)
    except Exception:  # not in the local cache: the export must name a folder that loads offline
        raise UsageError(
            f"target {name!r} has no local copy: download it (`hf download {name} --local-dir DIR`) "
            "and give --target DIR"
        ) from None


def export_block(source: Source, fmt: str, config: dict | None = None) -> dict:
    """What an exported config.json carries for draftsmith: format, source and the drafter's config
    (``config`` when the export rewrote it; :func:`record_export` adds the target's local folder and
    the drafted tokens per step)."""
    return {
        EXPORT_KEY: {
            "format": fmt,
            "kind": source.kind,
            "source": str(source.path.resolve()),
            "config": config or source.config,
        }
    }


def ascending_aux_layers(
    source: Source, columns: tuple[str, ...] = FUSED_COLUMNS
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A fused head's config and weights with its aux layers in ascending order.

    vLLM and SGLang capture the target's aux hidden states in ascending layer order whatever order
    the config lists them in, and concatenate them in that order before ``fc``; a head trained on
    another order would be served with its ``fc`` column blocks matched to the wrong layers. So the
    ids are sorted and the column blocks of ``columns`` (the weights in the concatenated aux-layer
    space: ``fc``'s, and whatever else a kind's part names) permuted with them, and so are the
    per-layer norms EAGLE 3.1 puts before ``fc`` (``fc_norm.{i}``): the same function, served right.
    """
    aux = list(source.config["aux_layers"])
    order = sorted(range(len(aux)), key=aux.__getitem__)
    tensors = dict(source.state)
    if order != list(range(len(aux))):
        for name in columns:
            if name in tensors:
                blocks = tensors[name].chunk(len(aux), dim=-1)
                tensors[name] = torch.cat([blocks[i] for i in order], dim=-1)
        for name in [name for name in tensors if PER_AUX_LAYER.fullmatch(name)]:
            tensors[name] = source.state[PER_AUX_LAYER.sub(lambda m: f"{m[1]}{order[int(m[2])]}{m[3]}", name)]
    return {**source.config, "aux_layers": [aux[i] for i in order]}, tensors


def rename_blocks(tensors: dict[str, torch.Tensor], pattern: re.Pattern, template: str) -> dict[str, torch.Tensor]:
    """The tensors whose names match ``pattern``, renamed to ``template`` filled with its groups
    (a format's names to a kind's or back: ``{0}`` head, ``{1}`` block, ``{2}`` weight or bias);
    the others are left out."""
    renamed = {}
    for name, value in tensors.items():
        match = pattern.fullmatch(name)
        if match:
            renamed[template.format(*match.groups())] = value
    return renamed


def record_export(out: Path, source: Source, fmt: str, target: Target, tree: dict) -> None:
    """Add to the export's draftsmith record what only this machine knows: the target's local
    folder (engines are told the hub id; the serve check and ``eval/run.py`` load this folder), the
    tokens drafted per step the export was made for and, for a planned tree, what it was planned
    for. Formats whose config.json is the engine's alone (``hf``) get the record as :data:`EXPORT_SIDECAR`."""
    extra = {
        "target_folder": str(target.folder),
        "num_speculative_tokens": tree["depth"],
        **({"draft_tree": tree} if tree.get("planned") else {}),
    }
    file = out / "config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    if EXPORT_KEY in config:
        config[EXPORT_KEY].update(extra)
        write_config(out, config)
    else:
        (out / EXPORT_SIDECAR).write_text(
            json.dumps({**export_block(source, fmt)[EXPORT_KEY], **extra}, indent=1, default=str)
        )


def write_config(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))


def write_weights(out: Path, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    """``model.safetensors`` with ``tensors`` (contiguous CPU copies)."""
    state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", "draftsmith_export": fmt})


def refuse(fmt: str, kind: str, why: str) -> UsageError:
    """The one-line error for a drafter that ``fmt`` cannot hold."""
    return UsageError(f"--format {fmt} cannot hold {kind} drafters: {why}")
