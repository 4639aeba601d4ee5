"""Static-shape forward passes, replayed from CUDA graphs on a CUDA device.

A small model's decoding step on a GPU is bound by kernel launches, not arithmetic: the bundled
135M target's forward is a few hundred kernels of microseconds each, launched one by one from
Python. A CUDA graph records them once and replays them in one launch. Replay needs the same
shapes and the same addresses every time, so each forward of a given row count (a bucket) reads
its inputs from buffers of its own, written in place before the replay, and writes the KV cache
through device slots over a cache of fixed capacity (:class:`~draftsmith.eval.engine.kv_cache.SlotCache`'s
static writes). One graph per bucket, captured the first time that bucket is seen, recaptured when
the cache's buffer moves (it grew).

On other devices the same buffers and the same forward run eagerly: the static-shape path is the
one the tests verify on a CPU, the graph only replays it. A forward that cannot be captured (a
host sync inside the model, e.g. a mixture-of-experts router that reads its counts back) warns
once and runs eagerly from then on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

Outputs = tuple[torch.Tensor, ...]


@dataclass
class _Entry:
    inputs: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Outputs | None = None


class StaticForward:
    """``body(**inputs) -> tuple of tensors`` run over per-key input buffers, from a CUDA graph
    per key where ``graphs`` is set and the device is CUDA."""

    def __init__(self, body: Callable[..., Outputs], blocker: str | None = None):
        """``blocker``: why ``body`` cannot be captured (known beforehand), if it cannot: it then
        runs eagerly over the same buffers."""
        self.body = body
        self.entries: dict[tuple, _Entry] = {}
        self.captured = 0  # graphs captured so far (for reports)
        self.failure: str | None = blocker  # why graphs are not used, if they are not

    @property
    def graphs(self) -> bool:
        """Whether forwards are captured (on a CUDA device): until a capture fails or is known to."""
        return self.failure is None

    def clear(self) -> None:
        """Forget every buffer and graph (the cache they address has moved)."""
        self.entries.clear()

    @torch.inference_mode()  # its buffers are made and written the same way whatever mode the caller is in
    def __call__(self, key: tuple, inputs: dict[str, torch.Tensor]) -> Outputs:
        """Run the forward of ``key`` on ``inputs`` (copied into its buffers); the outputs are the
        entry's own buffers on CUDA, overwritten by its next run: copy what must outlive it."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(_clone(inputs))
            device = next(_tensors(inputs)).device
            if self.graphs and device.type == "cuda":
                self._capture(entry, device)
        else:
            for buffer, value in zip(_tensors(entry.inputs), _tensors(inputs), strict=True):
                buffer.copy_(value)
        if entry.graph is not None:
            entry.graph.replay()
            return entry.outputs
        return self.body(**entry.inputs)

    def _capture(self, entry: _Entry, device: torch.device) -> None:
        # Warm-up runs on a side stream first (as torch.cuda.graphs' docs ask: lazy initialisation
        # and autotuning must not happen inside the capture); they compute the same rows the
        # replay will, writing the same cache slots.
        caller = torch.cuda.current_stream(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.body(**entry.inputs)
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.body(**entry.inputs)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:  # a host sync inside the model (one graph_blocker does not know)
            # A capture that fails leaves its own stream current (torch.cuda.graph exits without
            # restoring it): back to the caller's, after whatever ran on either.
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize(device)
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            warnings.warn(f"CUDA graph capture failed, decoding eagerly from here: {self.failure}", stacklevel=3)
            return
        entry.graph, entry.outputs = graph, outputs
        self.captured += 1


def _clone(inputs: dict) -> dict:
    """Own buffers for ``inputs`` (tensors, or mappings of them: a mask per layer type)."""
    return {name: _clone(value) if isinstance(value, dict) else value.clone() for name, value in inputs.items()}


def _tensors(inputs: dict):
    """The tensors of ``inputs`` in a fixed order (mappings walked in their order)."""
    for value in inputs.values():
        if isinstance(value, dict):
            yield from _tensors(value)
        else:
            yield value
