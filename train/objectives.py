"""Token objectives: how a drafter's distribution q is pulled towards the target's p, per position.

Every kind that predicts a distribution (EAGLE-1/3, HASS, P-EAGLE, DFlash, DSpark, draft LMs) takes
its objective from the recipe (``drafter.objective``): one name, or a weighted mix as a mapping
(``{ce: 0.1, tv: 0.9}``) or the JSON string speculators' ``--loss-fn`` takes. Names and definitions
are speculators' (``speculators/losses/eager.py``, 0.9.0), so a recipe means what the peer's flag
means:

- ``kl_div``: KL(p || q), mode-covering (the default; trained as the soft cross-entropy
  ``-sum p log q``, which differs from it by p's entropy, a constant, so gradients are equal);
- ``rkl``: KL(q || p), mode-seeking;
- ``jsd``: ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q`` (beta 0.5:
  speculators' JSD);
- ``ce``: cross-entropy on the target's argmax (the first, as ``argmax``: ties go to the lower id);
- ``tv``: total variation ``1 - alpha``, with ``alpha = sum_v min(p_v, q_v)`` the chance that
  speculative sampling accepts a token drawn from q (Leviathan et al., 2023);
- ``nla``: ``-log alpha`` (alpha clamped at 1e-5, as speculators does);
- ``lk_hybrid``: ``lambda KL(p || q) + (1 - lambda) TV`` with ``lambda = exp(-3 sg(alpha))``
  (Samarin et al., "LK Losses", arXiv 2602.23881).

``kl_div`` and ``ce`` are linear in ``log q``: together they train as one soft cross-entropy
``-sum_i c_i log q_i`` with ``c = w_kl p + w_ce onehot(argmax p)`` (:func:`soft_coefficients`), the
fused path that never writes ``log q``; the other terms are scored by :func:`objective_rows`, in
chunks of rows under activation checkpointing: a term's fp32 intermediates exist for one chunk at
a time, never as full ``[tokens, vocab]`` copies per term, and are recomputed in the backward pass.

The same fused path takes hard labels (token ids, :func:`is_labels`) in place of ``c``: the
cross-entropy on the data's own next tokens, as SpecForge trains the DFlash family
(``drafter.labels: data``), where no target distribution exists to write out.
"""

from __future__ import annotations

import json
import math
import re

import torch
from torch.utils.checkpoint import checkpoint

OBJECTIVES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")
# Other spellings users bring: DistillSpec's (fkl, tvd) and short names.
ALIASES = {"fkl": "kl_div", "kl": "kl_div", "forward_kl": "kl_div", "reverse_kl": "rkl", "tvd": "tv", "lk": "lk_hybrid"}
NLA_EPS = 1e-5  # speculators' clamp of alpha under the log
LK_ETA = 3.0  # speculators' (and the LK paper's best) blend temperature
CHUNK_ELEMENTS = 1 << 22  # rows per chunk x vocabulary: 16 MiB of fp32 per intermediate
# rows x vocabulary of one pass of the soft cross-entropy: 4 MiB of fp32, which a core's caches hold
PASS_ELEMENTS = 1 << 20
SOFT = ("kl_div", "ce")  # the terms linear in log q, trained as one soft cross-entropy (soft_coefficients)


