"""A separate draft language model sharing the target's tokenizer (chains or dynamic trees).

It keeps its own KV cache: each step it feeds the tokens it has not seen (the accepted ones and
the target's bonus token, in one forward), drafts on pending tree rows, then discards them, so
rejected guesses never stay in its cache.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder, grow_tree
from draftsmith.heads.draft_lm import derive_draft_lm, draft_vocab_from_counts, load_draft_lm
from draftsmith.heads.vocab import scatter_to_vocab


class DraftVocabLMHead:
    """A draft LM's LM head over a subset of token ids (FR-Spec style): full-vocabulary fp32 logits
    with ``-inf`` outside the subset, so drafts never leave it and the draft probabilities the
    verifier sees are exactly the ones sampled from (sampling stays lossless)."""

    def __init__(self, lm_head: torch.nn.Module, token_ids: torch.Tensor):
        self.token_ids = token_ids.to(lm_head.weight.device).long()
        self.vocab_size = lm_head.weight.shape[0]
        self.weight = lm_head.weight.detach()[self.token_ids]  # gathered once: the head is frozen
        self.bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()[self.token_ids]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return scatter_to_vocab(
            torch.nn.functional.linear(hidden, self.weight, self.bias), self.token_ids, self.vocab_size
        )


class DraftLMDrafter(Drafter):
    """Autoregressive drafting with a small causal LM: a chain (``top_k=1``) or a dynamic tree.

    ``draft_vocab``: token ids to draft from (the LM head scores only those rows); on small
    models the LM head is most of a draft step's cost.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        depth: int = 4,
        top_k: int = 1,
        budget: int | None = None,
        name: str = "draft_lm",
        draft_vocab: torch.Tensor | None = None,
    ):
        lm_head = None if draft_vocab is None else DraftVocabLMHead(model.get_output_embeddings(), draft_vocab)
        self.runner = CausalLMRunner(model, lm_head=lm_head)
        self.depth, self.top_k = depth, top_k
        self.budget = budget if budget is not None else depth * top_k
        self.name = name
        self.cached: list[int] = []

    def assistant(self):
        """The draft LM itself, at this drafter's depth (``generate(assistant_model=...)``)."""
        return self.runner.model, self.depth

    def runners(self) -> list:
        return [self.runner]

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self.runner.reset()
        self.cached = []

    def sync(self, tokens: list[int], rows: int = 1) -> torch.Tensor:
        """Bring the cache up to ``tokens`` (one forward over what it lacks) and return the logits
        after each of the last ``rows`` tokens, ``[rows, V]``."""
        common = 0
        limit = min(len(self.cached), len(tokens) - rows)  # always re-run at least the last rows
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        self.runner.rollback(common)
        hidden = self.runner.forward(tokens[common:])
        self.cached = list(tokens)
        return self.runner.logits(hidden[-rows:])

    def _expand(self, frontier: list[int], builder: TreeBuilder) -> torch.Tensor:
        base = self.runner.pending
        parents = [self._row[builder.parents[n]] for n in frontier]
        depths = [builder.depths[n] - 1 for n in frontier]  # the root is already in the cache
        hidden = self.runner.forward([builder.tokens[n] for n in frontier], parents, depths)
        for i, node in enumerate(frontier):
            self._row[node] = base + i
        return self.runner.logits(hidden)

    def propose(self, context: DraftContext) -> TokenTree:
        depth = min(self.depth, context.max_tokens)
        root_logits = self.sync(context.tokens)[0]
        if depth < 1:
            return TokenTree()
        self._row = {ROOT: ROOT}
        tree = grow_tree(
            root_logits,
            self._expand,
            depth,
            self.top_k,
            self.budget,
            context.sampling,
            context.generator,
            context.max_entropy,
        )
        self.runner.commit([])  # drafted rows never stay: accepted ones are re-fed with the bonus token
        return tree


def build(spec: DrafterSpec, target: PreTrainedModel) -> DraftLMDrafter:
    """The drafter of ``draft_lm[:PATH]?...``: the model in ``PATH``, or layers cut from ``target``."""
    options = dict(spec.options)
    layers = options.pop("layers", 4)
    vocab = options.pop("vocab", None)
    if vocab is not None and not spec.path:
        raise UsageError("draft_lm option vocab=N needs a trained draft LM (draft_lm:PATH) with token counts")
    if spec.path:
        param = next(target.parameters())
        model = load_draft_lm(spec.path, param.dtype, param.device)
        if vocab is not None:
            options["draft_vocab"] = draft_vocab_from_counts(spec.path, int(vocab), model)
    else:
        model = cut_from_target(target, layers, "draft_lm option layers")
    return DraftLMDrafter(model, **options)


def cut_from_target(target: PreTrainedModel, layers, field: str) -> PreTrainedModel:
    """A draft LM of the target's own layers: ``layers`` is a count (evenly spaced, first and last
    kept) or comma-separated indices (``0,1,8,29``), as a spec's option gives it (``field`` names it)."""
    if isinstance(layers, int):
        return derive_draft_lm(target, num_layers=layers)
    try:
        indices = [int(i) for i in str(layers).split(",")]
    except ValueError:
        raise UsageError(
            f"{field}={layers!r}: give a count or comma-separated layer indices, e.g. 4 or 0,1,2,29"
        ) from None
    return derive_draft_lm(target, layers=indices)
