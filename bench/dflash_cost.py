"""Cost of one DFlash training step, block-sparse attention against dense masked SDPA.

    python bench/dflash_cost.py --out DIR [--recipe recipes/smollm2-dflash.yaml] [--repeats 3] [--skip-recipe]

Two shapes, each timed both ways in the same run (the median of ``--repeats`` optimiser steps after
one warm-up, loss + backward + AdamW, the target's features computed once beforehand, the same
held-out anchors every step):

- ``recipe``: the recipe's drafter on its target, the first ``training.batch_size`` conversations
  of its data (regeneration off), at its precision (smollm2-dflash: 2 layers, blocks of 8, 64 anchors);
- ``llama_shape``: the Llama recipe's blocks (512 anchors x 16 over 2,048 supervised tokens, one
  conversation) on a narrow random Llama (hidden 256, 4 heads, 2 kv heads, 3 layers) with a
  2-layer drafter, fp32: the attention's share of the step at that shape, not an 8B's step time.

Writes ``DIR/dflash_cost.json``: per shape ``step_s_dense``, ``step_s_sparse``, ``ratio``
(dense / sparse), the groups the sparse path used and the batch's shape.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from train_step import first_batch, median_step_seconds
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.heads.dflash import DFlashHead
from draftsmith.train.cli import parse_training_args
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashRecipe, DFlashTask, blocks_per_group, build

MODES = ("dense", "sparse")


def step_seconds(task: DFlashTask, batch: dict, sparse: bool, repeats: int, precision: str) -> float:
    """Median wall time of one optimiser step of ``task``'s head, attention block-sparse or dense."""
    task.block_sparse = sparse
    # training=False draws the same anchors every step: both modes time the same work.
    return median_step_seconds(task, batch, repeats, precision, training=False)


def compare(task: DFlashTask, batch: dict, repeats: int, precision: str) -> dict:
    with torch.no_grad():
        batch["aux"], batch["hidden"] = task.target_features(batch)
    result = {f"step_s_{mode}": step_seconds(task, batch, mode == "sparse", repeats, precision) for mode in MODES}
    length, count, block = batch["input_ids"].shape[1], task.cfg.anchors_per_sequence, task.cfg.block_size
    per = blocks_per_group(min(count, length), length, block)
    result.update(
        ratio=result["step_s_dense"] / result["step_s_sparse"],
        batch=list(batch["input_ids"].shape),
        anchors=count,
        block_size=block,
        blocks_per_group=per,
        groups=-(-min(count, length) // per),
        precision=precision,
    )
    return result


def recipe_shape(path: str, repeats: int) -> dict:
    recipe, _ = parse_training_args(
        DFlashRecipe,
        [path, "--data.regenerate.enabled", "false", "--data.limit", "64", "--tracking.report_to", "none"],
    )
    task, train_set, _ = build(recipe)
    batch = first_batch(train_set, recipe.training.batch_size)
    return compare(task, batch, repeats, recipe.training.mixed_precision) | {"recipe": path}


def llama_shape(repeats: int, length: int = 2048, anchors: int = 512, block: int = 16) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    target = LlamaForCausalLM(config).eval()
    cfg = DFlashDrafterConfig(aux_layers=[0, 1, 2], num_layers=2, block_size=block, anchors_per_sequence=anchors)
    head = DFlashHead.for_target(target, "llama-shape", [0, 1, 2], 2, block, 4095, torch.arange(1024))
    task = DFlashTask(SimpleNamespace(drafter=cfg), target, head)
    ids = torch.randint(0, 4000, (1, length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    return compare(task, batch, repeats, "no") | {"model": "random Llama, hidden 256, 4 heads (2 kv), 2 drafter layers"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for dflash_cost.json")
    parser.add_argument("--recipe", default="recipes/smollm2-dflash.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-recipe", action="store_true", help="time the Llama-like shape only")
    args = parser.parse_args()
    result = {"threads": torch.get_num_threads(), "repeats": args.repeats}
    if not args.skip_recipe:
        result["recipe"] = recipe_shape(args.recipe, args.repeats)
        print(json.dumps(result["recipe"], indent=1), flush=True)
    result["llama_shape"] = llama_shape(args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dflash_cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
