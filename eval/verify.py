"""Accept the longest correct part of a token tree.

Greedy: follow the child whose token is the target's argmax; the first miss yields the target's
own token (the bonus). Sampling: at each node, recursive rejection sampling over the candidates
in draw order (Leviathan et al. for a single candidate; Jeon et al.'s recursive rejection
sampling for several drawn without replacement; deterministic candidates are one-hot
proposals), so every emitted token follows the target's warped distribution exactly.
"""

from __future__ import annotations

import torch

from draftsmith.eval.sampling import SamplingConfig, probabilities, sample
from draftsmith.eval.tree import ROOT, TokenTree


def verify_greedy(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Accepted node path and bonus token; ``logits`` rows are ``[root] + tree nodes``."""
    best = logits.argmax(-1).tolist()
    path: list[int] = []
    node = ROOT
    while True:
        token = best[node + 1]
        child = tree.child_by_token(node, token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    total = r.sum()
    # p == q up to rounding: rejection had probability ~0, any token of p is then correct.
    return r / total if total > 1e-12 else p


def verify_sampling(
    tree: TokenTree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Accepted node path and final token, distributed exactly as the target samples."""
    path: list[int] = []
    node = ROOT
    while True:
        p = probabilities(logits[node + 1], sampling)
        proposal = tree.proposals.get(node)
        if proposal is None:
            return path, sample(p, generator)
        q = proposal.probs.float() if proposal.probs is not None else None
        accepted = None
        for token, child in zip(proposal.tokens, proposal.nodes):
            q_token = 1.0 if q is None else float(q[token])
            ratio = float(p[token]) / q_token if q_token > 0 else 0.0
            if ratio >= 1.0 or float(torch.rand((), generator=generator, device=p.device)) < ratio:
                accepted = (token, child)
                break
            if q is None:
                one_hot = torch.zeros_like(p)
                one_hot[token] = 1.0
                p = _residual(p, one_hot)
            else:
                p = _residual(p, q)
                q = q.clone()
                q[token] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
        if accepted is None:
            return path, sample(p, generator)
        token, child = accepted
        if child is None:  # accepted but pruned from the tree: it is this step's last token
            return path, token
        path.append(child)
        node = child


def verify(tree: TokenTree, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Greedy or sampling verification, as ``sampling`` says."""
    if sampling.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampling, generator)
