"""Prompt lookup decoding (training-free): continue the context where its last n-gram recurred.

As in Saxena's prompt lookup and HF ``prompt_lookup_num_tokens``, the longest suffix n-gram
(``max_ngram`` down to ``min_ngram``) is searched for earlier in the context; the tokens that
followed it are the draft. With ``branches > 1`` the continuations of several distinct matches
(most recent first) are merged into one tree.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder


class PromptLookupDrafter(Drafter):
    """N-gram matching against the prompt and the text generated so far."""

    # Defaults measured on the bundled target (BENCHMARKS.md): a verification pass of 2+ tokens
    # costs ~1.6x a single-token pass in fp32 on a CPU, and unigram matches are wrong too often
    # to pay for it; bigram-or-longer matches with 10-token drafts do.
    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 2, branches: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise UsageError(f"prompt_lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram, self.branches = num_tokens, max_ngram, min_ngram, branches
        self.name = "prompt_lookup"

    def continuations(self, tokens: list[int], length: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of the longest recurring suffix n-gram."""
        context = np.asarray(tokens)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(context[:-1], n)  # excludes the suffix matching itself
            starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
            for start in starts[::-1]:
                follow = context[start + n : start + n + length].tolist()
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == self.branches:
                        return found
            if found:
                return found
        return found

    def propose(self, context: DraftContext) -> TokenTree:
        builder = TreeBuilder()
        draft_len = min(self.num_tokens, context.max_tokens)
        paths = self.continuations(context.tokens, draft_len) if draft_len > 0 else []
        # Merge the paths into a trie; candidates of a parent are added together, in rank order.
        trie: dict[tuple[int, ...], list[int]] = {}
        for path in paths:
            for depth in range(len(path)):
                siblings = trie.setdefault(tuple(path[:depth]), [])
                if path[depth] not in siblings:
                    siblings.append(path[depth])
        node_of: dict[tuple[int, ...], int] = {(): ROOT}
        for prefix in sorted(trie, key=len):
            ids = builder.add(node_of[prefix], trie[prefix])
            for token, node in zip(trie[prefix], ids):
                node_of[prefix + (token,)] = node
        return builder.build()


def build(spec: DrafterSpec, target) -> PromptLookupDrafter:
    """The drafter of ``prompt_lookup?...`` (the target is not needed: it looks in the context)."""
    return PromptLookupDrafter(**spec.options)
