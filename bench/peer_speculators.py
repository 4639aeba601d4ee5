"""speculators 0.9's own trainer (``speculators train``) on a CPU, for a wall-clock budget.

    python bench/peer_speculators.py --minutes 10 --summary OUT/summary.json -- SPECULATORS TRAIN ARGS...

Everything after ``--`` goes to speculators' own argument parser (``TrainConfig.resolve``) and its
``speculators.train.cli.main`` runs unchanged; nothing of its code is copied. Its settings make it
CPU-friendly where it has one: ``--draft-attn-impl sdpa`` (flex attention needs a GPU),
``--loss-implementation eager`` (its default, ``fused``, is a Triton kernel: on a CPU, "0 active drivers"),
``--num-workers 0``, ``--hidden-states-dtype`` bfloat16 or float32, ``--on-missing raise`` (no
vLLM endpoint: the features are precomputed). Single process: without ``LOCAL_RANK`` in the
environment speculators never initialises a process group (no gloo needed), and its
``torch.compile`` is CUDA-only already (``conditional_torch_compile``). What a setting cannot reach
is patched at run time, in this process only:

- ``torch.accelerator.synchronize`` is a no-op where there is no accelerator (its step timer calls it
  every ``--log-freq`` steps; torch 2.13 raises "Cannot access accelerator device" on a CPU);
- the trainer's device is ``cpu``: ``speculators.train.trainer.get_local_rank`` gives ``"cpu"``
  (it moves the model to ``local_rank``, 0, which torch 2.13 reads as an accelerator index) and
  ``Trainer.device_type`` is ``cpu`` (it autocasts on ``"cuda"`` when no accelerator is found);
- the wall-clock budget: ``Trainer.train_epoch`` gets a step callback that stops training once the
  seconds inside its training loops (data loading included, validation and checkpoints not) reach
  ``--minutes``; the model is then saved by speculators' own checkpointer as ``SAVE_PATH/final``
  (bf16, its ``save_pretrained`` folder: the format vLLM serves);
- the learning-rate schedule follows the clock as draftsmith's ``training.max_minutes`` does: linear
  warm-up over ``--warmup-steps`` optimiser steps, then linear decay reaching 0 at the deadline (its
  own linear schedule needs a step count, unknown for a time budget);
- its per-epoch validation is skipped (``bench/peer_trainers.py`` measures held-out accuracy of both
  trainers' heads with one evaluator).

The summary JSON: optimiser steps, seconds in the training loop, sequences, tokens and supervised
tokens seen, the saved folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.timing import clock


class OutOfTime(Exception):
    """The budget is spent (raised after an optimiser step)."""


def _patch(budget_seconds: float, warmup_steps: int, tally: dict) -> dict:
    """Apply the run-time patches; returns a dict that will hold the trainer once it is built."""
    import speculators.train.trainer as trainer_module
    from speculators.train.data import CollateFn

    held: dict = {}
    if not torch.accelerator.is_available():
        real_sync = torch.accelerator.synchronize

        def synchronize(*args, **kwargs):
            if torch.accelerator.is_available():
                return real_sync(*args, **kwargs)
            return None

        torch.accelerator.synchronize = synchronize
        trainer_module.get_local_rank = lambda: "cpu"

    trainer_class = trainer_module.Trainer
    real_init, real_train_epoch = trainer_class.__init__, trainer_class.train_epoch

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if not torch.accelerator.is_available():
            self.device_type = "cpu"
        held["trainer"] = self

        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            return max(0.0, 1.0 - tally["seconds_now"]() / budget_seconds)

        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in self.optimizers]

    def train_epoch(self, epoch, *, step_callback=None):
        began = clock()
        spent = tally["seconds"]
        tally["seconds_now"] = lambda: spent + clock() - began

        def on_step():
            tally["steps"] += 1
            if step_callback is not None:
                step_callback()
            if tally["seconds_now"]() >= budget_seconds:
                raise OutOfTime

        try:
            real_train_epoch(self, epoch, step_callback=on_step)
        finally:
            tally["seconds"] = spent + clock() - began
            tally["seconds_now"] = lambda: tally["seconds"]

    def val_epoch(self, epoch):
        return None

    trainer_class.__init__ = init
    trainer_class.train_epoch = train_epoch
    trainer_class.val_epoch = val_epoch

    real_collate = CollateFn.__call__

    def collate(self, batch):
        out = real_collate(self, batch)
        # Counted for what the trainer steps on: batches collated after the deadline are never stepped.
        tally["pending"] = {
            "sequences": int(out["document_ids"].max()) + 1,
            "tokens": int((out["document_ids"] != -1).sum()),
            "supervised": int(out["loss_mask"].sum()) if "loss_mask" in out else 0,
        }
        return out

    CollateFn.__call__ = collate
    return held


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="wall-clock budget of the training loop")
    parser.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up (optimiser steps)")
    parser.add_argument("--summary", required=True, help="JSON file written at the end")
    args = parser.parse_args(own)

    from speculators.train import cli
    from speculators.train.config import TrainConfig

    tally = {"steps": 0, "seconds": 0.0, "sequences": 0, "tokens": 0, "supervised": 0}
    tally["seconds_now"] = lambda: tally["seconds"]
    held = _patch(args.minutes * 60, args.warmup_steps, tally)

    # Count what each stepped batch held: the collate function records it, the step callback adds it.
    import speculators.train.trainer as trainer_module

    real_step = trainer_module.Trainer._optimizers_step

    def step(self):
        real_step(self)
        for key, value in tally.pop("pending", {}).items():
            tally[key] += value

    trainer_module.Trainer._optimizers_step = step

    cfg = TrainConfig.resolve(theirs)
    stopped_by = "epochs"
    try:
        cli.main(cfg)
    except OutOfTime:
        stopped_by = "budget"
    trainer = held["trainer"]
    trainer.checkpointer.save_checkpoint(trainer.model, trainer.optimizers, "final")
    summary = {
        "steps": tally["steps"],
        "seconds": round(tally["seconds"], 1),
        "sequences": tally["sequences"],
        "tokens": tally["tokens"],
        "supervised_tokens": tally["supervised"],
        "stopped_by": stopped_by,
        "saved": str(Path(cfg.trainer.save_path) / "final"),
        "threads": torch.get_num_threads(),
        "argv": theirs,
    }
    Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
    Path(args.summary).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
