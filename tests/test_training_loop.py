"""The shared training loop under gradient accumulation: exact epochs, exact last steps, real token counts.

A one-weight linear model whose loss is the batch mean of ``w * x`` has gradient ``mean(x)``, so
the gradient the optimiser sees at each step tells exactly which micro-batches it averaged.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState

from draftsmith.heads.base import same_dtype
from draftsmith.recipe import Recipe
from draftsmith.train.loop import Trainer
from draftsmith.train.ordering import epoch_order, sequence_lengths

pytestmark = pytest.mark.usefixtures("one_thread")


class MeanTask:
    """Loss ``mean(w * x)``: its gradient is the batch mean of ``x``; records what it trains on."""

    def __init__(self):
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.micro_batches: list[list[float]] = []  # the x values of every training micro-batch

    @staticmethod
    def collate(rows: list[dict]) -> dict:
        return {"x": torch.tensor([[r["x"]] for r in rows])}

    def loss(self, model, batch: dict, training: bool):
        if training:
            self.micro_batches.append(batch["x"].flatten().tolist())
        return model(batch["x"]).mean(), {"tokens": float(len(batch["x"]))}

    def save_pretrained(self, model, path) -> None:
        torch.save(model.state_dict(), path / "weights.pt")


class SlowMeanTask(MeanTask):
    """:class:`MeanTask` whose micro-batches take at least ``seconds`` each (a time budget to use up)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def loss(self, model, batch: dict, training: bool):
        time.sleep(self.seconds)
        return super().loss(model, batch, training)


def _recipe(tmp_path, batch: int, accumulation: int, epochs: int, **distributed) -> Recipe:
    recipe = Recipe()
    recipe.target.dtype = "float32"  # exact gradients: no bf16 autocast, whatever this CPU supports
    recipe.training.output_dir = str(tmp_path / "out")
    recipe.training.batch_size, recipe.training.gradient_accumulation_steps = batch, accumulation
    recipe.training.num_epochs, recipe.training.max_grad_norm = epochs, 1e9  # no clipping: raw gradients
    recipe.training.learning_rate, recipe.training.lr_schedule = 1e-3, "constant"
    recipe.tracking.report_to = "none"
    for key, value in distributed.items():
        setattr(recipe.distributed, key, value)
    return recipe


def _train(tmp_path, rows: int, batch: int, accumulation: int, epochs: int, **distributed) -> tuple[Trainer, list]:
    recipe = _recipe(tmp_path, batch, accumulation, epochs, **distributed)
    data = [{"x": float(i + 1)} for i in range(rows)]
    task = MeanTask()
    trainer = Trainer(recipe, task, data)
    optimizer = trainer.optimizer.optimizer  # the torch optimizer under Accelerate's (or DeepSpeed's) wrapper
    grads: list[float] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.append(float(opt.param_groups[0]["params"][0].grad.sum()))
    )
    trainer.train()
    return trainer, grads


def _expected(rows: int, batch: int, accumulation: int, epochs: int, seed: int = 0):
    """Each epoch's micro-batches (the loop's shuffled order) and the gradient of each step."""
    grads, micro = [], []
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(rows) + 1.0
        batches = [order[i : i + batch] for i in range(0, rows, batch)]
        micro += [b.tolist() for b in batches]
        for start in range(0, len(batches), accumulation):
            group = batches[start : start + accumulation]
            grads.append(float(np.mean([b.mean() for b in group])))
    return grads, micro


@pytest.mark.parametrize("rows,batch,accumulation,epochs", [(7, 1, 4, 3), (10, 3, 2, 2), (5, 2, 1, 2), (3, 1, 4, 2)])
def test_epochs_and_partial_steps_are_exact_under_accumulation(tmp_path, rows, batch, accumulation, epochs):
    trainer, grads = _train(tmp_path, rows, batch, accumulation, epochs)
    want_grads, want_micro = _expected(rows, batch, accumulation, epochs)
    # 7 rows, batch 1, accumulation 4, 3 epochs: 2 steps per epoch (4 + 3 micro-batches), 6 in all.
    assert trainer.state.step == len(want_grads) == trainer.max_steps
    assert trainer.task.micro_batches == want_micro  # every epoch seen in full, none twice
    assert grads == pytest.approx(want_grads, rel=1e-6)  # a short last step averages its own micro-batches
    assert trainer.state.tokens == rows * epochs
    assert trainer.history[-1]["train/tokens_seen"] == rows * epochs