def parse_objective(spec: str | dict, where: str = "drafter.objective") -> dict[str, float]:
    """``{name: weight}`` for an objective spec: a name, a mapping of names to weights, or that
    mapping as a JSON string (speculators' ``--loss-fn``). Raises ``ValueError`` naming the field
    ``where`` and what is wrong."""
    try:
        return _parse(spec)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _parse(spec: str | dict) -> dict[str, float]:
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                example = '{"ce": 0.1, "tv": 0.9}'
                raise ValueError(f"{text!r} is not valid JSON ({err.msg}); e.g. '{example}'") from None
        else:
            spec = {text: 1.0}
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"must be a name or a non-empty mapping of names to weights, got {spec!r}")
    mix: dict[str, float] = {}
    for name, weight in spec.items():
        canonical = ALIASES.get(str(name), str(name))
        if canonical not in OBJECTIVES:
            raise ValueError(f"unknown objective {name!r}; choose from {', '.join(OBJECTIVES)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"the weight of {name!r} must be a finite number >= 0, got {weight!r}")
        mix[canonical] = mix.get(canonical, 0.0) + float(weight)
    if not any(mix.values()):
        raise ValueError(f"{spec!r}: at least one weight must be > 0")
    return mix


def describe(mix: dict[str, float]) -> str:
    """A short label for a mix (``kl_div``, ``0.1 ce + 0.9 tv``), for tables and logs."""
    if len(mix) == 1 and next(iter(mix.values())) == 1.0:
        return next(iter(mix))
    return " + ".join(f"{w:g} {n}" for n, w in mix.items())


def slug(mix: dict[str, float]) -> str:
    """``describe`` as a file-name-safe word."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", describe(mix)).strip("-")


def soft_coefficients(mix: dict[str, float], probs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``c`` ``[rows, V]`` (fp32) with ``-sum_i c_i log q_i`` equal to ``scale`` x ``mix``'s ``kl_div``
    and ``ce`` terms against the target's ``probs`` (``kl_div`` up to p's entropy, a constant: equal
    gradients). One ``[rows, V]`` tensor is written: ``scale`` is folded into the weights."""
    coeff = probs.float() * (scale * mix.get("kl_div", 0.0))
    if mix.get("ce"):
        best = probs.max(-1, keepdim=True).indices  # the first maximum, as argmax's
        coeff.scatter_add_(-1, best, coeff.new_full(best.shape, scale * mix["ce"]))
    return coeff


def scored_apart(mix: dict[str, float]) -> dict[str, float]:
    """``mix``'s terms that :func:`objective_rows` scores: all but those in :func:`soft_coefficients`."""
    return {name: weight for name, weight in mix.items() if name not in SOFT and weight}


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities (0 log 0 taken as 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def _terms(mix: dict[str, float], logits: torch.Tensor, probs: torch.Tensor, beta: float) -> torch.Tensor:
    """``sum_name weight x term`` per row, fp32, from one chunk of student ``logits`` and target ``probs``."""
    log_q = logits.float().log_softmax(-1)
    p = probs.float()
    log_p = p.clamp_min(torch.finfo(torch.float32).tiny).log()
    total = log_q.new_zeros(log_q.shape[0])
    alpha = None
    if mix.keys() & {"tv", "nla", "lk_hybrid"}:
        alpha = torch.minimum(log_q.exp(), p).sum(-1)
    for name, weight in mix.items():
        if not weight:
            continue
        if name == "kl_div":
            term = _kl(log_p, log_q)
        elif name == "rkl":
            term = _kl(log_q, log_p)
        elif name == "jsd":
            log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
            term = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
        elif name == "ce":
            term = -log_q.gather(-1, p.argmax(-1, keepdim=True))[:, 0]
        elif name == "tv":
            term = 1.0 - alpha
        elif name == "nla":
            term = -alpha.clamp_min(NLA_EPS).log()
        else:  # lk_hybrid
            blend = torch.exp(-LK_ETA * alpha.detach())
            term = blend * _kl(log_p, log_q) + (1 - blend) * (1.0 - alpha)
        total = total + weight * term
    return total


def objective_rows(mix: dict[str, float], logits: torch.Tensor, probs: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """The objective ``mix`` per row ``[rows]`` (fp32) of student ``logits`` ``[rows, V]`` against the
    target's distribution ``probs`` ``[rows, V]`` (no gradient flows into it), in row chunks."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
    probs = probs.detach()
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.float32) + logits.sum() * 0.0
    rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = [
        checkpoint(_terms, mix, z, p, beta, use_reentrant=False) if grad else _terms(mix, z, p, beta)
        for z, p in zip(logits.split(rows), probs.split(rows))
    ]
    return torch.cat(parts)


def _row_slices(rows: int, vocab: int) -> list[slice]:
    """Row ranges of ``PASS_ELEMENTS`` elements at most (one row at least)."""
    step = max(1, PASS_ELEMENTS // max(1, vocab))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _lse_and_dot(logits: torch.Tensor, coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logsumexp(z), c . z)`` per row, a cache-sized chunk of rows at a time."""
    lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
    dot = torch.empty_like(lse)
    for rows in _row_slices(*logits.shape):
        z = logits[rows].float()
        lse[rows] = z.logsumexp(-1)
        dot[rows] = row_dot(coeff[rows], z)
    return lse, dot


def is_labels(coeff: torch.Tensor) -> bool:
    """Whether loss coefficients ``coeff`` are hard labels: ``[rows]`` token ids (-1: no loss), the
    one-hot rows ``c`` stored by index, never written out over the vocabulary."""
    return not coeff.is_floating_point()


def coefficient_sum(coeff: torch.Tensor) -> torch.Tensor:
    """``s = sum_i c_i`` per row, fp32 (1 per hard label, 0 where it is -1)."""
    return (coeff >= 0).float() if is_labels(coeff) else coeff.sum(-1)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a . b`` per row of two ``[rows, V]`` tensors, a cache-sized chunk of rows at a time (a
    batched ``bmm`` of the whole rows took about 3x as long over a 49,152-token vocabulary); ``a``
    may be hard labels (:func:`is_labels`): ``b``'s entry at each label, 0 where it is -1."""
    if is_labels(a):
        return torch.where(a >= 0, b.gather(-1, a.clamp(min=0)[:, None])[:, 0].float(), 0.0)
    dot = a.new_empty(a.shape[0], dtype=torch.float32)
    for rows in _row_slices(*a.shape):
        dot[rows] = (a[rows].float() * b[rows].float()).sum(-1)
    return dot


def _soft_grad(
    z: torch.Tensor, lse: torch.Tensor, coeff: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (fp32, the shape of ``z``) set to ``scale (s softmax(z) - c)`` for rows of ``z`` with
    log-normaliser ``lse`` and ``s = sum_i c_i``: the soft cross-entropy's gradient times
    ``scale``, one per row. Written in place: a copy per chunk cost as much as the arithmetic."""
    total = coefficient_sum(coeff)
    torch.sub(z.float(), lse[:, None], out=out).exp_().mul_((total * scale)[:, None])
    if is_labels(coeff):
        return out.scatter_add_(-1, coeff.clamp(min=0)[:, None], -(total * scale)[:, None])
    return out.addcmul_(coeff, scale[:, None], value=-1.0)


class _SoftTargetCrossEntropy(torch.autograd.Function):
    """Per row, ``-sum_i c_i log softmax(z)_i = s lse(z) - c.z`` with ``s = sum_i c_i``, and its
    gradient ``s softmax(z) - c``, in fp32. Only the logits (in their own dtype), ``c`` and the
    row's log-sum-exp are kept for the backward pass: the composite form (cast, log_softmax, mul,
    sum) wrote and reread fp32 ``[rows, vocab]`` tensors at each step and took ~40% of a 7-pass
    training step on CPU (torch.profiler), where these ops are bound by memory bandwidth. Both
    passes go a cache-sized chunk of rows at a time (:data:`PASS_ELEMENTS`): over Domino's
    49,152-token rows, whole-tensor ``logsumexp`` and a batched dot product cost about 3x as much."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, coeff: torch.Tensor):
        with torch.autocast(logits.device.type, enabled=False):
            lse, dot = _lse_and_dot(logits, coeff)
            loss = coefficient_sum(coeff) * lse - dot
        ctx.save_for_backward(logits, coeff, lse)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_lse: torch.Tensor):
        logits, coeff, lse = ctx.saved_tensors
        grad_z = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for rows in _row_slices(*logits.shape):
                _soft_grad(logits[rows], lse[rows], coeff[rows], grad[rows], grad_z[rows])
        return grad_z.to(logits.dtype), None


def soft_target_cross_entropy(logits: torch.Tensor, coeff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` per row of ``logits`` ``[rows, V]``: ``-sum_i coeff_i log softmax(logits)_i``
    (``coeff`` ``[rows, V]`` fp32: a distribution for soft cross-entropy, any non-negative weights
    for sums of such terms; or hard labels ``[rows]``, :func:`is_labels`: the cross-entropy on
    those token ids) and the rows' fp32 log-sum-exp (no gradient)."""
    return _SoftTargetCrossEntropy.apply(logits, coeff)


class _MixedSoftTargetCrossEntropy(torch.autograd.Function):
    """Per row, ``(1 - w) CE(b + m x) + w CE(b)`` (``CE``: :class:`_SoftTargetCrossEntropy`'s soft
    cross-entropy with ``c``; ``m`` a row's 0/1 switch for the addend ``x``), with the summed logits
    ``b + m x`` as a third output. One pass over each chunk of rows forward and one backward: the
    two losses composed from :func:`soft_target_cross_entropy` wrote and reread the full-vocabulary
    logits, their two gradients and their sum once each (Domino's backbone and corrected logits)."""

    @staticmethod
    def forward(ctx, base, addend, switch, coeff, weight: float):
        ctx.set_materialize_grads(False)
        with torch.autocast(base.device.type, enabled=False):
            logits = torch.empty_like(base)
            for rows in _row_slices(*base.shape):
                torch.addcmul(base[rows], addend[rows], switch[rows, None], out=logits[rows])
            lse, dot = _lse_and_dot(logits, coeff)
            total = coefficient_sum(coeff)
            loss = total * lse - dot
            base_lse = lse
            if weight > 0:
                base_lse, base_dot = _lse_and_dot(base, coeff)
                loss = (1 - weight) * loss + weight * (total * base_lse - base_dot)
        ctx.weight = weight
        ctx.save_for_backward(base, logits, switch, coeff, lse, base_lse)
        ctx.mark_non_differentiable(lse)
        return loss, lse, logits

    @staticmethod
    def backward(ctx, grad, _grad_lse, grad_logits):
        base, logits, switch, coeff, lse, base_lse = ctx.saved_tensors
        weight = ctx.weight
        grad_base = torch.empty(base.shape, dtype=torch.float32, device=base.device)
        grad_addend = torch.empty_like(grad_base)
        if grad is None:
            grad = lse.new_zeros(lse.shape)
        slices = _row_slices(*base.shape)
        scratch = grad_base.new_empty(grad_base[slices[0]].shape) if weight > 0 and slices else None
        with torch.autocast(base.device.type, enabled=False):
            for rows in slices:
                g = _soft_grad(logits[rows], lse[rows], coeff[rows], (1 - weight) * grad[rows], grad_base[rows])
                if grad_logits is not None:
                    g += grad_logits[rows]
                torch.mul(g, switch[rows, None], out=grad_addend[rows])
                if weight > 0:
                    g += _soft_grad(base[rows], base_lse[rows], coeff[rows], weight * grad[rows], scratch[: len(g)])
        return grad_base.to(base.dtype), grad_addend.to(base.dtype), None, None, None


def mixed_token_loss(
    base: torch.Tensor,
    addend: torch.Tensor,
    switch: torch.Tensor,
    coeff: torch.Tensor,
    probs: torch.Tensor,
    mix: dict[str, float],
    kept: torch.Tensor | float,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, logits)`` per row: :func:`token_loss` of ``logits = base + switch x addend``
    (``switch`` ``[rows]``, 1 where a row takes ``addend``) mixed with :func:`token_loss` of
    ``base`` as ``(1 - weight) x the first + weight x the second`` (Domino's corrected and backbone
    logits), equal to composing them but with the soft cross-entropies fused (see
    :class:`_MixedSoftTargetCrossEntropy`); ``lse`` is the summed logits' log-normaliser."""
    loss, lse, logits = _MixedSoftTargetCrossEntropy.apply(base, addend, switch.to(base.dtype), coeff, weight)
    rest = scored_apart(mix)
    if rest:
        extra = objective_rows(rest, logits, probs)
        if weight > 0:
            extra = (1 - weight) * extra + weight * objective_rows(rest, base, probs)
        loss = loss + kept * extra
    return loss, lse, logits


def token_loss(
    logits: torch.Tensor, coeff: torch.Tensor, probs: torch.Tensor, mix: dict[str, float], weight: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` per row: the soft cross-entropy with ``coeff`` (``mix``'s ``kl_div`` and ``ce``
    terms, :func:`soft_coefficients`, plus any extra such as HASS's top-K) plus ``weight`` (a number,
    or one per row: 0 drops a row) x ``mix``'s other terms against ``probs`` (:func:`scored_apart`)."""
    loss, lse = soft_target_cross_entropy(logits, coeff)
    rest = scored_apart(mix)
    if rest:
        loss = loss + weight * objective_rows(rest, logits, probs)
    return loss, lse


def acceptance_rate(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``sum min(p, q)`` per position: the chance a token drawn from q is accepted against p."""
    return torch.minimum(target_logits.softmax(-1), student_logits.softmax(-1)).sum(-1)
