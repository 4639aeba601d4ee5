"""Token trees: what a drafter proposes and the target verifies in one forward pass.

Node indices are topological (a parent always precedes its children); parent ``-1`` is the root,
i.e. the last committed token, whose own target distribution scores the depth-1 candidates.

For lossless sampling a tree also remembers, per parent, every candidate the drafter drew in
the order it drew them, including candidates pruned from the tree, and the distribution it drew
them from. Verification walks them in that order (recursive rejection sampling); a pruned
candidate that is accepted simply ends the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.eval.engine.sampling import choose
from draftsmith.heads.vocab import scatter_to_vocab

ROOT = -1


@dataclass
class Proposal:
    """The candidates drawn below one parent, in draw order."""

    tokens: list[int]
    nodes: list[int | None]  # tree node of each candidate, None where pruned
    probs: torch.Tensor | None = None  # draft distribution they were drawn from (None: deterministic)


@dataclass
class TokenTree:
    """A topologically ordered token tree."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # root's children have depth 1
    proposals: dict[int, Proposal] = field(default_factory=dict)  # parent -> candidates
    # Entropy (nats) of the draft distribution each proposing node drew from, where the drafter has one.
    entropy: dict[int, float] = field(default_factory=dict)
    # Each node's estimated log-probability of being accepted with its ancestors (the drafter's
    # cumulative draft log-probability, or a lookup's frequency estimate); empty where it has none.
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def child_by_token(self, parent: int, token: int) -> int | None:
        proposal = self.proposals.get(parent)
        if proposal is None:
            return None
        for candidate, node in zip(proposal.tokens, proposal.nodes):
            if candidate == token and node is not None:
                return node
        return None


