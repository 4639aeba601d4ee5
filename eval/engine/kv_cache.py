"""A preallocated KV cache on transformers' ``Cache`` API, compacted in place after verification.

``DynamicCache`` concatenates each layer's whole cache on every forward (O(context) copies per
step) and keeping an accepted tree path costs several indexing kernels per layer. Here every
layer's keys and values live in one buffer ``[layers, 2, batch, kv_heads, capacity, head_dim]``:
a forward writes its rows in place and attends to a view of the filled part (so the attention
and the mask cover the context, not the capacity, unlike transformers' ``StaticCache``), and
:meth:`SlotCache.compact` keeps the accepted rows of all layers with one gather and one copy.
The capacity grows by doubling when a sequence outgrows it.

Static writes (:attr:`SlotCache.slots` set): a forward writes its rows at the given device slots
and attends to the whole capacity, its mask hiding the unfilled rows, so the forward's shapes and
the addresses it touches stay the same from step to step and it can be replayed from a CUDA graph
(:mod:`draftsmith.eval.engine.static_forward`). The buffer starts zeroed: a masked row must still
hold finite numbers, or its zero attention weight times NaN poisons the output.

Keys and values may differ in size (DeepSeek-V3's multi-head latent attention caches its
compressed ``kv_lora_rank`` latent as keys and its ``qk_rope_head_dim`` rotary part as values):
the buffer's last dimension is the larger, and each reads its own leading part.

Every layer keeps its full history, sliding-window ones included: the runner puts the window in
their masks, since a window-sized cache would already have evicted keys a rejected tree row
needs rolled back.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's view of the shared buffer: rows ``[0, length)`` are filled."""

    is_sliding = False
    is_croppable = True

    def __init__(self, cache: SlotCache, index: int):
        super().__init__()
        self.cache, self.index, self.length = cache, index, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.allocate(key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new rows after the filled ones; return keys and values of all filled rows
        (with static writes: at :attr:`SlotCache.slots`, returning the whole capacity; the runner
        keeps the lengths)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.cache.key_dim, self.cache.value_dim
        slots = self.cache.slots
        if slots is not None:
            buffer = self.cache.buffer[self.index]
            buffer[0, ..., :keys].index_copy_(-2, slots, key_states)
            buffer[1, ..., :values].index_copy_(-2, slots, value_states)
            return buffer[0, ..., :keys], buffer[1, ..., :values]
        n = key_states.shape[-2]
        self.cache.ensure(self.length + n)
        buffer = self.cache.buffer[self.index]
        buffer[0, :, :, self.length : self.length + n, :keys].copy_(key_states)
        buffer[1, :, :, self.length : self.length + n, :values].copy_(value_states)
        self.length += n
        return buffer[0, :, :, : self.length, :keys], buffer[1, :, :, : self.length, :values]

    @property
    def keys(self) -> torch.Tensor | None:
        return (
            None
            if self.cache.buffer is None
            else self.cache.buffer[self.index, 0, :, :, : self.length, : self.cache.key_dim]
        )

    @keys.setter
    def keys(self, value) -> None:  # the base class initialises it; the buffer is the storage
        pass

    @property
    def values(self) -> torch.Tensor | None:
        return (
            None
            if self.cache.buffer is None
            else self.cache.buffer[self.index, 1, :, :, : self.length, : self.cache.value_dim]
        )

    @values.setter
    def values(self, value) -> None:
        pass

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` rows (transformers' convention: a negative count)."""
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


class SlotCache(Cache):
    """The cache of ``num_layers`` attention layers in one preallocated buffer (see the module doc)."""

    def __init__(self, num_layers: int, capacity: int = 256):
        super().__init__(layers=[])
        self.layers = [SlotLayer(self, i) for i in range(num_layers)]
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None  # static writes' rows (see the module doc); None: append
        self.key_dim = self.value_dim = 0  # the sizes of a key and of a value (the buffer holds the larger)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the buffer from the first layer's key and value shapes (every layer must share them)."""
        dims = (key_states.shape[-1], value_states.shape[-1])
        if self.buffer is None:
            batch, heads, _, _ = key_states.shape
            self.key_dim, self.value_dim = dims
            self.buffer = key_states.new_zeros(len(self.layers), 2, batch, heads, self.capacity, max(dims))
        elif self.buffer.shape[2:4] != key_states.shape[:2] or dims != (self.key_dim, self.value_dim):
            raise ValueError(
                f"SlotCache needs one KV shape for all layers; got keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)} after {tuple(self.buffer.shape)}"
            )

    def ensure(self, rows: int) -> None:
        """Grow the buffer (doubling) so it holds ``rows`` rows."""
        if rows <= self.capacity:
            return
        while self.capacity < rows:
            self.capacity *= 2
        grown = self.buffer.new_zeros(*self.buffer.shape[:-2], self.capacity, self.buffer.shape[-1])
        filled = max(layer.length for layer in self.layers)
        grown[..., :filled, :].copy_(self.buffer[..., :filled, :])
        self.buffer = grown

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows up front (one allocation instead of a few doublings)."""
        if self.buffer is None:
            self.capacity = max(self.capacity, rows)
        else:
            self.ensure(rows)

    def compact(self, start: int, order: torch.Tensor, keep: int) -> None:
        """Rows ``start + order`` move to ``start, start + 1, ...`` in every layer, then the first
        ``keep`` of them stay: one gather and one copy for all layers, ``order`` never leaves the device.
        ``order`` is ``[n]`` (the same for every batch row) or ``[batch, n]`` (one order per row)."""
        n = order.shape[-1]
        if self.buffer is not None and n:
            window = self.buffer[..., start : start + n, :]
            if order.dim() == 1:
                moved = self.buffer.index_select(-2, order + start)
            else:  # [layers, 2, batch, heads, n, dim] index from [batch, n], expanded without a copy
                moved = window.gather(-2, order[:, None, :, None].expand(window.shape))
            window.copy_(moved)
        for layer in self.layers:
            layer.length = start + keep

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` rows, or drop ``-max_length`` rows when negative (as ``DynamicCache``)."""
        for layer in self.layers:
            layer.length = max_length if max_length >= 0 else max(0, layer.length + max_length)
