"""Sampling settings shared by drafters and verification.

Lossless speculative sampling needs the draft distribution q and the target distribution p to be
warped the same way (temperature, then top-k, then top-p) before they are compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature 0 means greedy decoding; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Warped probabilities over the last dimension (fp32), for sampling mode."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def choose(
    logits: torch.Tensor, k: int, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick ``k`` distinct candidate tokens from each row of ``logits``.

    Greedy: the top-k tokens, and no distribution. Sampling: ``k`` draws without replacement
    from the warped distribution (Gumbel-top-k), returned with that distribution so verification
    can correct for it. Returns ``(tokens [..., k], probs [..., V] or None)``.
    """
    if sampling.greedy:
        return torch.topk(logits, k, dim=-1).indices, None
    probs = probabilities(logits, sampling)
    k = min(k, int((probs > 0).sum(-1).min()))
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device)
    gumbel = -torch.log((-torch.log(uniform.clamp_min(1e-20))).clamp_min(1e-20))
    return torch.topk(probs.log() + gumbel, k, dim=-1).indices, probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from a probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))
