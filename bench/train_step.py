"""What the training-cost benches (``dflash_cost.py``, ``unroll_cost.py``, ``objective_cost.py``) share:
a recipe's task with the first batch of its training set (the target's features computed once), and
the median wall time of one optimiser step of a task's head on it."""

from __future__ import annotations

import statistics
from contextlib import nullcontext

import torch

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.kinds import for_recipe
from draftsmith.timing import clock
from draftsmith.train.cli import parse_training_args


def first_batch(train_set, batch_size: int) -> dict:
    """The first ``batch_size`` rows of ``train_set`` (their ``input_ids`` and ``loss_mask``), padded."""
    rows = [{key: torch.as_tensor(train_set[i][key]) for key in ("input_ids", "loss_mask")} for i in range(batch_size)]
    return pad_batch(rows)


def task_on_first_batch(recipe_path: str, kind: str, overrides: list[str]) -> tuple:
    """``(recipe, task, batch)``: the ``kind`` recipe at ``recipe_path`` (the data's own replies, 64
    conversations, ``overrides`` last), its task, and the first batch of its training set with the
    target's features computed once beforehand, as ``features: offline`` gives them."""
    training = for_recipe(kind).training
    common = ["--data.regenerate.enabled", "false", "--data.limit", "64", "--drafter.features", "online"]
    recipe, _ = parse_training_args(training.recipe, [recipe_path, *common, "--tracking.report_to", "none", *overrides])
    task, train_set, _ = training.build(recipe)
    batch = first_batch(train_set, recipe.training.batch_size)
    with torch.no_grad():
        batch["aux"], batch["hidden"] = task.target_features(batch)
    return recipe, task, batch


def optimiser_step(task, precision: str, training: bool = True, lr: float = 1e-4):
    """``step(batch)``: one optimiser step (loss, backward, AdamW) of ``task``'s head, put in
    training mode; ``precision`` "bf16" runs the loss under autocast, ``training`` is passed to ``task.loss``."""
    head = task.model.train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    device = next(head.parameters()).device

    def step(batch: dict) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext():
            loss, _ = task.loss(head, batch, training=training)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def median_step_seconds(
    task, batch: dict, repeats: int, precision: str, training: bool, seed: int | None = None
) -> float:
    """Median wall time of one optimiser step (:func:`optimiser_step`) of ``task``'s head on
    ``batch`` over ``repeats`` steps after one more that warms allocators and kernels up; with
    ``seed``, torch's generators are re-seeded before each step (untimed), so a training step's
    random draws (anchors, sampled chains) are the same every time."""
    step = optimiser_step(task, precision, training)
    device = next(task.model.parameters()).device
    times = []
    for _ in range(repeats + 1):
        if seed is not None:
            torch.manual_seed(seed)
        start = clock(device)
        step(batch)
        times.append(clock(device) - start)
    return statistics.median(times[1:])
