"""Choose the compute dtype for the machine at hand: ``auto`` measures instead of assuming.

On CUDA bf16 is the standard choice where the GPU supports it. On CPUs it depends on the chip:
with native bf16 (AVX512-BF16, AMX) a bf16 matmul is faster than fp32, while on AVX2-only CPUs
torch emulates it and runs ~40x slower. A short probe (two small matmuls, well under a second
even on the slow path) decides, once per process, and one log line says what was chosen and why.
"""

from __future__ import annotations

import functools

import torch

from draftsmith.timing import clock

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
AUTO = "auto"
DTYPE_CHOICES = (AUTO, "float32", "bfloat16", "float16")


def _matmul_seconds(dtype: torch.dtype, size: int = 512, tokens: int = 32, repeats: int = 3) -> float:
    """Best-of time of a ``[tokens, size] x [size, 4 size]`` matmul (a decoder MLP's shape)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, size, generator=generator).to(dtype)
    w = torch.randn(size, 4 * size, generator=generator).to(dtype)
    x @ w  # first call: kernel selection and allocation
    best = float("inf")
    for _ in range(repeats):
        start = clock("cpu")
        x @ w
        best = min(best, clock("cpu") - start)
    return best


@functools.cache
def _auto_dtype(device_type: str) -> tuple[torch.dtype, str]:
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU supports bf16"
        return torch.float16, "the GPU has no bf16; fp16 instead"
    if device_type != "cpu":
        return torch.float32, f"no probe for {device_type} devices"
    return choose_cpu_dtype(_matmul_seconds(torch.float32), _matmul_seconds(torch.bfloat16))


def choose_cpu_dtype(fp32_seconds: float, bf16_seconds: float) -> tuple[torch.dtype, str]:
    """bf16 when its measured matmul is at least as fast as fp32's, with the reason in words."""
    ratio = fp32_seconds / bf16_seconds
    if ratio >= 1.0:
        return torch.bfloat16, f"a bf16 matmul ran {ratio:.1f}x as fast as fp32 on this CPU"
    return torch.float32, f"a bf16 matmul ran {1 / ratio:.1f}x slower than fp32 on this CPU (no native bf16)"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", log: bool = True) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``; ``auto`` picks bf16 where it is fast on ``device``, else fp32.

    ``auto`` prints one line with the choice and the measurement behind it (``log=False`` silences it).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO:
        device_type = torch.device(device).type
        chosen, why = _auto_dtype(device_type)
        if log:
            print(f"dtype auto -> {str(chosen).removeprefix('torch.')} on {device_type}: {why}")
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def mixed_precision_for(dtype: torch.dtype) -> str:
    """Accelerate's ``mixed_precision`` setting that matches a compute dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
