"""A Hugging Face causal LM with a KV cache that scores token trees in one forward pass.

Tree tokens attend to the cached prefix and to their own ancestors only (an additive 4D mask:
boolean masks are silently wrong with eager attention), at positions given by their depth.
After verification only the accepted rows stay in the cache, so the next step starts from the
exact cache plain decoding would have. The same class runs the target and any draft LM.

Sliding-window layers (Mistral's ``sliding_window``, Gemma/Qwen ``layer_types``) keep their full
history in the cache and get the window in their own mask: a window-sized cache would have
evicted keys that a rejected tree row still needs rolled back. Only attention implementations
that apply a 4D float mask (sdpa, eager) can verify trees; others are refused.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from draftsmith.errors import UsageError
from draftsmith.eval.tree import ROOT, ancestor_mask

MASKED_ATTENTION = ("sdpa", "eager")  # implementations that honour an additive 4D mask
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedTargetError(UsageError):
    """A model the tree engine cannot verify with exactly (attention implementation, layer type)."""


class ContextLengthError(UsageError):
    """A generation that would run past a model's maximum positions."""


def _attention_layout(config) -> tuple[list[str], int | None]:
    """The attention layer types of ``config``'s decoder (each takes its own mask) and its sliding
    window; refuses what the engine cannot mask."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        raise UnsupportedTargetError(
            f"{config.model_type}: attention implementation {impl!r} ignores the 4D tree mask, so trees "
            f"would verify wrongly; load the model with attn_implementation=\"sdpa\" (or \"eager\")")
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral-style: every layer windowed when a window is set
        return [SLIDING if window is not None else FULL], window
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedTargetError(
            f"{config.model_type}: layer type(s) {', '.join(unknown)} cannot verify token trees "
            f"(only {FULL} and {SLIDING}); use plain decoding or HF generate for this model")
    return sorted(set(types)), window if SLIDING in types else None


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class CausalLMRunner:
    """Incremental forward passes (chains or trees) over one sequence with a ``DynamicCache``."""

    def __init__(self, model: PreTrainedModel | None = None, *, decoder=None, lm_head=None, config=None,
                 capture_layers: list[int] | None = None):
        """Wrap an HF causal LM, or any ``decoder`` (HF-decoder-like forward) with an ``lm_head`` callable.

        With ``capture_layers`` every forward also keeps those layers' hidden states (HF
        ``hidden_states[L]``, the input of decoder layer L), concatenated, in :attr:`captured`.
        """
        self.model = model
        self.capture_layers = list(capture_layers) if capture_layers else None
        self.captured: torch.Tensor | None = None  # [n, len(capture_layers) * H] of the last forward
        self.decoder = decoder if decoder is not None else model.get_decoder()
        self.lm_head = lm_head if lm_head is not None else model.get_output_embeddings()
        self.config = config if config is not None else model.config
        param = next(self.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layer_types, self.window = _attention_layout(self.config)
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        # Gemma-2-style models squash logits in their causal-LM forward, after the LM head.
        self.softcap = getattr(self.config, "final_logit_softcapping", None) if model is not None else None
        self.cache: DynamicCache | None = None
        self.length = 0  # committed tokens in the cache
        self.pending_parents: list[int] = []  # tree rows run but not yet committed or discarded
        self.pending_depths: list[int] = []

    def reset(self) -> None:
        """Forget the sequence."""
        # No config: every layer keeps its full history, sliding ones included (see the module doc).
        self.cache = DynamicCache()
        self.length = 0
        self.pending_parents = []
        self.pending_depths = []

    def check_context(self, positions: int, what: str = "the request") -> None:
        """Raise :class:`ContextLengthError` when ``positions`` tokens exceed the model's maximum."""
        if self.max_positions is not None and positions > self.max_positions:
            raise ContextLengthError(
                f"{what} needs {positions} positions but {self.config.model_type} has "
                f"max_position_embeddings={self.max_positions}; shorten the prompt or lower max_new_tokens")

    def _mask(self, parents: list[int], depths: list[int]) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive 4D mask of tree rows over cache + pending rows: one tensor, or one per layer
        type when sliding and full layers mix (transformers' decoders take such a mapping)."""
        n = len(parents)
        rows = self.pending_parents + parents
        allowed = torch.ones(n, self.length + len(rows), dtype=torch.bool)
        allowed[:, self.length:] = ancestor_mask(rows)[-n:]
        masks = {FULL: allowed, SLIDING: allowed}
        if self.window is not None:
            # Keys at most window - 1 positions behind the query, as transformers' sliding masks.
            keys = torch.cat([torch.arange(self.length), torch.as_tensor(self.pending_depths + depths) + self.length])
            queries = torch.as_tensor(depths) + self.length
            masks[SLIDING] = allowed & (queries[:, None] - keys[None, :] < self.window)
        out = {kind: _additive(masks[kind], self.dtype).to(self.device) for kind in self.layer_types}
        return out if len(out) > 1 else out[self.layer_types[0]]

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
            self.check_context(self.length + n)
            positions = torch.arange(self.length, self.length + n, device=self.device)
            mask = None
        else:
            self.check_context(self.length + max(depths) + 1)
            positions = torch.as_tensor(depths, device=self.device) + self.length
            mask = self._mask(parents, depths)
        if self.capture_layers:
            inputs["output_hidden_states"] = True
        out = self.decoder(
            input_ids=ids, position_ids=positions.view(1, -1), attention_mask=mask,
            past_key_values=self.cache, use_cache=True, **inputs,
        )
        if self.capture_layers:
            self.captured = torch.cat([out.hidden_states[layer][0] for layer in self.capture_layers], dim=-1)
        if parents is None:
            self.length += n
        else:
            self.pending_parents = self.pending_parents + list(parents)
            self.pending_depths = self.pending_depths + list(depths)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on selected hidden states, in fp32."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

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
        self.pending_depths = []

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
