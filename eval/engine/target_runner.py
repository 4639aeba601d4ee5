"""A Hugging Face causal LM with a KV cache that scores token trees in one forward pass.

Tree tokens attend to the cached prefix and to their own ancestors only (an additive 4D mask:
boolean masks are silently wrong with eager attention), at positions given by their depth.
After verification only the accepted rows stay in the cache, so the next step starts from the
exact cache plain decoding would have. The same class runs the target and any draft LM.

With static shapes (``cuda_graphs``; on by default on CUDA) one-token chains and tree forwards of
up to :data:`TREE_BUCKETS`' largest size are padded to a bucket and run over the cache's whole
capacity, replayed from one CUDA graph per bucket (:mod:`draftsmith.eval.engine.static_forward`).

Sliding-window layers (Mistral's ``sliding_window``, Gemma/Qwen ``layer_types``) keep their full
history in the cache and get the window in their own mask: a window-sized cache would have
evicted keys that a rejected tree row still needs rolled back. Only attention implementations
that apply a 4D float mask (sdpa, eager) can verify trees; others are refused.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.errors import UsageError
from draftsmith.eval.engine.kv_cache import SlotCache
from draftsmith.eval.engine.prepack import prepack_linears
from draftsmith.eval.engine.static_forward import StaticForward
from draftsmith.eval.engine.tree import ROOT, ancestor_mask
from draftsmith.target import final_logits

MASKED_ATTENTION = ("sdpa", "eager")  # implementations that honour an additive 4D mask
# Tree forwards padded up to one of these sizes (then to multiples of the last) when the decoder
# is compiled with bucketing, so a compiled forward sees a few row counts instead of every one.
TREE_BUCKETS = (1, 4, 8, 16, 32, 64)
FULL, SLIDING = "full_attention", "sliding_attention"
CUDA_GRAPHS = ("auto", "on", "off")  # auto: static shapes and CUDA graphs on CUDA devices only
_default_cuda_graphs = "auto"  # what runners made without an explicit mode take (use_cuda_graphs)
# The least cache capacity with static shapes: the graphs address the buffer, and a buffer that
# grows (doubling) is recaptured, so it starts large enough for most requests at once.
STATIC_CAPACITY = 2048


class UnsupportedTargetError(UsageError):
    """A model the tree engine cannot verify with exactly (attention implementation, layer type)."""


class ContextLengthError(UsageError):
    """A generation that would run past a model's maximum positions."""


def use_cuda_graphs(mode: str) -> None:
    """The mode every runner made from now on without an explicit ``cuda_graphs`` takes: the target's,
    the drafters', the tree planners' pass-cost runners (a CLI's ``--cuda-graphs``)."""
    global _default_cuda_graphs
    if mode not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, not {mode!r}")
    _default_cuda_graphs = mode


def graph_blocker(config) -> str | None:
    """Why a model's forward cannot be captured in a CUDA graph (it reads a device value on the
    host), or None: RoPE types that rescale by the longest position, and routed mixtures of experts."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"rope_type {rope.get('rope_type', rope.get('type'))} reads the longest position on the host"
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, field, None):
            return f"{config.model_type}'s expert routing ({field}) sizes its work on the host"
    return None


def attention_layout(config) -> tuple[list[str], int | None]:
    """The attention layer types of ``config``'s decoder (each takes its own mask) and its sliding
    window; refuses what the engine cannot mask."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        raise UnsupportedTargetError(
            f"{config.model_type}: attention implementation {impl!r} ignores the 4D tree mask, so trees "
            f'would verify wrongly; load the model with attn_implementation="sdpa" (or "eager")'
        )
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral-style: every layer windowed when a window is set
        return [SLIDING if window is not None else FULL], window
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedTargetError(
            f"{config.model_type}: layer type(s) {', '.join(unknown)} cannot verify token trees "
            f"(only {FULL} and {SLIDING}); use plain decoding or HF generate for this model"
        )
    return sorted(set(types)), window if SLIDING in types else None


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _on(values, device: torch.device) -> torch.Tensor:
    """Token ids, parents or depths as a long tensor on ``device`` (a no-op for device tensors)."""
    return torch.as_tensor(values, dtype=torch.long, device=device)


