"""Distilled draft LMs as they are: plain Hugging Face causal LMs with the target's tokenizer.

``train/distill.py`` already saves ``save_pretrained`` output (config, weights, tokenizer); the
export copies it without the resumable training state (adding the target's tokenizer if the
checkpoint has none) and adds the model card. It loads with
``AutoModelForCausalLM``, as HF ``generate(assistant_model=...)``, as vLLM's ``draft_model``
speculative method and as ``draft_lm:DIR`` here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoTokenizer

from draftsmith.export.common import Source, Target

NAME = "hf"
SKIP = {"state", "recipe.yaml", "README.md"}  # resumable training state; the recipe goes into the card


def why_not(kind: str) -> str:
    """Why this format cannot hold ``kind`` drafters."""
    return "it is not a standalone language model (heads run on the target's features)"


def export(source: Source, target: Target, out: Path, tree: dict) -> list[str]:
    """Copy the draft LM folder; returns the vLLM command that serves it as a draft model."""
    for item in source.path.iterdir():
        if item.name in SKIP:
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    if not (out / "tokenizer_config.json").is_file():  # saved without one: the target's is the draft's
        AutoTokenizer.from_pretrained(target.folder).save_pretrained(out)
    spec = f'{{"method": "draft_model", "model": "{out}", "num_speculative_tokens": {tree["depth"]}}}'
    return [f"vllm serve {target.folder} --speculative-config '{spec}'"]