@pytest.fixture
def single_process_deepspeed(monkeypatch):
    """A one-process DeepSpeed group (as the loop sets it up without a launcher), torn down after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "ACCELERATE_USE_DEEPSPEED": "true",
    }.items():  # restored after
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(reset_partial_state=True)  # earlier in-process runs set up a plain state
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow  # DeepSpeed initialisation takes ~25 s
def test_epochs_and_partial_steps_are_exact_under_deepspeed(tmp_path, single_process_deepspeed):
    trainer, grads = _train(tmp_path, 7, 1, 4, 3, backend="deepspeed", zero_stage=0)
    want_grads, want_micro = _expected(7, 1, 4, 3)
    assert trainer.state.step == 6 == trainer.max_steps
    assert trainer.task.micro_batches == want_micro
    assert grads == pytest.approx(want_grads, rel=1e-6)
    assert trainer.state.tokens == 21


def _last_bar(err: str) -> str:
    """The progress bar as last drawn on stderr."""
    return [line.rstrip() for line in err.replace("\r", "\n").splitlines() if line.startswith("train:")][-1]


class SlowFirstStepTask(MeanTask):
    """:class:`MeanTask` whose first micro-batch takes ``seconds`` (start-up: caches, allocators)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def loss(self, model, batch: dict, training: bool):
        if training and not self.micro_batches:
            time.sleep(self.seconds)
        return super().loss(model, batch, training)


def test_warmup_runs_on_real_steps_under_a_time_budget(tmp_path):
    # The first step takes half of a 2.4 s budget: the warm-up still ramps over the first 4
    # optimiser steps from the first one (not at lr 0, not jumped past), then time drives the decay.
    recipe = _recipe(tmp_path, batch=1, accumulation=1, epochs=1)
    recipe.training.max_minutes, recipe.training.warmup_steps, recipe.training.lr_schedule = 0.04, 4, "linear"
    trainer = Trainer(recipe, SlowFirstStepTask(1.2), [{"x": float(i + 1)} for i in range(100)])
    rates: list[float] = []
    trainer.optimizer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"])
    )
    trainer.train()
    peak = recipe.training.learning_rate
    assert rates[:4] == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak])
    # Step 5 onwards: decayed by the larger of the step share and the time share (over half used).
    assert all(rate <= peak * 0.5 for rate in rates[4:]) and rates[-1] < peak * 0.05


def test_progress_bar_runs_over_the_time_budget_and_ends_with_the_run(tmp_path, capsys):
    # 0.1 s micro-batches under a 1.2 s budget: the deadline ends the run after ~12 of 400 steps,
    # and the bar counts the budget's seconds (a step bar stopped at ~3% with minutes "remaining").
    recipe = _recipe(tmp_path, batch=1, accumulation=1, epochs=100)
    recipe.training.max_minutes = 0.02
    trainer = Trainer(recipe, SlowMeanTask(0.1), [{"x": float(i)} for i in range(4)])
    capsys.readouterr()
    trainer.train()
    assert trainer.max_steps == 400 and 3 <= trainer.state.step < 30
    bar = _last_bar(capsys.readouterr().err)
    assert bar.startswith("train: 100%|")
    assert bar.endswith(f"| 1/1 s of training.max_minutes, step {trainer.state.step} (at most 400)")

    # The steps run out long before a 10-minute deadline: the bar ends at 100% with them.
    recipe = _recipe(tmp_path / "short", batch=1, accumulation=1, epochs=1)
    recipe.training.max_minutes = 10
    trainer = Trainer(recipe, SlowMeanTask(0.0), [{"x": float(i)} for i in range(4)])
    trainer.train()
    bar = _last_bar(capsys.readouterr().err)
    assert bar.startswith("train: 100%|") and bar.endswith(" s of training.max_minutes, step 4 (at most 4)")

    # Without a budget: the plain step bar.
    trainer, _ = _train(tmp_path / "plain", rows=4, batch=1, accumulation=1, epochs=1)
    bar = _last_bar(capsys.readouterr().err)
    assert bar.startswith("train: 100%|") and "| 4/4 [" in bar