class CausalLMRunner:
    """Incremental forward passes (chains or trees) over one sequence with a preallocated
    :class:`~draftsmith.eval.engine.kv_cache.SlotCache`; masks and positions are built on the device."""

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        *,
        decoder=None,
        lm_head=None,
        config=None,
        capture_layers: list[int] | None = None,
        prepack: str = "auto",
        cuda_graphs: str | None = None,
    ):
        """Wrap an HF causal LM, or any ``decoder`` (HF-decoder-like forward) with an ``lm_head`` callable.

        With ``capture_layers`` every forward also keeps those layers' hidden states (HF
        ``hidden_states[L]``, the input of decoder layer L), concatenated, in :attr:`captured`.
        ``prepack``: the CPU linears' weights packed once for oneDNN (:mod:`draftsmith.eval.engine.prepack`;
        ``auto``: where measured faster; a compiled decoder is left to the compiler).
        ``cuda_graphs``: ``on`` runs one-token and tree forwards with static shapes, replayed from
        CUDA graphs on a CUDA device (eagerly elsewhere: how a CPU tests that path); ``auto``: on
        for a CUDA device unless the decoder is compiled; ``off``: shapes as they come; None: the
        process's default (:func:`use_cuda_graphs`, ``auto`` unless set). A model whose forward cannot
        be captured (:func:`graph_blocker`) keeps the static shapes and runs them eagerly.
        """
        self.model = model
        self.capture_layers = list(capture_layers) if capture_layers else None
        self.captured: torch.Tensor | None = None  # [n, len(capture_layers) * H] of the last forward
        self.decoder = decoder if decoder is not None else model.get_decoder()
        self.lm_head = lm_head if lm_head is not None else model.get_output_embeddings()
        self.config = config if config is not None else model.config
        param = next(self.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        if not hasattr(self.decoder, "tree_buckets"):  # set by compile_decoder
            for module in (self.decoder, self.lm_head):
                if isinstance(module, torch.nn.Module):
                    prepack_linears(module, prepack)
        self.layer_types, self.window = attention_layout(self.config)
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        # A causal LM's forward scales or squashes the LM head's logits (final_logits); a given
        # lm_head callable returns them final.
        self.head_config = self.config if model is not None else None
        # Row counts tree forwards are padded to (see compile_decoder); None: as they come.
        self.buckets: tuple[int, ...] | None = getattr(self.decoder, "tree_buckets", None)
        self.set_cuda_graphs(cuda_graphs)
        self.cache: SlotCache | None = None
        self.length = 0  # committed tokens in the cache
        self.pending = 0  # tree rows run but not yet committed or discarded
        self._parents = self._depths = None  # of the pending rows, on the device
        self._levels = 0  # longest parent chain among the pending rows

    def set_cuda_graphs(self, mode: str | None) -> None:
        """Static shapes and CUDA graphs ``on``, ``off``, ``auto`` or the default (see the constructor)."""
        mode = mode or _default_cuda_graphs
        if mode not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, not {mode!r}")
        compiled = hasattr(self.decoder, "tree_buckets")
        static = mode == "on" or (mode == "auto" and self.device.type == "cuda" and not compiled)
        self.static = StaticForward(self._static_body, blocker=graph_blocker(self.config)) if static else None
        self._static_buffer = (0, 0)  # (address, capacity) of the cache buffer the graphs were made for
        # The extra inputs' shapes past the row dimension, by the set of input names seen (capture_buckets)
        self._extra_shapes: dict[tuple[str, ...], dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}

    def reset(self, capacity: int | None = None) -> None:
        """Forget the sequence (the cache's buffer stays allocated); ``capacity``: rows to make room for."""
        if self.cache is None:
            self.cache = SlotCache(self.config.num_hidden_layers)
        self.cache.crop(0)
        if self.static is not None:
            capacity = max(capacity or 0, STATIC_CAPACITY)
        if capacity is not None:
            self.cache.reserve(capacity)
        self.length = 0
        self._discard()

    def capture_buckets(self) -> None:
        """Run (and so capture) a tree forward of every bucket size now, for every set of extra inputs
        seen so far (zeros of their shapes), so no capture falls inside a timed generation; keeps
        nothing. Needs the cache's buffer (after a first forward)."""
        if self.static is None or self.cache is None or self.cache.buffer is None or self.pending:
            return
        for shapes in list(self._extra_shapes.values()) or [{}]:
            for size in TREE_BUCKETS:
                extra = {
                    name: torch.zeros(1, size, *rest, dtype=dtype, device=self.device)
                    for name, (rest, dtype) in shapes.items()
                }
                self.forward([0] * size, [ROOT] * size, [0] * size, levels=1, **extra)
                self.commit([])

    def _discard(self) -> None:
        self.pending, self._parents, self._depths, self._levels = 0, None, None, 0

    @property
    def pending_parents(self) -> list[int]:
        """Parents of the pending rows (for inspection: reads them back from the device)."""
        return [] if self._parents is None else self._parents.tolist()

    def check_context(self, positions: int, what: str = "the request") -> None:
        """Raise :class:`ContextLengthError` when ``positions`` tokens exceed the model's maximum."""
        if self.max_positions is not None and positions > self.max_positions:
            raise ContextLengthError(
                f"{what} needs {positions} positions but {self.config.model_type} has "
                f"max_position_embeddings={self.max_positions}; shorten the prompt or lower max_new_tokens"
            )

    def _mask(self, n: int, depths: torch.Tensor, width: int | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive 4D mask of the last ``n`` pending rows over cache + pending rows (over ``width``
        columns when given, the rest hidden): one tensor, or one per layer type when sliding and
        full layers mix (transformers' decoders take such a mapping)."""
        filled = self.length + self.pending
        width = width or filled
        ancestors = ancestor_mask(self._parents, self._levels)[-n:]
        allowed = torch.zeros(n, width, dtype=torch.bool, device=self.device)
        allowed[:, : self.length] = True
        allowed[:, self.length : filled] = ancestors
        masks = {FULL: allowed, SLIDING: allowed}
        if self.window is not None:
            # Keys at most window - 1 positions behind the query, as transformers' sliding masks.
            keys = torch.cat([torch.arange(self.length, device=self.device), self._depths + self.length])
            keys = torch.cat([keys, keys.new_zeros(width - filled)])  # columns past the filled ones stay hidden
            masks[SLIDING] = allowed & (depths[:, None] + self.length - keys[None, :] < self.window)
        out = {kind: _additive(masks[kind], self.dtype) for kind in self.layer_types}
        return out if len(out) > 1 else out[self.layer_types[0]]

    @torch.no_grad()
    def forward(
        self,
        tokens: list[int] | torch.Tensor,
        parents: list[int] | torch.Tensor | None = None,
        depths: list[int] | torch.Tensor | None = None,
        levels: int | None = None,
        **inputs,
    ) -> torch.Tensor:
        """Run ``tokens`` after the committed prefix and return their last hidden states ``[n, H]``.

        Without ``parents`` the tokens form a chain and are committed at once. With ``parents``
        they are tree rows at positions ``length + depths``: ``parents`` index all pending rows
        (earlier tree forwards first, then these), ``-1`` for rows that hang directly off the
        committed prefix. Tree rows stay pending, so a tree can grow over several forwards, until
        :meth:`commit` keeps the accepted ones. Device tensors are used as they are (nothing is
        copied to the device); ``levels`` bounds the depth these rows add (host int; taken from
        ``depths`` when it is a list). Extra ``inputs`` (e.g. EAGLE's ``features``) go to the
        decoder as they are. With :attr:`buckets`, tree rows are padded to a bucket size: the
        padding rows stay pending (they count in :attr:`pending`) and are not returned.
        """
        if self.cache is None:
            self.reset()
        if parents is None and self.pending:
            raise RuntimeError("commit() the pending tree rows before extending the chain")
        ids = _on(tokens, self.device).view(1, -1)
        n = real = ids.shape[1]
        if self.static is not None and (parents is not None or n == 1) and n <= TREE_BUCKETS[-1]:
            return self._forward_static(ids, parents, depths, levels, inputs)
        if parents is None:
            self.check_context(self.length + n)
            positions = torch.arange(self.length, self.length + n, device=self.device)
            mask = None
        else:
            ids, depths = self._pend(ids, parents, depths, levels, self.buckets, inputs)
            n = ids.shape[1]
            positions = depths + self.length
            mask = self._mask(n, depths)
        if self.capture_layers:
            inputs["output_hidden_states"] = True
        out = self.decoder(
            input_ids=ids,
            position_ids=positions.view(1, -1),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            **inputs,
        )
        if self.capture_layers:
            self.captured = torch.cat([out.hidden_states[layer][0, :real] for layer in self.capture_layers], dim=-1)
        if parents is None:
            self.length += n
        return out.last_hidden_state[0, :real]

    def _pend(self, ids: torch.Tensor, parents, depths, levels, buckets, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Add tree rows to the pending ones (padded to ``buckets`` when given); returns their ids
        and depths as run."""
        n = ids.shape[1]
        deepest = max(depths) if isinstance(depths, list) else levels if levels is not None else self.pending + n
        if levels is None:
            levels = max(depths) - min(depths) + 1 if isinstance(depths, list) else n
        self.check_context(self.length + deepest + 1)
        parents, depths = _on(parents, self.device), _on(depths, self.device)
        if buckets:
            ids, parents, depths = self._pad(ids, parents, depths, buckets, inputs)
        self._parents = parents if self._parents is None else torch.cat([self._parents, parents])
        self._depths = depths if self._depths is None else torch.cat([self._depths, depths])
        self._levels += levels
        self.pending += ids.shape[1]
        return ids, depths

    def _pad(self, ids: torch.Tensor, parents, depths, buckets: tuple[int, ...], inputs: dict):
        """Tree rows padded up to the next bucket size: extra rows hang off the committed prefix
        (parent -1, depth 0), no real row attends to them and no commit keeps them. Extra
        ``inputs`` with a row per token (e.g. EAGLE's features) get zero rows, in place."""
        n = ids.shape[1]
        size = next((b for b in buckets if b >= n), -(-n // buckets[-1]) * buckets[-1])
        if size == n:
            return ids, parents, depths
        pad = size - n
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] == n:
                inputs[name] = torch.cat([value, value.new_zeros(value.shape[0], pad, *value.shape[2:])], 1)
        return (
            torch.cat([ids, ids.new_zeros(1, pad)], 1),
            torch.cat([parents, parents.new_full((pad,), ROOT)]),
            torch.cat([depths, depths.new_zeros(pad)]),
        )

    def _forward_static(self, ids: torch.Tensor, parents, depths, levels, inputs) -> torch.Tensor:
        """:meth:`forward` with static shapes: rows padded to a bucket, written at device slots,
        attending over the cache's whole capacity; a one-token chain is a one-row tree kept at once."""
        real = ids.shape[1]
        chain = parents is None
        if chain:
            parents, depths, levels = [ROOT], [0], 1
        start = self.length + self.pending
        ids, depths = self._pend(ids, parents, depths, levels, TREE_BUCKETS, inputs)
        n = ids.shape[1]
        self.cache.reserve(start + n)
        static = {
            "input_ids": ids,
            "position_ids": (depths + self.length).view(1, -1),
            "slots": torch.arange(start, start + n, device=self.device),
            "attention_mask": self._mask(n, depths, self.cache.capacity),
            **inputs,
        }
        names = tuple(sorted(inputs))
        if names not in self._extra_shapes:
            self._extra_shapes[names] = {k: (tuple(inputs[k].shape[2:]), inputs[k].dtype) for k in names}
        if self.cache.buffer is None:  # the first forward allocates the buffer: run it as it comes
            outputs = self._static_body(**static)
        else:
            buffer = (self.cache.buffer.data_ptr(), self.cache.capacity)
            if buffer != self._static_buffer:  # new or grown: the graphs address the old one
                self.static.clear()
                self._static_buffer = buffer
            outputs = self.static((n, *names), static)
        self.cache.crop(self.length + self.pending)
        hidden = outputs[0][0, :real].clone()
        if self.capture_layers:
            self.captured = outputs[1][:real].clone()
        if chain:
            self.keep(None, 1)
        return hidden

    def _static_body(self, input_ids, position_ids, slots, attention_mask, **inputs) -> tuple[torch.Tensor, ...]:
        """The decoder's forward with static cache writes: (last hidden states, captured layers)."""
        if self.capture_layers:
            inputs["output_hidden_states"] = True
        self.cache.slots = slots
        try:
            out = self.decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=self.cache,
                use_cache=True,
                **inputs,
            )
        finally:
            self.cache.slots = None
        if not self.capture_layers:
            return (out.last_hidden_state,)
        return out.last_hidden_state, torch.cat([out.hidden_states[layer][0] for layer in self.capture_layers], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on selected hidden states, in fp32, as the model's forward gives them."""
        return final_logits(self.head_config, self.lm_head(hidden))

    def commit(self, rows: list[int]) -> None:
        """Keep the pending rows ``rows`` (ascending, each row's ancestors included) in the cache."""
        if rows == list(range(len(rows))):
            self.keep(None, len(rows))
        else:
            self.keep(_on(rows, self.device), len(rows))

    def keep(self, order: torch.Tensor | None, count: int) -> None:
        """Keep pending rows ``order[:count]`` (a device tensor; None: the first ``count`` rows as
        they are), with one gather for all layers and nothing read back from the device."""
        if order is not None:
            self.cache.compact(self.length, order, count)
        else:
            self.cache.crop(self.length + count)
        self.length += count
        self._discard()

    def rollback(self, length: int) -> None:
        """Drop committed tokens past ``length`` (a draft model rejecting its own guesses)."""
        if self.pending:
            self.commit([])
        if length < self.length:
            self.cache.crop(length)
            self.length = length


def compile_decoder(model: PreTrainedModel, buckets: tuple[int, ...] | None = None) -> None:
    """``torch.compile`` ``model``'s decoder forward in place, with dynamic shapes (the context
    changes every step); the LM head and the engine stay eager. With ``buckets`` (e.g.
    :data:`TREE_BUCKETS`) runners made afterwards pad tree forwards to those row counts."""
    decoder = model.get_decoder()
    decoder.forward = torch.compile(decoder.forward, dynamic=True)
    decoder.tree_buckets = buckets


def tree_rows(parents: list[int], depths: list[int]) -> tuple[list[int], list[int]]:
    """Row parents and depths for ``[root token] + tree``: the root is row 0 at depth 0."""
    return [ROOT] + [p + 1 for p in parents], [0] + list(depths)
