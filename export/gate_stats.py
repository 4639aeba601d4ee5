"""The gate's verdict on acceptance counts: does vLLM accept the export's drafts as often as draftsmith
accepts the training checkpoint's?

Per draft position the evidence is two counts on each side: drafts that reached the position and
drafts accepted at least that far. A position **fails** when the two acceptance rates differ by
more than a practical margin *and* Fisher's exact test calls the difference clear
(two-sided p < :data:`ALPHA`); it **passes** when the rates are within the margin, however many
prompts were run, so bf16 rounding never fails a good export on a long
run; a difference beyond the margin that the counts cannot confirm is **inconclusive**.

The margin is relative at low rates (:data:`RELATIVE_MARGIN` of the larger rate) between a floor
and a cap (:data:`MARGIN_FLOOR`, :data:`MARGIN_CAP`): an absolute 0.03 alone let a weak head's
export that vLLM never accepted (0 of 350 against our 10 of 350) pass.

A weak head can pass every position and still prove nothing: when even an export that vLLM never
accepts at position 1 would not have failed there, the gate as a whole is inconclusive, and says
how many prompts would have decided it (or that no number would, the head being too weak).

Fisher's test treats drafts as independent trials. They are not quite (drafts of one prompt share
its text), so :data:`ALPHA` is kept small.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scipy.stats import fisher_exact

ALPHA = 0.01  # two-sided significance a difference needs to fail a position
RELATIVE_MARGIN = 0.2  # of the larger of the two rates
MARGIN_FLOOR = 0.01
MARGIN_CAP = 0.03

PASSED, FAILED, INCONCLUSIVE = "passed", "failed", "inconclusive"


@dataclass(frozen=True)
class PositionCounts:
    """One draft position: drafts reaching it and drafts accepted that far, in vLLM and in draftsmith."""

    vllm_drafts: int
    vllm_accepted: int
    ours_drafts: int
    ours_accepted: int

    @property
    def vllm_rate(self) -> float:
        return self.vllm_accepted / self.vllm_drafts if self.vllm_drafts else 0.0

    @property
    def ours_rate(self) -> float:
        return self.ours_accepted / self.ours_drafts if self.ours_drafts else 0.0


@dataclass(frozen=True)
class PositionVerdict:
    """A position's counts, rates, margin, Fisher p-value and verdict (``passed``/``failed``/``inconclusive``)."""

    vllm_drafts: int
    vllm_accepted: int
    ours_drafts: int
    ours_accepted: int
    vllm: float  # acceptance rate
    ours: float
    margin: float
    p_value: float
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def margin(*rates: float) -> float:
    """The practical margin for rates like ``rates``: :data:`RELATIVE_MARGIN` of the larger,
    clamped to [:data:`MARGIN_FLOOR`, :data:`MARGIN_CAP`]."""
    return min(MARGIN_CAP, max(MARGIN_FLOOR, RELATIVE_MARGIN * max(rates)))


def p_value(counts: PositionCounts) -> float:
    """Fisher's exact two-sided p-value for 'vLLM and draftsmith accept at the same rate'."""
    if not counts.vllm_drafts or not counts.ours_drafts:
        return 1.0
    table = [
        [counts.vllm_accepted, counts.vllm_drafts - counts.vllm_accepted],
        [counts.ours_accepted, counts.ours_drafts - counts.ours_accepted],
    ]
    return float(fisher_exact(table).pvalue)


def judge(counts: PositionCounts) -> PositionVerdict:
    """The verdict on one position (module docstring)."""
    allowed = margin(counts.vllm_rate, counts.ours_rate)
    p = p_value(counts)
    if abs(counts.vllm_rate - counts.ours_rate) <= allowed:
        verdict = PASSED
    else:
        verdict = FAILED if p < ALPHA else INCONCLUSIVE
    return PositionVerdict(
        counts.vllm_drafts,
        counts.vllm_accepted,
        counts.ours_drafts,
        counts.ours_accepted,
        round(counts.vllm_rate, 4),
        round(counts.ours_rate, 4),
        round(allowed, 4),
        p,
        verdict,
    )


def _dead_export(ours: PositionCounts, scale: float = 1.0) -> PositionCounts:
    """The counts an export that vLLM never accepts would give, with ``scale`` times the prompts."""
    return PositionCounts(
        round(ours.vllm_drafts * scale), 0, round(ours.ours_drafts * scale), round(ours.ours_accepted * scale)
    )


def decides(counts: PositionCounts) -> bool:
    """Whether these counts would fail an export that vLLM never accepts (the gate's power)."""
    return judge(_dead_export(counts)).verdict == FAILED


def prompts_to_decide(counts: PositionCounts, prompts: int, most: int = 1 << 16) -> int | None:
    """Fewest prompts (scaling every count with them) at which a never-accepted export would fail
    position 1; None when no number would (our own rate is within the margin of zero)."""
    if counts.ours_rate <= margin(counts.ours_rate) or not prompts:
        return None
    low, high = prompts, prompts
    while not decides(_dead_export(counts, high / prompts)):
        low, high = high, high * 2
        if high > most:
            return None
    while high - low > 1:  # the p-value falls as the counts grow: bisect for the first that decides
        mid = (low + high) // 2
        low, high = (low, mid) if decides(_dead_export(counts, mid / prompts)) else (mid, high)
    return high


def overall(positions: list[PositionVerdict], first: PositionCounts, prompts: int) -> tuple[str, list[str]]:
    """The gate's verdict from its positions, and one line per reason it did not pass."""
    reasons = []
    for k, pos in enumerate(positions, start=1):
        if pos.verdict == PASSED:
            continue
        what = "differ" if pos.verdict == FAILED else "may differ"
        reasons.append(
            f"position {k}: vLLM accepted {pos.vllm_accepted} of {pos.vllm_drafts} drafts ({pos.vllm:.3f}), "
            f"draftsmith {pos.ours_accepted} of {pos.ours_drafts} ({pos.ours:.3f}): {what} by more than the margin "
            f"{pos.margin:.3f} (Fisher p = {pos.p_value:.2g}; {pos.verdict})"
        )
    if any(pos.verdict == FAILED for pos in positions):
        return FAILED, reasons
    if not decides(first):
        needed = prompts_to_decide(first, prompts)
        how = (
            f"about {needed} prompts (--limit {needed}) would decide it"
            if needed
            else "no number of prompts would: train the head longer, or check a stronger one"
        )
        reasons.append(
            f"too little evidence: draftsmith accepted {first.ours_accepted} of {first.ours_drafts} first drafts, "
            f"so an export that vLLM never accepts would not fail on these {prompts} prompts; {how}"
        )
    return (INCONCLUSIVE if reasons else PASSED), reasons
