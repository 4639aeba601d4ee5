"""A Hugging Face causal LM with a KV cache that scores token trees in one forward pass.

Tree tokens attend to the cached prefix and to their own ancestors only (an additive 4D mask:
boolean masks are silently wrong with eager attention), at positions given by their depth.
After verification only the accepted rows stay in the cache, so the next step starts from the
exact cache plain decoding would have. The same class runs the target and any draft LM.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from draftsmith.eval.tree import ROOT, ancestor_mask


class CausalLMRunner:
    """Incremental forward passes (chains or trees) over one sequence with a ``DynamicCache``."""

    def __init__(self, model: PreTrainedModel | None = None, *, decoder=None, lm_head=None, config=None):
        """Wrap an HF causal LM, or any ``decoder`` (HF-decoder-like forward) with an ``lm_head`` callable."""
        self.model = model
        self.decoder = decoder if decoder is not None else model.get_decoder()
        self.lm_head = lm_head if lm_head is not None else model.get_output_embeddings()
        self.config = config if config is not None else model.config
        param = next(self.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: DynamicCache | None = None
        self.length = 0  # committed tokens in the cache
        self.pending_parents: list[int] = []  # tree rows run but not yet committed or discarded

    def reset(self) -> None:
        """Forget the sequence."""
        self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.pending_parents = []

    def _mask(self, parents: list[int]) -> torch.Tensor:
        n = len(parents)
        rows = self.pending_parents + parents
        allowed = torch.ones(n, self.length + len(rows), dtype=torch.bool)
        allowed[:, self.length:] = ancestor_mask(rows)[-n:]
        mask = torch.zeros(n, self.length + len(rows), dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)

    @torch.no_grad()
    def forward(self, tokens: list[int] | torch.Tensor, parents: list[int] | None = None,
                depths: list[int] | None = None, **inputs) -> torch.Tensor:
        """Run ``tokens`` after the committed prefix and return their last hidden states ``[n, H]``.

        Without ``parents`` the tokens form a chain and are committed at once. With ``parents``
        they are tree rows at positions ``length + depths``: ``parents`` index all pending rows
        (earlier tree forwards first, then these), ``-1`` for rows that hang directly off the
        committed prefix. Tree rows stay pending, so a tree can grow over several forwards, until
        :meth:`commit` keeps the accepted ones. Extra ``inputs`` (e.g. EAGLE's ``features``) go
        to the decoder as they are.
        """
        if self.cache is None:
            self.reset()
        if parents is None and self.pending_parents:
            raise RuntimeError("commit() the pending tree rows before extending the chain")
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(1, -1)
        n = ids.shape[1]
        if parents is None:
            positions = torch.arange(self.length, self.length + n, device=self.device)
            mask = None
        else:
            positions = torch.as_tensor(depths, device=self.device) + self.length
            mask = self._mask(parents)
        out = self.decoder(
            input_ids=ids, position_ids=positions.view(1, -1), attention_mask=mask,
            past_key_values=self.cache, use_cache=True, **inputs,
        )
        if parents is None:
            self.length += n
        else:
            self.pending_parents = self.pending_parents + list(parents)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on selected hidden states, in fp32."""
        return self.lm_head(hidden).float()

    def commit(self, rows: list[int]) -> None:
        """Keep the pending rows ``rows`` (ascending, each row's ancestors included) in the cache."""
        start = self.length
        if rows != list(range(len(rows))):
            index = torch.as_tensor(rows, device=self.device) + start
            for layer in self.cache.layers:
                layer.keys[:, :, start:start + len(rows)] = layer.keys[:, :, index]
                layer.values[:, :, start:start + len(rows)] = layer.values[:, :, index]
        drop = len(self.pending_parents) - len(rows)
        if drop:
            self.cache.crop(-drop)
        self.length += len(rows)
        self.pending_parents = []

    def rollback(self, length: int) -> None:
        """Drop committed tokens past ``length`` (a draft model rejecting its own guesses)."""
        if self.pending_parents:
            self.commit([])
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length


def tree_rows(parents: list[int], depths: list[int]) -> tuple[list[int], list[int]]:
    """Row parents and depths for ``[root token] + tree``: the root is row 0 at depth 0."""
    return [ROOT] + [p + 1 for p in parents], [0] + list(depths)
