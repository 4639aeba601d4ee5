"""The ``adapt`` recipe: which head, which traffic, how each round trains, judges and publishes."""

from __future__ import annotations

from dataclasses import dataclass, field

PLANNED = "planned"  # adapt.judge_drafter: each head judged with the tree planned for it


@dataclass
class AdaptConfig:
    """One adaptation loop: the deployed head, the traffic it learns from, and each round's budget and bar."""

    head: str = ""  # the deployed head's training checkpoint (its recipe.yaml names the target and replay data)
    traffic: str = ""  # a capture store (eval/run.py --capture DIR), or a gateway's or vLLM's request log
    served_model: str = ""  # the model name a request log's requests must name to be trained on ("": any)
    out_dir: str = "runs/adapt"  # rounds/round-NNNN/, the `current` link to the serving head, state.json
    replay_fraction: float = 0.3  # share of a round's rows replayed from the head's own data (not to forget)
    replay_limit: int = 512  # conversations of the head's data whose features are extracted once for replay
    held_out: int = 16  # conversations judged per round: the newest begun since the last round; never trained on
    min_held_out: int = 8  # fewer held-out conversations than this: the round is not judged (nor run)
    general_held_out: int = 64  # the head's own held-out conversations: its top-1 there is the forgetting check
    max_forgetting: float | None = 0.02  # most depth-1 top-1 the challenger may lose there (null: unchecked)
    round_steps: int = 60  # optimiser steps per round
    round_minutes: float | None = None  # wall-clock budget per round (whichever comes first)
    learning_rate: float = 3e-4  # peak; warm-up-free linear decay over the round
    # Loss weight of the reply positions where the served draft was rejected (the target's correction
    # tokens, recorded by the capture store): w there, 1 at every other supervised token, and each depth's
    # loss the weighted mean sum(w_t * loss_t) / sum(w_t) over its scored tokens, so the loss keeps its
    # scale. 1: uniform (exactly the unweighted loss); a large w nears Online Speculative Decoding's loss
    # on the rejected positions alone. Traffic without the record (request logs, older stores) and
    # replayed rows weigh 1. EAGLE-3 and P-EAGLE heads (the kinds that adapt).
    rejected_weight: float = 1.0
    batch_size: int = 4  # feature rows per optimiser step
    max_length: int = 1024  # tokens of a request trained on (longer ones are cut)
    judge_max_new_tokens: int = 64  # tokens generated per held-out request when judging
    judge_drafter: str = "depth=3&top_k=1&budget=3"  # both heads' tree: drafter options (vLLM's chain of 3), or planned
    margin: float = 0.05  # promote when the acceptance-length gain is at least this (at the confidence below)
    confidence: float = 0.9  # one-sided, paired bootstrap over the held-out requests
    export_format: str = "speculators"  # the format a promoted head is exported in ("none": the checkpoint alone)
    seed: int = 0  # replay sampling and the judge's bootstrap (round n uses seed + n)

    def validate(self) -> None:
        if not self.head:
            raise ValueError("adapt.head must name the deployed head's checkpoint folder")
        if not self.traffic:
            raise ValueError("adapt.traffic must name the captured traffic store (eval/run.py --capture DIR)")
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(f"adapt.replay_fraction must be in [0, 1), got {self.replay_fraction}")
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"adapt.confidence must be in [0.5, 1), got {self.confidence}")
        for name in ("held_out", "round_steps", "batch_size", "judge_max_new_tokens", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"adapt.{name} must be >= 1, got {getattr(self, name)}")
        if not 2 <= self.min_held_out <= self.held_out:
            raise ValueError(
                f"adapt.min_held_out must be in [2, adapt.held_out={self.held_out}], got {self.min_held_out}"
            )
        if not self.judge_drafter:
            raise ValueError(
                f'adapt.judge_drafter is empty: give drafter options (e.g. "depth=3&top_k=1&budget=3") or "{PLANNED}"'
            )
        if not self.rejected_weight >= 1:  # also refuses NaN
            raise ValueError(f"adapt.rejected_weight must be >= 1 (1: uniform), got {self.rejected_weight}")
        if self.replay_limit < 0:
            raise ValueError(f"adapt.replay_limit must be >= 0, got {self.replay_limit}")
        if self.round_minutes is not None and self.round_minutes <= 0:
            raise ValueError(f"adapt.round_minutes must be positive, got {self.round_minutes}")


@dataclass
class AdaptRecipe:
    """An adaptation recipe: its ``adapt`` section (rounds train without a tracker: their records go to state.json)."""

    adapt: AdaptConfig = field(default_factory=AdaptConfig)