class TreeBuilder:
    """Grows a tree candidate by candidate, then keeps the best ``budget`` nodes.

    Scores are cumulative draft log-probabilities (or any score that never increases from a
    parent to its child), so the best nodes always include their ancestors.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.proposals: dict[int, tuple[list[int], list[int | None], torch.Tensor | None]] = {}
        self.entropy: dict[int, float] = {}
        self.scored = False  # whether any candidates came with scores (then the tree keeps them)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self,
        parent: int,
        tokens: list[int],
        scores: list[float] | None = None,
        probs: torch.Tensor | None = None,
        entropy: float | None = None,
    ) -> list[int]:
        """Add ``tokens`` as the candidates below ``parent`` (in draw order), drawn from ``probs``
        of entropy ``entropy`` where known; returns their node ids."""
        if parent in self.proposals:
            raise ValueError(f"node {parent} already has candidates")
        if entropy is not None:
            self.entropy[parent] = entropy
        self.scored |= scores is not None
        depth = 1 if parent == ROOT else self.depths[parent] + 1
        base = 0.0 if parent == ROOT else self.scores[parent]
        ids = []
        for i, token in enumerate(tokens):
            ids.append(len(self.tokens))
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(base + (scores[i] if scores is not None else 0.0))
        self.proposals[parent] = (list(map(int, tokens)), list(ids), probs)
        return ids

    def build(self, budget: int | None = None) -> TokenTree:
        """The tree of the ``budget`` best-scoring nodes (all nodes when None)."""
        keep = set(range(len(self.tokens)))
        if budget is not None and budget < len(self.tokens):
            order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))
            keep = set(order[:budget])
            for node in list(keep):  # guard against ties breaking ancestor closure
                while self.parents[node] != ROOT and self.parents[node] not in keep:
                    node = self.parents[node]
                    keep.add(node)
        ordered = sorted(keep, key=lambda i: (self.depths[i], i))
        new_id = {old: new for new, old in enumerate(ordered)}
        new_id[ROOT] = ROOT
        tree = TokenTree(
            tokens=[self.tokens[i] for i in ordered],
            parents=[new_id[self.parents[i]] for i in ordered],
            depths=[self.depths[i] for i in ordered],
            scores=[self.scores[i] for i in ordered] if self.scored else [],
        )
        for parent, (tokens, nodes, probs) in self.proposals.items():
            if parent in new_id:
                tree.proposals[new_id[parent]] = Proposal(tokens, [new_id.get(n) for n in nodes], probs)
        tree.entropy = {new_id[parent]: value for parent, value in self.entropy.items() if parent in new_id}
        return tree


def chain(tokens: list[int], probs: list[torch.Tensor | None] | None = None) -> TokenTree:
    """A single path: each token the only candidate below the previous one."""
    builder = TreeBuilder()
    parent = ROOT
    for i, token in enumerate(tokens):
        (parent,) = builder.add(parent, [token], probs=probs[i] if probs else None)
    return builder.build()


def ancestor_mask(parents: list[int] | torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """``[..., n, n]`` boolean matrix, True where column j is row i or one of its ancestors.

    ``parents`` is ``[..., n]`` (leading dimensions: several trees at once, e.g. a batch). Built
    where ``parents`` lives, vectorised over rows: ``levels`` pointer jumps (the longest parent
    chain among the rows; ``n`` when unknown), each one gather for every row at once.
    """
    parents = torch.as_tensor(parents, dtype=torch.long)
    n = parents.shape[-1]
    rows = torch.arange(n, device=parents.device).expand_as(parents)
    up = torch.where(parents >= 0, parents, rows)  # a row without a parent here stays put
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape, n).clone()
    node = rows
    for _ in range(n if levels is None else levels):
        node = up.gather(-1, node)
        mask.scatter_(-1, node[..., None], True)
    return mask


@dataclass
class DeviceTree:
    """A tree's rows ``[root] + nodes`` on the device, for one target pass and its verification.

    Rows: root is row 0 (its token is the last committed one, already on the device), node i is
    row i + 1. Proposals are packed per proposing row (one that keeps a candidate in the tree):
    ``cand_tokens`` / ``cand_rows`` are ``[P, K]`` (row 0 for a pruned candidate, -1 for padding),
    ``q`` the draft distributions ``[P, V]`` (None when every proposal is deterministic) and
    ``deterministic`` ``[P]``.
    """

    tokens: torch.Tensor  # [n] node tokens
    parents: torch.Tensor  # [n + 1] parent row of each row (-1 for the root)
    depths: torch.Tensor  # [n + 1] depth below the root
    levels: int  # the tree's depth (host int: pointer jumps, never a sync)
    ancestors: torch.Tensor  # [n + 1, n + 1] ancestor-or-self of each row
    first_of_token: torch.Tensor  # [n] False for a node repeating an earlier sibling's token
    prop_rows: torch.Tensor  # [P]
    cand_tokens: torch.Tensor  # [P, K]
    cand_rows: torch.Tensor  # [P, K]
    deterministic: torch.Tensor  # [P]
    q: torch.Tensor | None


def upload(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Host integer rows as one device tensor: one (pinned, asynchronous where possible) copy."""
    host = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def device_tree(tree: TokenTree, device: torch.device) -> DeviceTree:
    """``tree`` on ``device`` in one host-to-device copy, built once per tree object (a drafter
    returning the same tree pays nothing); masks and verification then never leave the device."""
    cached = getattr(tree, "_device_tree", None)
    if cached is not None and cached.tokens.device == device:
        return cached
    n = len(tree)
    # Only rows with a candidate in the tree: at a row whose candidates were all pruned, rejection
    # sampling emits a token that follows p exactly, so verification draws it from p directly.
    proposing = sorted(p for p, proposal in tree.proposals.items() if any(n is not None for n in proposal.nodes))
    width = max((len(tree.proposals[p].tokens) for p in proposing), default=0)

    def padded(values: list[int]) -> list[int]:
        return values + [-1] * (width - len(values))

    rows = [[0] + tree.tokens, [ROOT] + [p + 1 for p in tree.parents], [0] + tree.depths]
    for p in proposing:
        proposal = tree.proposals[p]
        rows.append(
            padded(proposal.tokens)
            + padded([0 if c is None else c + 1 for c in proposal.nodes])
            + [p + 1, proposal.probs is None]
        )
    columns = max(len(row) for row in rows)
    packed = upload([row + [0] * (columns - len(row)) for row in rows], device)
    tokens, parents, depths, props = packed[0, 1 : n + 1], packed[1, : n + 1], packed[2, : n + 1], packed[3:]
    levels = max(tree.depths, default=0)
    # Greedy verification follows the first candidate of a parent carrying a token (as child_by_token).
    same = (parents[1:, None] == parents[None, 1:]) & (tokens[:, None] == tokens[None, :])
    first_of_token = ~torch.tril(same, diagonal=-1).any(-1)
    probs = [tree.proposals[p].probs for p in proposing]
    q = None
    if any(pr is not None for pr in probs):
        zeros = torch.zeros(next(pr for pr in probs if pr is not None).shape[-1], device=device)
        q = torch.stack([zeros if pr is None else pr.to(device).float() for pr in probs])
    result = DeviceTree(
        tokens,
        parents,
        depths,
        levels,
        ancestor_mask(parents, levels),
        first_of_token,
        props[:, 2 * width],
        props[:, :width],
        props[:, width : 2 * width],
        props[:, 2 * width + 1].bool(),
        q,
    )
    tree._device_tree = result
    return result