def test_length_grouped_batches_pad_less_and_keep_every_row_once():
    from datasets import Dataset

    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 800, size=1000).tolist()
    data = Dataset.from_dict({"input_ids": [[1] * n for n in lengths]}).train_test_split(test_size=0.1, seed=0)["train"]
    lengths = sequence_lengths(data)
    assert lengths == [len(row["input_ids"]) for row in data]  # through the split's index mapping
    batch = 4

    def padded(order):  # padded positions over real ones, batches of `batch` in `order`
        rows = [order[i : i + batch] for i in range(0, len(order), batch)]
        return sum(max(lengths[i] for i in r) * len(r) for r in rows) / sum(lengths) - 1

    plain = epoch_order(len(data), batch, seed=3)
    grouped = epoch_order(len(data), batch, seed=3, lengths=lengths)
    assert sorted(grouped) == list(range(len(data))) and grouped == epoch_order(len(data), batch, 3, lengths)
    assert grouped != epoch_order(len(data), batch, 4, lengths)  # another epoch, another order
    assert padded(plain) > 0.5 and padded(grouped) < 0.05, (padded(plain), padded(grouped))
    # 900 rows in batches of 4: no partial batch; 902 rows: the partial batch of 2 comes last.
    odd_lengths = lengths + [5, 5]
    odd = epoch_order(902, batch, seed=3, lengths=odd_lengths)
    last_window = sorted(np.random.default_rng(3).permutation(902).tolist()[896:], key=lambda i: -odd_lengths[i])
    assert sorted(odd) == list(range(902)) and odd[-2:] == last_window[-2:]


class ScoringTask(MeanTask):
    """:class:`MeanTask` whose loss also applies a frozen fp32 table after the model's forward, as the
    heads' losses apply the draft and target LM heads: records the dtype each product ran in."""

    def __init__(self):
        super().__init__()
        self.table = torch.randn(4, 1)
        self.dtypes: list[tuple[bool, torch.dtype]] = []

    def loss(self, model, batch: dict, training: bool):
        out = model(batch["x"])
        scores = out @ same_dtype(self.table, out).T
        self.dtypes.append((training, scores.dtype))
        return scores.float().mean(), {"tokens": float(len(batch["x"]))}


@pytest.mark.parametrize("mixed_precision, want", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_the_whole_loss_runs_under_the_recipes_autocast_not_only_the_forward(tmp_path, mixed_precision, want):
    """Accelerate autocasts the model's forward only: the products a loss applies after it (the LM
    heads over the draft vocabulary, the target's logits) ran in fp32 under ``mixed_precision: bf16``
    until the loop put the whole loss, in training and in evaluation, under the recipe's autocast."""
    AcceleratorState._reset_state(reset_partial_state=True)  # each case its own precision
    recipe = _recipe(tmp_path, batch=2, accumulation=1, epochs=1)
    recipe.training.mixed_precision = mixed_precision
    recipe.training.eval_every = 1
    task = ScoringTask()
    trainer = Trainer(recipe, task, [{"x": float(i + 1)} for i in range(4)], eval_data=[{"x": 1.0}, {"x": 2.0}])
    trainer.train()
    assert {training for training, _ in task.dtypes} == {True, False}
    assert all(dtype == want for _, dtype in task.dtypes), task.dtypes
    AcceleratorState._reset_state(reset_partial_state=True)
