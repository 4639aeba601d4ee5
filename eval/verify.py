"""Accept the longest correct part of a token tree, on the device, vectorised over the tree.

Greedy: follow the child whose token is the target's argmax; the first miss yields the target's
own token (the bonus). Sampling: at each node, recursive rejection sampling over the candidates
in draw order (Leviathan et al. for a single candidate; Jeon et al.'s recursive rejection
sampling for several drawn without replacement; deterministic candidates are one-hot
proposals), so every emitted token follows the target's warped distribution exactly.

Both run for every row of the tree at once (each parent's rejection sampling is independent of
the others', so deciding all of them and then following the path from the root gives the
sequential walk's distribution), and return a *verdict*: one int64 device tensor ``[n + 1]``,
the accepted-node mask followed by the last token, which the engine reads back in one transfer.

``lenience`` l < 1 is Leviathan et al.'s lossy relaxation of sampling verification: a candidate
drawn from q is accepted with probability min(1, p / (l q)) instead of min(1, p / q), and a
rejection resamples from norm(max(0, p - l q)). Output then no longer follows p exactly
(:func:`lenient_distribution` gives the one-token output distribution, to measure the shift).
"""

from __future__ import annotations

import torch

from draftsmith.eval.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.tree import DeviceTree, TokenTree, device_tree


def _end_row(dev: DeviceTree, ok: torch.Tensor) -> torch.Tensor:
    """The deepest row whose ancestors (and itself) are all ``ok`` rows: the end of the path."""
    reachable = ~(dev.ancestors & ~ok[None, :]).any(-1)
    return torch.where(reachable, dev.depths, -1).argmax()


