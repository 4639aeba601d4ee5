"""A head that learns between requests: ``eval/run.py --adapt EVERY`` runs the prompts as a stream.

Each request is decoded by the head (its tree as planned) with the sampling asked for (greedy by
default; request ``i`` seeded ``seed + i``), and its tokens and the target's states, captured by the
engine as it decodes, go into a traffic store. After every ``EVERY`` requests the head trains for a
bounded number of steps on the requests captured so far (its own task and loop, the learning rate
of ``adapt``, one optimiser whose moments carry from round to round, starting from the checkpoint's
own; ``adapt.rejected_weight`` weighs the positions where the head's drafts were rejected), and the
next requests are drafted by the updated weights. The acceptance length per window
of the stream is the learning curve. On a GPU the rounds could overlap decoding; here they run
between requests, and their wall time is reported.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.rounds import adaptable_kind, carry_optimizer, round_trainer, saved_optimizer
from draftsmith.adapt.weights import weighted
from draftsmith.data_prep.features import FeatureDataset, RowSelection
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.timing import clock


@dataclass
class StreamRequest:
    """One request of the stream: how it decoded, and the training before it."""

    index: int
    tokens: int
    passes: int
    seconds: float
    rounds_before: int  # training rounds the head had had when it drafted this request
    train_seconds: float  # the round that ran right after it (0 if none)


def adapt_stream(
    target,
    target_name: str,
    tokenizer,
    drafter,
    checkpoint: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    every: int,
    cfg: AdaptConfig,
    store_dir: str | Path | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
) -> list[StreamRequest]:
    """Decode ``prompts`` in order with ``drafter`` (a head of an adaptable kind loaded from
    ``checkpoint``) under ``sampling``, training its head after every ``every`` requests on what was captured."""
    kind, _ = adaptable_kind(checkpoint, "--adapt: --drafter")
    head = getattr(drafter, "head", None)
    if head is None:
        raise UsageError(f"--adapt: --drafter {drafter.name} has no trained head to adapt")
    master = head
    if any(p.dtype != torch.float32 for p in head.parameters()):
        # fp32 weights to train, read from the checkpoint (a deep copy of the head would copy the target
        # it is bound to); the drafter's head serves in the target's dtype and takes them after each round.
        master = kind.training.task.head_class.from_pretrained(checkpoint, target).float()
    folder = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="draftsmith-stream-"))
    store = TrafficStore.for_target(folder, target, tokenizer, target_name, drafter.feature_layers, shard_size=every)
    decoder = SpeculativeDecoder(target, drafter, tokenizer, sampling=sampling, capture=store)
    results, rounds, optimizer = [], 0, saved_optimizer(checkpoint)
    with store:  # closed on the way out, an error's too: what was served is on disk and free for a round
        for index, prompt in enumerate(prompts):
            before = rounds
            gen = decoder.generate(prompt, max_new_tokens, seed=seed + index)
            spent = 0.0
            if cfg.round_steps and (index + 1) % every == 0 and index + 1 < len(prompts):
                began = clock(target.device)
                rounds += 1
                optimizer = _train_round(kind, checkpoint, cfg, target, head, master, store, rounds, optimizer)
                spent = clock(target.device) - began
            results.append(StreamRequest(index, sum(gen.accepted), gen.steps, gen.seconds, before, spent))
    return results


def _train_round(kind, checkpoint: str, cfg: AdaptConfig, target, head, master, store, number: int, optimizer):
    """Round ``number``: train ``master`` (the fp32 weights, or ``head`` itself) on every request ``store``
    holds, its optimiser's moments carried in and returned; the serving ``head`` takes the new weights."""
    store.flush()
    rows = FeatureDataset(store.root / "train")
    trainer = round_trainer(
        kind,
        Path(checkpoint),
        cfg,
        target,
        master,
        weighted(RowSelection([(rows, i) for i in range(len(rows))], cfg.max_length), cfg.rejected_weight),
        None,
        store.root / f"round-{number}",
    )
    carry_optimizer(trainer, optimizer)
    trainer.train()
    if master is not head:
        with torch.no_grad():
            for mine, trained in zip(head.parameters(), master.parameters()):
                mine.copy_(trained)
    return trainer.optimizer.state_dict()


def window_table(requests: list[StreamRequest], window: int) -> str:
    """The learning curve: acceptance length and tokens per second per window of the stream."""
    lines = ["| requests | head rounds | accept len | tok/s | training s after |", "|---|---|---|---|---|"]
    for start in range(0, len(requests), window):
        part = requests[start : start + window]
        tau = sum(r.tokens for r in part) / max(1, sum(r.passes for r in part))
        rate = sum(r.tokens for r in part) / max(1e-9, sum(r.seconds for r in part))
        lines.append(
            f"| {start + 1}-{start + len(part)} | {part[0].rounds_before} | {tau:.2f} | {rate:.1f} | "
            f"{sum(r.train_seconds for r in part):.1f} |"
        )
    return "\n".join(lines)
