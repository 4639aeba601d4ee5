"""The oracle: the target's own greedy continuation, the engine's ceiling (a diagnostic)."""

from __future__ import annotations

from draftsmith.config import COUNT
from draftsmith.eval.engine.drafters import oracle
from draftsmith.kinds import DrafterKind, Option

KIND = DrafterKind(
    name="oracle",
    summary="the target's own greedy continuation: the engine's ceiling (diagnostic)",
    build=oracle.build,
    options={"num_tokens": Option(8, "tokens drafted per step", COUNT)},
)
