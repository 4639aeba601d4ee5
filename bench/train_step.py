"""What the training-cost benches (``dflash_cost.py``, ``unroll_cost.py``) share: the first batch of
a recipe's training set, and the median wall time of one optimiser step of a task's head on it."""

from __future__ import annotations

import statistics
from contextlib import nullcontext

import torch

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.timing import clock


def first_batch(train_set, batch_size: int) -> dict:
    """The first ``batch_size`` rows of ``train_set`` (their ``input_ids`` and ``loss_mask``), padded."""
    rows = [{key: torch.as_tensor(train_set[i][key]) for key in ("input_ids", "loss_mask")} for i in range(batch_size)]
    return pad_batch(rows)


def median_step_seconds(task, batch: dict, repeats: int, precision: str, training: bool) -> float:
    """Median wall time of one optimiser step (loss, backward, AdamW) of ``task``'s head on
    ``batch`` over ``repeats`` steps after one more that warms allocators and kernels up;
    ``precision`` "bf16" runs the loss under autocast, ``training`` is passed to ``task.loss``."""
    head = task.model.train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    device = next(head.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    times = []
    for _ in range(repeats + 1):
        start = clock(device)
        with autocast:
            loss, _ = task.loss(head, batch, training=training)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(clock(device) - start)
    return statistics.median(times[1:])
