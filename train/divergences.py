"""Token-level divergences between the target's distribution p and the student's q (DistillSpec).

Each takes logits ``[n, V]`` of both models (already divided by the distillation temperature)
and returns one value per position ``[n]``. Gradients flow only through the student's logits.
``acceptance_rate`` is the expected probability that speculative sampling accepts a draft token,
``sum_x min(p, q) = 1 - TVD`` (Leviathan et al., 2023), which DistillSpec ties to TVD.
"""

from __future__ import annotations

import math

import torch

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities (0 log 0 taken as 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q): mode-covering; the usual distillation loss."""
    return _kl(target_logits.detach().log_softmax(-1), student_logits.log_softmax(-1))


def reverse_kl(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p): mode-seeking."""
    return _kl(student_logits.log_softmax(-1), target_logits.detach().log_softmax(-1))


def jsd(target_logits: torch.Tensor, student_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon: ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
    log_p = target_logits.detach().log_softmax(-1)
    log_q = student_logits.log_softmax(-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def tvd(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Total variation distance ``0.5 sum |p - q|``."""
    return 0.5 * (target_logits.detach().softmax(-1) - student_logits.softmax(-1)).abs().sum(-1)


def acceptance_rate(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``sum min(p, q)`` per position: the chance a token drawn from q is accepted against p."""
    return torch.minimum(target_logits.softmax(-1), student_logits.softmax(-1)).sum(-1)


def divergence(name: str, target_logits: torch.Tensor, student_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """The divergence called ``name`` (one of :data:`DIVERGENCES`) per position."""
    if name == "fkl":
        return forward_kl(target_logits, student_logits)
    if name == "rkl":
        return reverse_kl(target_logits, student_logits)
    if name == "jsd":
        return jsd(target_logits, student_logits, beta)
    if name == "tvd":
        return tvd(target_logits, student_logits)
    raise ValueError(f"unknown divergence {name!r}; choose from {', '.join(DIVERGENCES)}")
