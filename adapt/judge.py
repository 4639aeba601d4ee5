"""Judge a challenger head against the serving one: acceptance in our engine on the same requests, one run.

Both heads decode every held-out request greedily with one drafter configuration (by default a
chain, the shape vLLM serves; planned trees read each head's recorded accuracy, measured on data
that is never judged), and counts, not timings, are compared: the order of the runs does not matter.
Acceptance length is tokens per target pass over all requests (``sum tokens / sum passes``). The
challenger is promoted only when the gain's one-sided lower bound at the ``confidence`` asked for,
from a paired bootstrap over the requests (both heads' counts of a request resampled together),
reaches ``margin``: a win that a few lucky requests make is not enough.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter, parse_spec

BOOTSTRAP = 2000  # resamples of the requests


@dataclass
class Verdict:
    """What judging found and decided."""

    tau_serving: float  # acceptance length of the serving head on the held-out requests
    tau_challenger: float
    gain: float  # tau_challenger - tau_serving
    low: float  # the gain's one-sided lower bound at the judge's confidence (paired bootstrap)
    requests: int
    promoted: bool
    reason: str
    forgetting: str = ""  # what the forgetting check found, or why it did not run

    def record(self) -> dict:
        return asdict(self)


def acceptance_counts(target, spec: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[int, int]]:
    """``(tokens, target passes)`` per prompt, decoding greedily with the drafter of ``spec``."""
    decoder = SpeculativeDecoder(target, build_drafter(parse_spec(spec), target), eos_ids=set())
    counts = []
    for prompt in prompts:
        gen = decoder.generate(prompt, max_new_tokens)
        counts.append((sum(gen.accepted), gen.steps))
    return counts


def paired_gain(
    serving: list[tuple[int, int]], challenger: list[tuple[int, int]], confidence: float, seed: int = 0
) -> tuple[float, float, float, float]:
    """``(tau_serving, tau_challenger, gain, low)`` from per-request counts of both heads; ``low``:
    the one-sided lower ``confidence`` bound of the gain over :data:`BOOTSTRAP` paired resamples."""
    tau_a, tau_b, gains = bootstrap_gains(serving, challenger, seed)
    return tau_a, tau_b, tau_b - tau_a, torch.quantile(gains, 1 - confidence).item()


def bootstrap_gains(
    serving: list[tuple[int, int]], challenger: list[tuple[int, int]], seed: int = 0
) -> tuple[float, float, torch.Tensor]:
    """``(tau_serving, tau_challenger, gains)``: both heads' acceptance lengths from per-request
    counts and the challenger's gain in each of :data:`BOOTSTRAP` paired resamples of the requests."""
    a, b = torch.tensor(serving, dtype=torch.float64), torch.tensor(challenger, dtype=torch.float64)
    tau_a, tau_b = (a[:, 0].sum() / a[:, 1].sum()).item(), (b[:, 0].sum() / b[:, 1].sum()).item()
    picks = torch.randint(len(a), (BOOTSTRAP, len(a)), generator=torch.Generator().manual_seed(seed))
    ra, rb = a[picks].sum(1), b[picks].sum(1)
    return tau_a, tau_b, rb[:, 0] / rb[:, 1] - ra[:, 0] / ra[:, 1]


def judge(
    target,
    kind: str,
    serving: str,
    challenger: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: str,
    margin: float,
    confidence: float,
    seed: int = 0,
) -> Verdict:
    """The :class:`Verdict` on ``challenger`` against ``serving`` (checkpoint folders of ``kind``)."""
    suffix = f"?{options}" if options else ""
    ours = acceptance_counts(target, f"{kind}:{serving}{suffix}", prompts, max_new_tokens)
    theirs = acceptance_counts(target, f"{kind}:{challenger}{suffix}", prompts, max_new_tokens)
    tau_a, tau_b, gain, low = paired_gain(ours, theirs, confidence, seed)
    promoted = low >= margin
    relation = ">=" if promoted else "<"
    reason = f"gain {gain:+.3f}, its lower {confidence:.0%} bound {low:+.3f} {relation} the margin {margin}"
    return Verdict(round(tau_a, 4), round(tau_b, 4), round(gain, 4), round(low, 4), len(prompts), promoted, reason)
