"""Wall-clock timing that waits for the device.

GPU (and other accelerator) kernels run asynchronously: a timer read right after launching them
measures the launches only. Every duration in draftsmith is taken with :func:`clock`, which
first waits for the device's queued work.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on ``device`` (the current accelerator when None); CPU: nothing to wait for."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cpu":
        return
    if torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def clock(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work: take durations as
    ``clock(device) - start`` with ``start = clock(device)``."""
    synchronize(device)
    return time.perf_counter()
