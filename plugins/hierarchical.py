"""HSDDW hierarchical drafting over two draft LMs; trained as two ``distill`` students, nothing of its own to export."""

from __future__ import annotations

from draftsmith.config import COUNT, POSITIVE
from draftsmith.eval.engine.drafters import hierarchical
from draftsmith.eval.engine.policies import DEFAULT_ENTROPY_TAU
from draftsmith.kinds import DrafterKind, Option

LAYERS = "evenly spaced target layers, or indices like 0,1,2,29"

KIND = DrafterKind(
    name="hierarchical",
    summary="HSDDW hierarchical drafting: draft LM M1 drafts under its entropy rule, a stronger draft LM M2 "
    "pre-verifies its tokens, the target verifies what M2 kept",
    build=hierarchical.build,
    options={
        "m1": Option(
            None,
            "M1: hub id or folder of a draft LM (e.g. a train/distill.py checkpoint); default: cut from the target",
        ),
        "m2": Option(None, "M2: as m1, the stronger one"),
        "vocab": Option(
            None, "with m1=/m2= distill checkpoints: each drafts over its N most frequent training tokens", COUNT
        ),
        "m1_layers": Option(
            hierarchical.DEFAULT_LAYERS["m1"], f"without m1: M1 is this many {LAYERS}", COUNT, text=True
        ),
        "m2_layers": Option(
            hierarchical.DEFAULT_LAYERS["m2"], f"without m2: M2 is this many {LAYERS}", COUNT, text=True
        ),
        "depth": Option(8, "most tokens sent to the target per step", COUNT),
        "m1_depth": Option(4, "most tokens M1 drafts before M2 pre-verifies them", COUNT),
        "m1_tau": Option(
            DEFAULT_ENTROPY_TAU,
            "M1's initial entropy threshold (nats; then the mean M1 entropy of M2's rejections and M1's declines)",
            POSITIVE,
        ),
        "m2_tau": Option(
            DEFAULT_ENTROPY_TAU,
            "M2's initial entropy threshold (nats; then the mean M2 entropy of the target's "
            "rejections and M2's declines)",
            POSITIVE,
        ),
    },
    entropy_note="the hierarchical drafter has its own entropy rules; set m1_tau= and m2_tau=",
    builds_on=("draft_lm",),  # M1 and M2 are draft LMs
)