def _verdict(dev: DeviceTree, end: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return torch.cat([dev.ancestors[end, 1:].long(), last.view(1)])


def verify_greedy(tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
    """Verdict of greedy verification; ``logits`` rows are ``[root] + tree nodes``."""
    dev = device_tree(tree, logits.device)
    best = logits.argmax(-1)
    ok = torch.cat([best.new_ones(1, dtype=torch.bool),
                    (dev.tokens == best[dev.parents[1:]]) & dev.first_of_token])
    end = _end_row(dev, ok)
    return _verdict(dev, end, best[end])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise normalised ``max(p - q, 0)``: what a rejection of a draft from q resamples from."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    # p == q up to rounding: rejection had probability ~0, any token of p is then correct.
    return torch.where(total > 1e-12, r / total.clamp_min(1e-30), p)


def _deterministic_round(p, accepted, token, k, generator, lenience=1.0):
    """Candidate ``k`` of every parent, each a one-hot proposal: accepted with probability
    min(1, p(token) / lenience); rejected, p loses ``lenience`` of the token's mass (the residual
    of p and the scaled one-hot: all of it when lossless)."""
    live = (token >= 0) & (accepted < 0)
    token = token.clamp_min(0)[:, None]
    p_token = p.gather(1, token)
    u = torch.rand(p_token.shape, generator=generator, device=p.device)
    accept = live & (u * lenience < p_token)[:, 0]
    left = (p_token - lenience).clamp_min(0)
    rest = 1.0 - p_token + left
    residual = torch.where(rest > 1e-12, p.scatter(1, token, left) / rest.clamp_min(1e-30), p)
    return torch.where((live & ~accept)[:, None], residual, p), torch.where(accept, k, accepted)


def _round(p, q, accepted, token, deterministic, k, generator, lenience=1.0):
    """Candidate ``k`` of every parent, drawn from q (without replacement) or deterministic."""
    live = (token >= 0) & (accepted < 0)
    token = token.clamp_min(0)[:, None]
    p_token = p.gather(1, token)[:, 0]
    q_token = torch.where(deterministic, 1.0, q.gather(1, token)[:, 0])
    u = torch.rand(p_token.shape, generator=generator, device=p.device)
    accept = live & (q_token > 0) & (u * lenience * q_token < p_token)  # u < p / (l q); >= 1 always accepts
    rejected = (live & ~accept)[:, None]
    one_hot = torch.zeros_like(p).scatter_(1, token, 1.0)
    p = torch.where(rejected, residual(p, lenience * torch.where(deterministic[:, None], one_hot, q)), p)
    # Without replacement: the next candidate was drawn from q with this one removed.
    removed = q.scatter(1, token, 0.0)
    mass = removed.sum(-1, keepdim=True)
    renormalised = torch.where(mass > 0, removed / mass.clamp_min(1e-30), removed)
    q = torch.where(rejected & ~deterministic[:, None], renormalised, q)
    return p, q, torch.where(accept, k, accepted)


def verify_sampling(tree: TokenTree, logits: torch.Tensor, sampling: SamplingConfig,
                    generator: torch.Generator | None = None, lenience: float = 1.0) -> torch.Tensor:
    """Verdict of sampling verification (recursive rejection sampling at every parent): lossless
    at ``lenience`` 1, Leviathan's lossy relaxation below (see the module docstring)."""
    dev = device_tree(tree, logits.device)
    p_rows = probabilities(logits, sampling)
    rows = len(tree) + 1
    p = p_rows[dev.prop_rows]
    accepted = torch.full(dev.prop_rows.shape, -1, dtype=torch.long, device=p.device)
    if dev.q is None:  # deterministic candidates only (one-hot proposals): the cheap update
        for k in range(dev.cand_tokens.shape[1]):
            p, accepted = _deterministic_round(p, accepted, dev.cand_tokens[:, k], k, generator, lenience)
    else:
        q = dev.q
        for k in range(dev.cand_tokens.shape[1]):  # the candidates' draw order, for all parents at once
            p, q, accepted = _round(p, q, accepted, dev.cand_tokens[:, k], dev.deterministic, k, generator, lenience)
    # Per row: the accepted candidate's row (0 when it was pruned from the tree, -1 none) and token.
    rank = accepted.clamp_min(0)[:, None]
    child = torch.full((rows,), -1, dtype=torch.long, device=p.device)
    child[dev.prop_rows] = torch.where(accepted >= 0, dev.cand_rows.gather(1, rank)[:, 0], -1)
    chosen = torch.zeros(rows, dtype=torch.long, device=p.device)
    chosen[dev.prop_rows] = dev.cand_tokens.gather(1, rank)[:, 0]
    row_ids = torch.arange(rows, device=p.device)
    ok = torch.cat([row_ids.new_ones(1, dtype=torch.bool), child[dev.parents[1:]] == row_ids[1:]])
    end = _end_row(dev, ok)
    # Ending on a rejection draws from the residual, at a leaf from p, on a pruned acceptance it is that token.
    final = p_rows[end]
    if len(dev.prop_rows):
        index = torch.full((rows,), -1, dtype=torch.long, device=p.device)
        index[dev.prop_rows] = torch.arange(len(dev.prop_rows), device=p.device)
        final = torch.where(index[end] >= 0, p[index[end].clamp_min(0)], final)
    last = torch.where(child[end] == 0, chosen[end], sample(final, generator))
    return _verdict(dev, end, last)


def verify(tree: TokenTree, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None = None, lenience: float = 1.0) -> torch.Tensor:
    """Greedy or sampling verification, as ``sampling`` says: the verdict, on the device."""
    if sampling.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampling, generator, lenience)


def lenient_distribution(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """The exact distribution of the token emitted at a node with one candidate drawn from ``q``
    and verified against ``p`` with ``lenience`` (``p`` itself at lenience 1): the candidate's
    accepted mass ``q min(1, p / (l q))`` plus the rejected mass times the residual. Rows of
    ``[..., V]`` inputs are independent cases."""
    accepted = torch.minimum(q, p / lenience)
    return accepted + (1 - accepted.sum(-1, keepdim=True)) * residual(p, lenience * q)


def verdict(tree: TokenTree, path: list[int], last: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The verdict of a known outcome (accepted node ``path`` and ``last`` token)."""
    accepted = [0] * len(tree)
    for node in path:
        accepted[node] = 1
    return torch.tensor(accepted + [int(last)], device=device)


def read_verdict(values: list[int]) -> tuple[list[int], int]:
    """Accepted node path (root to leaf) and last token of a verdict read back to the host."""
    return [node for node, flag in enumerate(values[:-1]) if flag], values[-1]
