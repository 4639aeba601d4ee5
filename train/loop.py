"""The training loop every drafter kind shares.

A drafter kind supplies a :class:`TrainTask`: the trainable module, the loss of a batch and how to
export a checkpoint. The :class:`Trainer` runs it under Accelerate (set up from the recipe by
:mod:`draftsmith.train.distributed`), in the row order of :mod:`draftsmith.train.ordering`, and
writes checkpoints atomically (:mod:`draftsmith.train.checkpoints`); ``--resume`` continues from
the newest one so an interrupted run ends where an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from draftsmith.atomic import staged
from draftsmith.config import dump_recipe
from draftsmith.recipe import Recipe
from draftsmith.timing import clock
from draftsmith.train.checkpoints import (
    FINAL,
    TRAINER_STATE,
    begin_staging,
    load_state,
    newest_checkpoint,
    prune,
    publish,
    staging_folder,
    state_dir,
)
from draftsmith.train.distributed import make_accelerator, resolve_precision, start_tracker
from draftsmith.train.ordering import epoch_items, epoch_loader, sequence_lengths

LOG_HISTORY = "log_history.jsonl"  # every logged metrics dict, a JSON line each


class TrainTask(Protocol):
    """What a drafter kind plugs into the loop."""

    model: torch.nn.Module  # the trainable module (only its parameters are optimised)

    def loss(self, model: torch.nn.Module, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of a batch through ``model`` (the wrapped module: DDP/DeepSpeed hooks live there) and
        metrics to log, summed over tokens (``metrics['tokens']`` weighs them)."""

    def collate(self, rows: list[dict]) -> dict:
        """Pad a list of dataset rows into a batch."""

    def save_pretrained(self, model: torch.nn.Module, path: Path) -> None:
        """Export ``model`` (the unwrapped trainable module) as a self-describing checkpoint."""

    # Optional hooks:
    # - ``param_groups()`` -> AdamW parameter groups, each with its own ``lr``, ``name`` and an
    #   optional ``start_step`` before which its learning rate stays 0 (e.g. Medusa-2's LoRA
    #   adapters wait for the heads to warm up). Without it every trainable parameter is one group.
    # - ``on_evaluate(metrics)``: the held-out metrics, summed over processes, after each evaluation.
    # - ``finalise_metrics(logs)``: derived values (e.g. perplexity) from the token-weighted means.
    # - ``on_progress(fraction)``: the share of the run done (:meth:`Trainer.progress`), before each
    #   training micro-batch, for losses on a schedule of their own (Domino's base-loss weight).
    # - ``state_dict()`` / ``load_state_dict(state)``: the task's own training state (a JSON-able dict,
    #   e.g. EAGLE-3's depth rates under ``depth_weighting: reach``), saved with every checkpoint.


@dataclass
class TrainState:
    """Where training stands (saved with every checkpoint)."""

    step: int = 0  # optimiser steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed
    tokens: int = 0  # loss tokens seen, summed over processes
    seconds: float = 0.0  # wall time spent in the training loop, over every resumed run
    task: dict = field(default_factory=dict)  # the task's state_dict(), where it has one


def _warmed(schedule, warmup: int, start: int = 0):
    """``schedule`` held at 0 until step ``start``, then warmed up over ``warmup`` optimiser steps
    counted from the first one: step ``start + s`` runs at (s + 1) / ``warmup`` of the schedule's
    level (Transformers' schedules run step 0 at learning rate 0, a wasted step)."""

    def factor(step: int) -> float:
        if step < start:
            return 0.0
        if step - start < warmup:
            return schedule(max(step, warmup)) * (step - start + 1) / warmup
        return schedule(step)

    return factor


def _normalise(totals: dict[str, float], prefix: str) -> dict[str, float]:
    """Token-weighted sums -> means. ``"X/name"`` divides by ``"X/tokens"`` when the task gives
    one (e.g. a Medusa head's own count of positions), everything else by ``"tokens"``."""
    tokens = max(totals.get("tokens", 1.0), 1.0)
    out = {}
    for key, value in totals.items():
        if key == "tokens" or key.endswith("/tokens"):
            continue
        group = key.rsplit("/", 1)[0] + "/tokens" if "/" in key else None
        out[f"{prefix}/{key}"] = value / max(totals[group], 1.0) if group in totals else value / tokens
    return out


