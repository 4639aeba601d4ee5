"""Prepacked linear layers for CPU decoding: the weight reordered once for oneDNN, not every call.

torch's CPU GEMM repacks the weight matrix on every call when a linear sees a few rows (2-32,
exactly a verification pass's tree rows): on a 2-core Xeon a [13, 576] x [576, 49152] LM head
took 17 ms in fp32 through ``F.linear`` and 5.7 ms with the weight prepacked for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight`` once, then ``_linear_pointwise``); in bf16 2.1 vs
1.3 ms at every row count. vLLM's CPU backend runs its linears prepacked the same way, so an
engine without it pays ~1.7x vLLM's step for the same tree (BENCHMARKS.md, issue 34).

:func:`prepack_linears` gives every ``nn.Linear`` under a module a packed forward (the module's
parameters, state dict and hooks stay as they are; other holders of the module, such as an
EAGLE head sharing the target's LM head, get the fast path too), which runs only inside
:func:`packed` (the engine's ``generate``): outside, the model computes as it always did. The packed copy is used only
where it computes the same thing: no autograd through it, and a weight changed since packing
(training, a LoRA merge) is packed again. ``auto`` measures each linear shape once per process
and packs from the row count where the packed path wins on this CPU (fp32 on 1-3 rows stays on
torch's own path, which needs no packing there; oneDNN's bf16 may lose on CPUs without native
bf16); GPUs are left alone (cuBLAS needs no packing).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.timing import clock

MODES = ("auto", "on", "off")
_ENGINE = contextvars.ContextVar("draftsmith_prepacked", default=False)
PACKABLE = (torch.float32, torch.bfloat16)
_PROBE_ROWS = (1, 2, 4, 8, 16)  # plain steps, chains, trees
NEVER = 1 << 62  # a row threshold no input reaches
MARGIN = 0.85  # packed must take at most this share of the plain time


@contextlib.contextmanager
def packed():
    """Packed forwards run inside this block only (the engine's generations and pass-cost probes);
    outside it every linear computes exactly as before packing, so the same model used directly
    (training, HF ``generate``, a logits comparison) is untouched, rounding included."""
    token = _ENGINE.set(True)
    try:
        yield
    finally:
        _ENGINE.reset(token)


def available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN prepacking exists here for ``dtype``: a CPU device, a torch built with oneDNN
    and, for bf16, a CPU whose instructions oneDNN's bf16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; plain AVX2 machines have neither)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    if dtype not in PACKABLE:
        return False
    try:  # oneDNN says so only by refusing: ask once per process with a tiny weight
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedForward:
    """The forward installed on one linear: oneDNN on the packed weight from ``min_rows`` input rows
    on (below, ``F.linear``: torch's fp32 path for 1-3 rows needs no packing and is faster there)."""

    def __init__(self, linear: nn.Linear, min_rows: int = 1):
        self.linear, self.min_rows = linear, min_rows
        self.stamp: tuple[int, int] | None = None  # the weight's (version, storage) when packed
        self.weight: torch.Tensor | None = None
        self.pack()

    def __getstate__(self) -> dict:
        # A oneDNN tensor has no storage to copy or pickle: copies pack again on first use.
        return {"linear": self.linear, "min_rows": self.min_rows, "stamp": None, "weight": None}

    def _stamp(self) -> tuple[int, int]:
        weight = self.linear.weight
        return weight._version, weight.data_ptr()

    def pack(self) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(self.linear.weight.detach(), None)
        self.stamp = self._stamp()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if (
            not _ENGINE.get()
            or x.numel() < self.min_rows * x.shape[-1]
            or x.dtype != linear.weight.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad))
        ):
            return F.linear(x, linear.weight, linear.bias)
        if self._stamp() != self.stamp:  # trained or merged since packing
            self.pack()
        bias = linear.bias.detach() if linear.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


def _seconds(forward, x: torch.Tensor, repeats: int = 10) -> float:
    forward(x)  # first call: kernel selection and allocation
    best = float("inf")
    for _ in range(repeats):
        start = clock(x.device)
        forward(x)
        best = min(best, clock(x.device) - start)
    return best


@functools.cache
def _crossover(out_features: int, in_features: int, dtype: torch.dtype, bias: bool) -> int:
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    fast = PackedForward(linear)
    with torch.no_grad(), packed():
        for rows in _PROBE_ROWS:
            x = torch.randn(1, rows, in_features, generator=generator).to(dtype)
            # A clear win only: a probe of microseconds is noisy, and a wrong switch costs every step.
            if _seconds(fast, x) < MARGIN * _seconds(lambda v: F.linear(v, linear.weight, linear.bias), x):
                return rows
    return NEVER


def crossover(linear: nn.Linear) -> int:
    """The fewest input rows (of 1, 2, 4, 8, 16) from which ``linear``'s shape and dtype run faster
    packed than through ``F.linear`` on this CPU (measured once per process); :data:`NEVER` if none."""
    return _crossover(linear.out_features, linear.in_features, linear.weight.dtype, linear.bias is not None)


def prepack_linears(module: nn.Module, mode: str = "auto") -> int:
    """Install packed forwards on ``module``'s CPU linears (fp32, and bf16 where this CPU packs it:
    :func:`available`); returns how many now run packed.

    ``mode``: ``on`` packs every one, ``off`` none, ``auto`` each from its measured :func:`crossover`
    (linears whose shape never pays stay as they are). Linears already packed are left alone.
    """
    if mode not in MODES:
        raise ValueError(f"prepack mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return 0
    count = 0
    for linear in module.modules():
        if not isinstance(linear, nn.Linear) or isinstance(linear.forward, PackedForward):
            continue
        if not available(linear.weight.device, linear.weight.dtype):
            continue
        min_rows = 1 if mode == "on" else crossover(linear)
        if min_rows != NEVER:
            linear.forward = PackedForward(linear, min_rows)
            count += 1
    return count


def unpack_linears(module: nn.Module) -> int:
    """Undo :func:`prepack_linears` on ``module`` (for before/after measurements); returns how many."""
    count = 0
    for linear in module.modules():
        if isinstance(linear, nn.Linear) and isinstance(linear.forward, PackedForward):
            del linear.forward
            count += 1
    return count
