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

from draftsmith.eval.engine.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.engine.tree import DeviceTree, TokenTree, device_tree


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
    ok = torch.cat([best.new_ones(1, dtype=torch.bool), (dev.tokens == best[dev.parents[1:]]) & dev.first_of_token])
    end = _end_row(dev, ok)
    return _verdict(dev, end, best[end])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise normalised ``max(p - q, 0)``: what a rejection of a draft from q resamples from."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    # p == q up to rounding: rejection had probability ~0, any token of p is then correct.
    return torch.where(total > 1e-12, r / total.clamp_min(1e-30), p)


def _round(r, z, q, c, accepted, token, deterministic, k, generator, lenience=1.0):
    """Candidate ``k`` of every parent, drawn from q (without replacement) or deterministic
    (a one-hot q): accepted with probability min(1, p(token) / (l q(token))), where p = r / z, the
    remaining draft distribution is q / c and l the lenience. Returns the new ``accepted`` and the
    rows that rejected."""
    live = (token >= 0) & (accepted < 0)
    token = token.clamp_min(0)[:, None]
    r_token = r.gather(1, token)[:, 0]
    q_token = torch.where(deterministic, 1.0, q.gather(1, token)[:, 0] if q is not None else 1.0)
    c = torch.where(deterministic, 1.0, c)
    u = torch.rand(r_token.shape, generator=generator, device=r.device)
    # u < p / (l q) with both sides multiplied by l z c (no division); a ratio >= 1 always accepts.
    accept = live & (q_token > 0) & (u * lenience * q_token * z < r_token * c)
    return torch.where(accept, k, accepted), live & ~accept


def _reject(r, z, q, c, token, rejected, deterministic, lenience=1.0):
    """The rows ``rejected`` move on to their residual: p becomes max(p - l q, 0) renormalised (for
    a deterministic candidate, p loses l of the token's mass: all of it when lossless) and q loses
    the token (drawn without replacement).

    Kept unnormalised, p = r / z and q / c, so a rejection costs one pass over the vocabulary for
    the residual and one for its mass, and a row that did not reject subtracts 0 instead of being
    selected out. Returns the new ``(r, z, c)``; ``q`` (and ``r`` when ``q`` is None) change in place.
    """
    token = token.clamp_min(0)[:, None]
    r_token = r.gather(1, token)[:, 0]
    cut = rejected & deterministic
    if q is None:  # deterministic candidates only: p loses the token, no pass over the vocabulary
        left = (r_token - lenience * z).clamp_min(0)
        total = z - torch.where(cut, r_token - left, 0.0)
        fine = total > 1e-12 * z  # else p was the one-hot up to rounding: keep p, as below
        r.scatter_(1, token, torch.where(cut & fine, left, r_token)[:, None])
        return r, torch.where(fine, total, z), c
    from_q = rejected & ~deterministic
    q_token = q.gather(1, token)[:, 0]
    new = torch.addcmul(r, q, torch.where(from_q, lenience * z / c, 0.0)[:, None], value=-1).clamp_min_(0)
    # A deterministic row's q is all zeros, so only its token changes.
    new_token = new.gather(1, token)[:, 0]
    new.scatter_(1, token, torch.where(cut, (new_token - lenience * z).clamp_min(0), new_token)[:, None])
    total = new.sum(-1)
    q.scatter_(1, token, torch.where(from_q, 0.0, q_token)[:, None])
    c = torch.where(from_q, (c - q_token).clamp_min(1e-30), c)
    # p == q up to rounding: rejection had probability ~0, any token of p is then correct.
    fine = total > 1e-12 * z
    return torch.where(fine[:, None], new, r), torch.where(fine, total, z), c


def verify_sampling(
    tree: TokenTree,
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    lenience: float = 1.0,
) -> torch.Tensor:
    """Verdict of sampling verification (recursive rejection sampling at every parent): lossless
    at ``lenience`` 1, Leviathan's lossy relaxation below (see the module docstring).

    Only rows whose proposal keeps a candidate in the tree run the rounds (at a row whose
    candidates were all pruned, rejection sampling emits a token distributed exactly as p, so
    that token is drawn from p directly), and the last round's residual is computed for the row
    the path ends at only.
    """
    dev = device_tree(tree, logits.device)
    rows = len(tree) + 1
    device = logits.device
    warped = probabilities(logits, sampling) if sampling.top_p < 1.0 else None

    def warp(index: torch.Tensor) -> torch.Tensor:
        # Top-p may read back whether its cut lies among the best tokens (a sync): all rows at once.
        # Otherwise only the rows needed: the proposing ones, then the end row.
        return warped[index] if warped is not None else probabilities(logits[index], sampling)

    props, width = dev.prop_rows.shape[0], dev.cand_tokens.shape[1]
    accepted = torch.full((props,), -1, dtype=torch.long, device=device)
    if props:
        r = warp(dev.prop_rows)
        z = torch.ones(props, device=device)
        q = dev.q.clone() if dev.q is not None else None  # the rounds remove drawn tokens from it
        c = torch.ones(props, device=device)
        for k in range(width):  # the candidates' draw order, for all parents at once
            accepted, rejected = _round(
                r, z, q, c, accepted, dev.cand_tokens[:, k], dev.deterministic, k, generator, lenience
            )
            if k + 1 < width:
                r, z, c = _reject(r, z, q, c, dev.cand_tokens[:, k], rejected, dev.deterministic, lenience)
    # Per row: the accepted candidate's row (0 when it was pruned from the tree, -1 none) and token.
    rank = accepted.clamp_min(0)[:, None]
    child = torch.full((rows,), -1, dtype=torch.long, device=device)
    child[dev.prop_rows] = torch.where(accepted >= 0, dev.cand_rows.gather(1, rank)[:, 0], -1)
    chosen = torch.zeros(rows, dtype=torch.long, device=device)
    chosen[dev.prop_rows] = dev.cand_tokens.gather(1, rank)[:, 0]
    row_ids = torch.arange(rows, device=device)
    ok = torch.cat([row_ids.new_ones(1, dtype=torch.bool), child[dev.parents[1:]] == row_ids[1:]])
    end = _end_row(dev, ok)
    # Ending on a rejection draws from the residual, at a leaf from p, on a pruned acceptance it is that token.
    final = warp(end.view(1))
    if props:
        index = torch.full((rows,), -1, dtype=torch.long, device=device)
        index[dev.prop_rows] = torch.arange(props, device=device)
        at = index[end].clamp_min(0).view(1)
        last_round = (accepted.index_select(0, at) < 0) & (dev.cand_tokens[at, -1] >= 0)
        leftover, *_ = _reject(
            r.index_select(0, at),
            z.index_select(0, at),
            q.index_select(0, at) if q is not None else None,
            c.index_select(0, at),
            dev.cand_tokens[at, -1],
            last_round,
            dev.deterministic.index_select(0, at),
            lenience,
        )
        final = torch.where(index[end] >= 0, leftover, final)
    last = torch.where(child[end] == 0, chosen[end], sample(final, generator)[0])
    return _verdict(dev, end, last)


def verify(
    tree: TokenTree,
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    lenience: float = 1.0,
) -> torch.Tensor:
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