def _param_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class Trainer:
    """Runs a :class:`TrainTask` under a recipe."""

    def __init__(self, recipe: Recipe, task: TrainTask, train_data, eval_data=None):
        # Recipes built in code may still say "auto": the run (and the recipe it saves) takes the choice.
        recipe = resolve_precision(recipe)
        self.recipe, self.task = recipe, task
        self.train_data, self.eval_data = train_data, eval_data
        self.output_dir = Path(recipe.training.output_dir)
        self.accelerator = make_accelerator(recipe)
        set_seed(recipe.training.seed)
        t = recipe.training
        self._lengths = sequence_lengths(train_data) if t.group_by_length or t.packing else None
        if t.packing and self._lengths is None:
            raise ValueError("training.packing needs tokenised rows (input_ids); this drafter's data has none")
        self.max_steps = t.max_steps or sum(self._steps_in_epoch(e) for e in range(t.num_epochs))
        if hasattr(task, "param_groups"):
            groups = [dict(g) for g in task.param_groups()]
        else:
            groups = [{"params": [p for p in task.model.parameters() if p.requires_grad]}]
        starts = [g.pop("start_step", 0) for g in groups]
        optimizer = torch.optim.AdamW(
            groups, lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay
        )
        schedule = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[t.lr_schedule]
        # Accelerate advances a prepared scheduler once per process at every optimiser step.
        world = self.accelerator.num_processes
        scheduler = get_scheduler(
            schedule, optimizer, num_warmup_steps=t.warmup_steps * world, num_training_steps=self.max_steps * world
        )
        self.state = TrainState()
        self._started = clock(self.accelerator.device)  # start of this invocation's loop (reset in train())
        warmup = t.warmup_steps * world
        factors = [_warmed(f, warmup, start * world) for f, start in zip(scheduler.lr_lambdas, starts)]
        self.budget = t.max_minutes * 60 if t.max_minutes else None
        if self.budget:  # the schedule runs to its end by the deadline, if that comes first
            factors = [self._timed(f, warmup) for f in factors]
        # A new scheduler, so that the first optimiser step already uses these factors.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
        # DeepSpeed reads the micro-batch size from a prepared dataloader; give it one.
        probe = epoch_loader(train_data, task.collate, recipe, 0, self._lengths)
        self.model, self.optimizer, self.scheduler, _ = self.accelerator.prepare(
            task.model, optimizer, scheduler, probe
        )
        self._pending_tokens = 0.0  # this process's loss tokens not yet summed into state.tokens
        self.history: list[dict] = []  # every logged metrics dict, with its step

    def _steps_in_epoch(self, epoch: int) -> int:
        """Optimiser steps of ``epoch``: per process (Accelerate evens batches out), and it also steps
        the optimiser at the end of every epoch, after a short last group of micro-batches: ceil, not
        floor. Packed epochs hold as many rows as their packing gives (it varies with the epoch)."""
        t = self.recipe.training
        items = len(epoch_items(self.train_data, self.recipe, epoch, self._lengths) if t.packing else self.train_data)
        micro_batches = math.ceil(items / t.batch_size / self.accelerator.num_processes)
        return math.ceil(micro_batches / t.gradient_accumulation_steps)

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, extra_state: dict | None = None) -> Path:
        """Write ``output_dir/name`` atomically: exported drafter + resumable state (plus
        ``extra_state`` in its ``trainer_state.json``)."""
        acc = self.accelerator
        final = self.output_dir / name
        tmp = staging_folder(final)
        if acc.is_main_process:
            begin_staging(tmp)
        acc.wait_for_everyone()
        self._count_tokens()
        if hasattr(self.task, "state_dict"):
            self.state.task = self.task.state_dict()
        acc.save_state(str(state_dir(tmp)))
        acc.wait_for_everyone()  # every rank writes its random_states_{i}.pkl last: all in tmp before the rename
        if acc.is_main_process:
            self.task.save_pretrained(acc.unwrap_model(self.model), tmp)
            (state_dir(tmp) / TRAINER_STATE).write_text(json.dumps({**self.state.__dict__, **(extra_state or {})}))
            dump_recipe(self.recipe, tmp / "recipe.yaml")
            publish(tmp, final)
            prune(self.output_dir, self.recipe.training.keep_checkpoints)
        acc.wait_for_everyone()
        return final

    def resume(self) -> bool:
        """Load the newest checkpoint under ``output_dir``; False when there is none."""
        newest = newest_checkpoint(self.output_dir)
        if newest is None:
            self._trim_log(0)  # killed before its first checkpoint: the rerun starts the log again
            return False
        self.state = TrainState(**load_state(self.accelerator, newest))
        if hasattr(self.task, "load_state_dict"):
            self.task.load_state_dict(self.state.task)
        self._trim_log(self.state.step)
        self.accelerator.print(f"resumed from {newest} at step {self.state.step}")
        return True

    def _trim_log(self, step: int) -> None:
        """Drop ``log_history.jsonl``'s lines past ``step`` (and a line the interruption cut short):
        the resumed run logs those steps again, so the log reads as one uninterrupted run's."""
        log = self.output_dir / LOG_HISTORY
        if not self.accelerator.is_main_process or not log.is_file():
            return
        kept = []
        for line in log.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line + "\n")
            except json.JSONDecodeError:
                continue
        with staged(log) as tmp:
            tmp.write_text("".join(kept))

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted held-out metrics, prefixed ``eval/``."""
        if not self.eval_data or len(self.eval_data) == 0:
            return {}
        self.model.eval()
        loader = self.accelerator.prepare(
            DataLoader(self.eval_data, batch_size=self.recipe.training.batch_size, collate_fn=self.task.collate)
        )
        totals: dict[str, float] = {}
        for batch in loader:
            with self.accelerator.autocast():
                _, metrics = self.task.loss(self.model, batch, training=False)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        self.model.train()
        return self._finalise(_normalise(self._sum_over_processes(totals), "eval"))

    # -- the loop --------------------------------------------------------------------------------
    def train(self, resume: bool = False) -> Path:
        """Train to ``max_steps`` (or ``stop_after_steps``); returns the last checkpoint written."""
        acc, t = self.accelerator, self.recipe.training
        if resume:
            self.resume()
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if not resume:  # a fresh run in a reused folder starts its own log
                (self.output_dir / LOG_HISTORY).unlink(missing_ok=True)
        start_tracker(acc, self.recipe)
        stop_at = min(self.max_steps, t.stop_after_steps or self.max_steps)
        window: dict[str, float] = {}
        window_start = clock(acc.device)
        last_saved: Path | None = None
        self.model.train()
        bar = self._progress_bar(stop_at)
        self._started, out_of_time = clock(acc.device), False
        while self.state.step < stop_at and not out_of_time:
            loader = acc.prepare(
                epoch_loader(self.train_data, self.task.collate, self.recipe, self.state.epoch, self._lengths)
            )
            micro_batches = len(loader)
            if self.state.batches_in_epoch:
                loader = acc.skip_first_batches(loader, self.state.batches_in_epoch)
            for batch in loader:
                if hasattr(self.task, "on_progress"):
                    self.task.on_progress(self.progress())
                with acc.accumulate(self.model):
                    # The whole loss under the recipe's autocast, not only the head's forward (which is
                    # all Accelerate wraps): the draft and target LM heads the loss applies after the
                    # forward would otherwise run in fp32 (the objectives keep their own maths in fp32).
                    with acc.autocast():
                        loss, metrics = self.task.loss(self.model, batch, training=True)
                    acc.backward(loss * self._group_scale(self.state.batches_in_epoch, micro_batches))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()  # a no-op between accumulation boundaries
                    self.optimizer.zero_grad()
                self.state.batches_in_epoch += 1
                self._pending_tokens += metrics.get("tokens", 0.0)
                for key, value in metrics.items():
                    window[key] = window.get(key, 0.0) + value
                if not acc.sync_gradients:
                    continue
                self.state.step += 1
                used = self._budget_used()
                out_of_time = used is not None and used >= self.budget
                self._advance(bar, used, stop_at)
                if self.state.step % t.log_every == 0 or self.state.step == stop_at or out_of_time:
                    self._log(window, clock(acc.device) - window_start)
                    window, window_start = {}, clock(acc.device)
                if t.eval_every and self.state.step % t.eval_every == 0:
                    self._log_eval()
                if t.save_every and self.state.step % t.save_every == 0 and self.state.step < self.max_steps:
                    last_saved = self.save(f"checkpoint-{self.state.step}")
                if self.state.step >= stop_at or out_of_time:
                    break
            else:
                self.state.epoch += 1
                self.state.batches_in_epoch = 0
        if self.budget and not out_of_time:  # the steps ran out before the deadline: the bar ends here too
            bar.total = bar.n
        bar.close()
        self.state.seconds = self._elapsed()
        self._started = clock(acc.device)  # what follows (the final evaluation) counts on from state.seconds
        if out_of_time:
            acc.print(
                f"training.max_minutes={t.max_minutes} reached at step {self.state.step} of {self.max_steps}: "
                "the learning-rate schedule ran to its end by then; finishing"
            )
        if self.state.step >= self.max_steps or out_of_time:
            if not (t.eval_every and self.state.step % t.eval_every == 0):
                self._log_eval()
            last_saved = self.save(FINAL, self._replica_checksums())
        elif last_saved is None or not last_saved.name.endswith(f"-{self.state.step}"):
            last_saved = self.save(f"checkpoint-{self.state.step}")
        acc.end_training()
        return last_saved

    def progress(self) -> float:
        """The share of the run done, as the learning-rate schedule counts it: the later of the
        optimiser steps' share of ``max_steps`` and of ``training.max_minutes`` used."""
        done = self.state.step / max(self.max_steps, 1)
        if self.budget:
            done = max(done, self._elapsed() / self.budget)
        return min(done, 1.0)

    def _elapsed(self) -> float:
        """Seconds in the training loop so far, earlier (resumed) runs included."""
        return self.state.seconds + clock(self.accelerator.device) - self._started

    def _timed(self, factor, warmup: int):
        """``factor`` of the schedule, warmed up over the first ``warmup`` real steps whatever the
        clock says (a slow first step must not skip the warm-up), then decayed at the later of the
        step count and the share of ``training.max_minutes`` used, so that it ends by the deadline
        (scheduler steps count once per process)."""
        total = self.max_steps * self.accelerator.num_processes

        def timed(step: int) -> float:
            if step < warmup:
                return factor(step)
            by_time = warmup + int((total - warmup) * self._elapsed() / self.budget)
            return factor(max(step, min(total, by_time)))

        return timed

    def _budget_used(self) -> float | None:
        """Seconds of ``training.max_minutes`` used, by the slowest process so that all stop together
        (None without a budget)."""
        if not self.budget:
            return None
        elapsed = torch.tensor([self._elapsed()], device=self.accelerator.device)
        return float(self.accelerator.reduce(elapsed, "max"))

    def _progress_bar(self, stop_at: int) -> tqdm:
        """A bar over the steps to ``stop_at``; under ``training.max_minutes`` over the time budget in
        seconds instead, with the step count beside it: the deadline, not the step count, usually ends
        such a run, and a step bar would stop far short of its end with a remaining time past the deadline."""
        disable = not self.accelerator.is_local_main_process
        if not self.budget:
            return tqdm(total=stop_at, initial=self.state.step, desc="train", disable=disable)
        bar = tqdm(
            total=self.budget,
            initial=min(self.state.seconds, self.budget),
            desc="train",
            disable=disable,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of training.max_minutes{postfix}",
        )
        bar.set_postfix_str(f"step {self.state.step} (at most {stop_at})", refresh=False)
        return bar

    def _advance(self, bar: tqdm, used: float | None, stop_at: int) -> None:
        """Move the bar on by the step just taken, or to the ``used`` seconds of the time budget."""
        if used is None:
            bar.update()
            return
        bar.set_postfix_str(f"step {self.state.step} (at most {stop_at})", refresh=False)
        bar.update(min(used, self.budget) - bar.n)

    def _group_scale(self, batch: int, micro_batches: int) -> float:
        """Loss factor for micro-batch ``batch`` of an epoch of ``micro_batches``: Accelerate and
        DeepSpeed divide every loss by the accumulation steps k, so a last group of r < k
        micro-batches needs k / r for its step to average its micro-batches like a full one."""
        k = self.recipe.training.gradient_accumulation_steps
        group = min(k, micro_batches - batch // k * k)
        return k / group if group < k else 1.0

    def _count_tokens(self) -> None:
        """Add every process's loss tokens since the last call to ``state.tokens``."""
        self.state.tokens += int(self._sum_over_processes({"tokens": self._pending_tokens})["tokens"])
        self._pending_tokens = 0.0

    def _sum_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        summed = self.accelerator.reduce(torch.tensor([values[k] for k in keys], device=self.accelerator.device), "sum")
        return dict(zip(keys, summed.tolist()))

    def _finalise(self, logs: dict[str, float]) -> dict[str, float]:
        return self.task.finalise_metrics(logs) if hasattr(self.task, "finalise_metrics") else logs

    def _log_eval(self) -> None:
        metrics = self.evaluate()
        if metrics:
            if hasattr(self.task, "on_evaluate"):  # e.g. Medusa heads record their accuracy in checkpoints
                self.task.on_evaluate(metrics)
            self.accelerator.log(metrics, step=self.state.step)
            self._count_tokens()
            entry = {"step": self.state.step, "tokens_seen": self.state.tokens, "seconds": self._elapsed()}
            self._record({**entry, **metrics})
            if self.accelerator.is_main_process:
                tqdm.write(f"step {self.state.step} held-out: { {k: round(v, 4) for k, v in metrics.items()} }")

    def _log(self, window: dict[str, float], seconds: float) -> None:
        totals = self._sum_over_processes(window)
        logs = self._finalise(_normalise(totals, "train"))
        logs["train/tokens_per_second"] = totals.get("tokens", 0.0) / max(seconds, 1e-9)
        rates = self.scheduler.get_last_lr()
        logs["train/lr"] = rates[0]
        for group, rate in zip(self.optimizer.param_groups[1:], rates[1:]):
            logs[f"train/lr_{group.get('name', 'group')}"] = rate
        logs["train/epoch"] = self.state.epoch
        self._count_tokens()
        logs["train/tokens_seen"] = self.state.tokens
        self.accelerator.log(logs, step=self.state.step)
        self._record({"step": self.state.step, **logs})
        if self.accelerator.is_main_process:
            shown = {k.removeprefix("train/"): float(f"{v:.4g}") for k, v in logs.items()}  # small lrs stay visible
            tqdm.write(f"step {self.state.step}: {shown}")

    def _record(self, entry: dict) -> None:
        """Keep a logged metrics dict in ``history`` and append it to ``OUTPUT_DIR/log_history.jsonl``
        (HF Trainer's ``log_history``, one line per log: learning curves without a tracker; a resumed
        run appends, so the last line of a step wins)."""
        self.history.append(entry)
        if self.accelerator.is_main_process:
            with open(self.output_dir / LOG_HISTORY, "a") as log:
                log.write(json.dumps(entry) + "\n")

    def _replica_checksums(self) -> dict:
        """Every process's parameter checksum (``replica_checksums``, recorded in the final
        checkpoint's state): replicas must agree after training."""
        if self.recipe.distributed.backend == "deepspeed" and self.recipe.distributed.zero_stage == 3:
            return {}  # parameters are partitioned; each rank holds a different shard
        local = torch.tensor(
            [_param_checksum(self.accelerator.unwrap_model(self.model))],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        return {"replica_checksums": self.accelerator.gather(local).tolist()}