def choose_packed(
    logits: torch.Tensor,
    k: int,
    sampling,
    generator,
    max_entropy: float | None,
    vocab: torch.Tensor | None,
    vocab_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``k`` candidates per row of ``logits`` packed for one read-back, ``[rows, 2k' (+1)]`` float64:
    their draft log-probabilities, their target ids (exact in float64) and, for the entropy
    policy, each row's entropy; with the sampled distributions spread into the target's
    vocabulary (None when greedy) and ``k'``, the candidates drawn (sampling may draw fewer than
    ``k``: a distribution with a smaller support)."""
    tokens, probs = choose(logits, k, sampling, generator)
    log_q = probs.clamp_min(1e-30).log() if probs is not None else logits.float().log_softmax(-1)
    packed = [log_q.gather(-1, tokens).double(), (vocab[tokens] if vocab is not None else tokens).double()]
    if max_entropy is not None:  # only the entropy policy pays for the entropies
        packed.append(torch.special.entr(log_q.exp()).sum(-1).double()[:, None])
    if probs is not None and vocab is not None:
        probs = scatter_to_vocab(probs, vocab, vocab_size, fill=0.0)
    return torch.cat(packed, 1), probs, tokens.shape[-1]


def _add_candidates(builder: TreeBuilder, parent: int, row: list[float], k: int, probs, max_entropy: float | None):
    """Add one read-back ``row`` of :func:`choose_packed` (``k`` candidates) under ``parent``; None
    when the node is less certain than ``max_entropy`` (it keeps its entropy, which hierarchical
    drafting learns from, and gets no children)."""
    spread = row[2 * k] if max_entropy is not None else None
    if spread is not None and spread > max_entropy:
        builder.entropy[parent] = spread
        return None
    return builder.add(parent, [int(t) for t in row[k : 2 * k]], row[:k], probs, spread)


def grow_tree(
    root_logits: torch.Tensor,
    expand,
    depth: int,
    top_k: int,
    budget: int,
    sampling,
    generator: torch.Generator | None = None,
    max_entropy: float | None = None,
    vocab: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> TokenTree:
    """An EAGLE-2 dynamic tree: expand the ``top_k`` best nodes per depth, keep the best ``budget``.

    ``expand(frontier, builder)`` runs the drafter on the ``frontier`` nodes of ``builder`` and
    returns their next-token logits ``[len(frontier), V]``: over the full vocabulary, or over a
    draft vocabulary whose target ids are ``vocab`` (then ``vocab_size`` is the target's), chosen
    from in that space (no scatter into the full vocabulary and no softmax over it; only a sampled
    node's distribution is spread into the target's vocabulary for verification). Each expanded node gets ``top_k``
    candidates (top-k when greedy, drawn without replacement when sampling); nodes are scored
    by cumulative draft log-probability and the best ``budget`` form the tree. A node whose draft
    distribution has entropy above ``max_entropy`` gets no candidates (the entropy policy, see
    :mod:`draftsmith.eval.engine.policies`), only its entropy in the tree's ``entropy``; drafting stops
    early once no node is left to expand.
    """
    builder = TreeBuilder()
    frontier, logits = [ROOT], root_logits.view(1, -1)
    for level in range(depth):
        if level:
            logits = expand(frontier, builder)
        packed, probs, k = choose_packed(logits, top_k, sampling, generator, max_entropy, vocab, vocab_size)
        rows = packed.tolist()  # one read-back per level: scores, tokens and entropies together
        added: list[int] = []
        for i, parent in enumerate(frontier):
            added += (
                _add_candidates(builder, parent, rows[i], k, probs[i] if probs is not None else None, max_entropy) or []
            )
        frontier = sorted(added, key=lambda n: -builder.scores[n])[:top_k]
        if not frontier:
            break
    return builder.build(budget)


def grow_chain(
    logits: torch.Tensor,
    sampling,
    generator: torch.Generator | None = None,
    max_entropy: float | None = None,
    vocab: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> TokenTree:
    """A chain drafted in one pass (the parallel drafters): row d of ``logits`` ``[K, V]`` is depth d + 1's
    distribution, which does not depend on the tokens chosen above it, so every depth's token is
    chosen at once and read back together (one host sync, where :func:`grow_tree` takes one per
    level). ``vocab``/``vocab_size`` and ``max_entropy`` as in :func:`grow_tree`: the chain ends
    above the first depth less certain than ``max_entropy``.
    """
    packed, probs, k = choose_packed(logits, 1, sampling, generator, max_entropy, vocab, vocab_size)
    return packed_chain(packed.tolist(), probs, k, max_entropy, len(logits))


def packed_chain(rows: list[list[float]], probs, k: int, max_entropy: float | None, length: int) -> TokenTree:
    """The chain of the first ``length`` read-back ``rows`` of :func:`choose_packed`, one a depth
    (``probs``: the rows' sampled distributions, None when greedy): how a drafter choosing each depth
    on the device (a Markov head's, :mod:`draftsmith.eval.engine.drafters.dflash`) makes its tree."""
    builder, parent = TreeBuilder(), ROOT
    for depth, row in enumerate(rows[:length]):
        added = _add_candidates(builder, parent, row, k, probs[depth] if probs is not None else None, max_entropy)
        if added is None:
            break
        parent = added[0]
    return builder.build()
