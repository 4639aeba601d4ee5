"""Hybrid drafting: a lookup drafter's and a learned drafter's candidates in one verification tree
(``hybrid:eagle3:PATH+suffix``); nothing of its own to train or export."""

from __future__ import annotations

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import hybrid
from draftsmith.kinds import DrafterKind, Option

KIND = DrafterKind(
    name="hybrid",
    summary="one tree from several drafters, e.g. a trained head and suffix lookup: nodes ranked by their "
    "estimated acceptance (calibrated by the acceptance measured per depth), as many as pay for their "
    "verification cost; mode=switch skips the learned drafter, before it drafts, where the lookup alone "
    "is expected to be faster",
    build=hybrid.build,
    path="SPEC+SPEC[+...]: the parts, each a drafter spec; put a part with options in parentheses, "
    "e.g. hybrid:(eagle3:PATH?depth=4)+suffix?budget=12",
    options={
        "budget": Option(hybrid.BUDGET, "most tree nodes verified per step, shared by the parts", COUNT),
        "mode": Option(
            "switch",
            "switch: decided before they draft, the learned parts draft only where what they measurably add over "
            "the lookup's tree pays for their drafting and the larger pass (Arctic's per-step choice); merge: every "
            "part drafts every step",
        ),
        "nodes": Option(
            "priced",
            "priced: verify as many of the best nodes as pay for their place in the pass (pass costs measured "
            "on the target's device); budget: always fill the budget",
        ),
        "estimates": Option(
            "measured",
            "measured: a scored part's node estimates calibrated per depth by the acceptance measured so far; "
            "claimed: the parts' own scores",
        ),
        "probe": Option(
            8,
            "switch mode: skipped steps of one kind in a row before the learned parts draft again to measure "
            "(doubles per lost probe, at most 64)",
            COUNT,
        ),
    },
)
