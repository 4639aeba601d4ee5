"""The ``adapt`` recipe: which head, which traffic, how each round trains, judges and publishes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from draftsmith.config import COUNT, FRACTION, NON_NEGATIVE_INT, POSITIVE, Range

PLANNED = "planned"  # adapt.judge_drafter: each head judged with the tree planned for it


@dataclass
class AdaptConfig:
    """One adaptation loop: the deployed head, the traffic it learns from, and each round's budget and bar."""

    head: str = ""  # the deployed head's training checkpoint (its recipe.yaml names the target and replay data)
    traffic: str = ""  # a capture store (eval/run.py --capture DIR), or a gateway's or vLLM's request log
    served_model: str = ""  # the model name a request log's requests must name to be trained on ("": any)
    out_dir: str = "runs/adapt"  # rounds/round-NNNN/, the `current` link to the serving head, state.json
    # share of a round's rows replayed from the head's own data (not to forget)
    replay_fraction: Annotated[float, FRACTION] = 0.3
    # conversations of the head's data whose features are extracted once for replay
    replay_limit: Annotated[int, NON_NEGATIVE_INT] = 512
    # conversations judged per round: the newest begun since the last round; never trained on
    held_out: Annotated[int, COUNT] = 16
    # Fewer held-out conversations than this: the round is not judged (nor run); at most adapt.held_out
    # (null: adapt.held_out). Below 16 the judge's bootstrap is too sure of a few requests: over 50 seeds
    # of bench/adapt_false_promotion.py, 3 seeds' promotions judged on 8 gained nothing on fresh
    # requests, none of those judged on 16 (BENCHMARKS.md, the judge's controls).
    min_held_out: Annotated[int, Range(2, integer=True)] | None = None
    # the head's own held-out conversations: its top-1 there is the forgetting check (0: unchecked)
    general_held_out: Annotated[int, NON_NEGATIVE_INT] = 64
    # most depth-1 top-1 the challenger may lose there (null: unchecked; below 0: it must gain that much)
    max_forgetting: Annotated[float, Range()] | None = 0.02
    round_steps: Annotated[int, COUNT] = 60  # optimiser steps per round
    round_minutes: Annotated[float, POSITIVE] | None = None  # wall-clock budget per round (whichever comes first)
    learning_rate: Annotated[float, POSITIVE] = 3e-4  # peak; warm-up-free linear decay over the round
    # Loss weight of the reply positions where the served draft was rejected (the target's correction
    # tokens, recorded by the capture store): w there, 1 at every other supervised token, and each depth's
    # loss the weighted mean sum(w_t * loss_t) / sum(w_t) over its scored tokens, so the loss keeps its
    # scale. 1: uniform (exactly the unweighted loss); a large w nears Online Speculative Decoding's loss
    # on the rejected positions alone. Traffic without the record (request logs, older stores) and
    # replayed rows weigh 1. EAGLE-3 and P-EAGLE heads (the kinds that adapt).
    rejected_weight: Annotated[float, Range(1)] = 1.0
    batch_size: Annotated[int, COUNT] = 4  # feature rows per optimiser step
    max_length: Annotated[int, COUNT] = 1024  # tokens of a request trained on (longer ones are cut)
    judge_max_new_tokens: Annotated[int, COUNT] = 64  # tokens generated per held-out request when judging
    judge_drafter: str = "depth=3&top_k=1&budget=3"  # both heads' tree: drafter options (vLLM's chain of 3), or planned
    # promote when the acceptance-length gain is at least this (at the confidence below); below 0, a loss that small
    # still promotes
    margin: Annotated[float, Range()] = 0.05
    # one-sided, paired bootstrap over the held-out requests
    confidence: Annotated[float, Range(0.5, 1, open_high=True)] = 0.9
    export_format: str = "speculators"  # the format a promoted head is exported in ("none": the checkpoint alone)
    seed: Annotated[int, NON_NEGATIVE_INT] = 0  # replay sampling and the judge's bootstrap (round n uses seed + n)

    @property
    def judged_at_least(self) -> int:
        """Held-out conversations a round needs to be judged: ``min_held_out``, else ``held_out``."""
        return self.held_out if self.min_held_out is None else self.min_held_out

    def validate(self) -> None:
        if not self.head:
            raise ValueError("adapt.head must name the deployed head's checkpoint folder")
        if not self.traffic:
            raise ValueError("adapt.traffic must name the captured traffic store (eval/run.py --capture DIR)")
        if self.min_held_out is not None and self.min_held_out > self.held_out:
            raise ValueError(
                f"adapt.min_held_out must be in [2, adapt.held_out={self.held_out}], got {self.min_held_out}"
            )
        if not self.judge_drafter:
            raise ValueError(
                f'adapt.judge_drafter is empty: give drafter options (e.g. "depth=3&top_k=1&budget=3") or "{PLANNED}"'
            )


@dataclass
class AdaptRecipe:
    """An adaptation recipe: its ``adapt`` section (rounds train without a tracker: their records go to state.json)."""

    adapt: AdaptConfig = field(default_factory=AdaptConfig)
