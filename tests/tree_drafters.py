"""Test-local drafters that exercise tree verification: random trees and the known greedy path
hidden among wrong siblings (shared by the lossless tests of every target architecture)."""

from __future__ import annotations

import random

from draftsmith.eval.engine.drafters.base import DraftContext, Drafter
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder


def random_subtree(
    builder: TreeBuilder, rng: random.Random, parent: int, levels: int, vocab: int, avoid: set[int] = frozenset()
) -> None:
    """Random tokens hanging below ``parent``, ``levels`` deep at most."""
    if levels <= 0:
        return
    tokens = [t for t in rng.sample(range(vocab), rng.randint(1, 3)) if t not in avoid]
    if not tokens:
        return
    for node in builder.add(parent, tokens):
        if rng.random() < 0.4:
            random_subtree(builder, rng, node, levels - 1, vocab)


class RandomTreeDrafter(Drafter):
    """Random trees of random tokens (nothing useful to accept; exercises the reject-all commit)."""

    name = "random_tree"

    def __init__(self, vocab: int, seed: int = 0, max_depth: int = 4):
        self.vocab, self.rng, self.max_depth = vocab, random.Random(seed), max_depth

    def propose(self, context: DraftContext) -> TokenTree:
        builder = TreeBuilder()
        random_subtree(builder, self.rng, ROOT, min(self.max_depth, context.max_tokens), self.vocab)
        return builder.build()


class GreedyPrefixDrafter(Drafter):
    """Peeks at the known greedy continuation: the first ``k`` (random) tokens of it, hidden among
    random siblings and random wrong subtrees, so the accepted rows are scattered through the tree
    and commit() has to gather non-contiguous rows. Records how many tokens each step must yield.
    """

    name = "greedy_prefix"

    def __init__(self, prompt: list[int], continuation: list[int], vocab: int, seed: int = 0, max_depth: int = 7):
        self.full = list(prompt) + list(continuation)
        self.prompt_length, self.continuation_length = len(prompt), len(continuation)
        self.vocab, self.rng, self.max_depth = vocab, random.Random(seed), max_depth
        self.expected: list[int] = []
        self.noncontiguous = 0

    def propose(self, context: DraftContext) -> TokenTree:
        n = len(context.tokens)
        assert context.tokens == self.full[:n], "decoding left the greedy path"
        k = self.rng.randint(0, min(self.max_depth, context.max_tokens))
        true = self.full[n : n + k]
        builder = TreeBuilder()
        parent = ROOT
        for depth, token in enumerate(true):
            wrong = [t for t in self.rng.sample(range(self.vocab), self.rng.randint(0, 3)) if t != token]
            siblings = list(wrong)
            siblings.insert(self.rng.randint(0, len(wrong)), token)
            nodes = builder.add(parent, siblings)
            for sibling, node in zip(siblings, nodes):
                if sibling != token and self.rng.random() < 0.5:
                    random_subtree(builder, self.rng, node, min(2, context.max_tokens - depth - 1), self.vocab)
            parent = nodes[siblings.index(token)]
        # Wrong guesses below the last correct node (never the true next token).
        room = context.max_tokens - len(true)
        if room > 0 and self.rng.random() < 0.7:
            random_subtree(
                builder,
                self.rng,
                parent,
                min(2, room),
                self.vocab,
                avoid={self.full[n + len(true)]} if n + len(true) < len(self.full) else set(),
            )
        tree = builder.build()
        generated = n - self.prompt_length
        self.expected.append(min(len(true) + 1, self.continuation_length - generated))
        # Count proposals whose correct rows are not a prefix of the row order.
        node, path = ROOT, []
        for token in true:
            node = tree.child_by_token(node, token)
            path.append(node)
        if path and path != list(range(len(path))):
            self.noncontiguous += 1
        return tree
