"""Hybrid drafting: a lookup drafter's and a learned drafter's candidates in one verification tree
(``hybrid:eagle3:PATH+suffix``); nothing of its own to train or export."""

from __future__ import annotations

from draftsmith.eval.engine.drafters import hybrid
from draftsmith.kinds import COUNT, DrafterKind, Option

KIND = DrafterKind(
    name="hybrid",
    summary="one tree from several drafters, e.g. a trained head and suffix lookup: nodes ranked by their "
    "estimated acceptance share the budget; mode=switch skips the learned drafter when the lookup is confident",
    build=hybrid.build,
    path="SPEC+SPEC[+...]: the parts, each a drafter spec; put a part with options in parentheses, "
    "e.g. hybrid:(eagle3:PATH?depth=4)+suffix?budget=12",
    options={
        "budget": Option(16, "tree nodes verified per step, shared by the parts", COUNT),
        "mode": Option(
            "merge",
            "merge: every part drafts every step; switch: the learned parts draft only in steps where the "
            "lookup expects fewer tokens than they have yielded per step (Arctic's per-step choice)",
        ),
    },
)
