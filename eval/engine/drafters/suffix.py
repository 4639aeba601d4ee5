"""SuffixDecoding (Oliaro et al., 2024; Snowflake's Arctic Inference): training-free drafts from
suffix trees over the prompt, the output so far and earlier outputs.

Through ``arctic_inference.suffix_decoding``, the library vLLM's ``suffix`` method calls, used as
vLLM 0.32 uses it: each generation is a request whose prompt gets its own suffix tree
(``start_request``), every step's accepted tokens extend it and a global tree of earlier
responses (``add_active_response``; the last ``max_cached_requests`` generations, FIFO), and a
draft is the best-scoring continuation of the context's longest matching suffix, at most
``max_spec_factor x match length + max_spec_offset`` tokens and never a node whose estimated
probability (a frequency ratio along the path) falls below ``min_token_prob``. vLLM verifies the
path only; ``shape=tree`` drafts the best-first tree the library can also grow.

The tree carries each node's estimated probability (as a log in ``TokenTree.scores``): the hybrid
drafter ranks suffix nodes against a learned drafter's by it. Drafts are deterministic, so
sampling verification treats them as one-hot proposals (lossless).
"""

from __future__ import annotations

import itertools
import math

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder

SHAPES = ("path", "tree")
INSTALL = (
    'pip install nanobind==2.9.2 ninja "cmake>=3.18" && '
    "pip install --no-deps --no-build-isolation arctic-inference==0.3.0 (make install does this)"
)


def _suffix_cache(max_depth: int, max_cached_requests: int):
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise UsageError(f"the suffix drafter needs Snowflake's arctic-inference: {INSTALL}") from None
    return SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)


class SuffixDrafter(Drafter):
    """Suffix-tree drafts over the prompt, the output and the last ``max_cached_requests`` outputs."""

    _ids = itertools.count()

    def __init__(
        self,
        num_tokens: int = 24,
        max_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        shape: str = "path",
    ):
        """Defaults are vLLM 0.32's ``suffix_decoding_*`` defaults (``num_tokens``: its draft cap,
        the tree depth when unset); ``max_depth``: the longest suffix matched and cached pattern."""
        if shape not in SHAPES:
            raise UsageError(f"suffix: shape={shape} is not allowed: choose from {', '.join(SHAPES)}")
        self.cache = _suffix_cache(max_depth, max_cached_requests)
        self.num_tokens, self.max_depth = num_tokens, max_depth
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.tree = shape == "tree"
        self.request: int | None = None
        self.name = "suffix"

    def begin(self, tokens: list[int], hidden=None) -> None:
        if self.request is not None and self.request in self.cache.active_requests:
            self.cache.stop_request(self.request)  # its output stays cached for later generations
        self.request = next(self._ids)
        self.cache.start_request(self.request, tokens[:-1])
        self.cache.add_active_response(self.request, tokens[-1:])

    def accept(self, result: StepResult) -> None:
        self.cache.add_active_response(self.request, result.accepted)

    def propose(self, context: DraftContext) -> TokenTree:
        limit = min(self.num_tokens, context.max_tokens)
        if limit < 1:
            return TokenTree()
        draft = self.cache.speculate(
            self.request,
            context.tokens[-self.max_depth :],
            max_spec_tokens=limit,
            max_spec_factor=self.factor,
            max_spec_offset=self.offset,
            min_token_prob=self.min_prob,
            use_tree_spec=self.tree,
        )
        return self._tree(draft.token_ids, draft.parents, draft.probs)

    def _tree(self, tokens: list[int], parents: list[int], probs: list[float]) -> TokenTree:
        """The library's draft (``parents`` index the draft, -1 the root; ``probs`` each node's
        estimated probability with its ancestors) as a TokenTree scored by those estimates, whose
        candidates per parent come in draft order, i.e. most probable first."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        log_p = {ROOT: 0.0} | {i: math.log(max(p, 1e-30)) for i, p in enumerate(probs)}
        builder, node_of, frontier = TreeBuilder(), {ROOT: ROOT}, [ROOT]
        while frontier:  # breadth first, so every parent precedes its children
            below = [(parent, children[parent]) for parent in frontier if parent in children]
            for parent, ids in below:
                scores = [log_p[i] - log_p[parent] for i in ids]
                node_of.update(zip(ids, builder.add(node_of[parent], [tokens[i] for i in ids], scores)))
            frontier = [i for _, ids in below for i in ids]
        return builder.build()


def build(spec: DrafterSpec, target) -> SuffixDrafter:
    """The drafter of ``suffix?...`` (the target is not needed: it looks in the token history)."""
    return SuffixDrafter(**spec.options)
