"""Wall-clock timing that waits for the device.

GPU (and other accelerator) kernels run asynchronously: a timer read right after launching them
measures the launches only. Every duration in draftsmith is taken with :func:`clock`, which
first waits for the device's queued work.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

# (stage, seconds) of the named stages this process ran, in order (see :func:`stage`).
STAGES: list[tuple[str, float]] = []


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


def age_seconds(path) -> float:
    """Seconds since ``path`` was last modified, by the calendar clock (an age of data, not a
    duration of device work: nothing to wait for)."""
    return time.time() - os.stat(path).st_mtime


@contextmanager
def stage(name: str, device: torch.device | str | None = None):
    """Time a named stage of a command (loading, features, training, decoding) into :data:`STAGES`,
    for the per-stage wall times a command prints at its end."""
    start = clock(device)
    try:
        yield
    finally:
        STAGES.append((name, clock(device) - start))


def stage_table(stages: list[tuple[str, float]] | None = None) -> str:
    """The stages and their wall times as a Markdown table, with the total."""
    stages = STAGES if stages is None else stages
    rows = [f"| {name} | {seconds:.1f} s |" for name, seconds in stages]
    total = sum(seconds for _, seconds in stages)
    return "\n".join(["| stage | wall time |", "|---|---|", *rows, f"| total | {total:.1f} s ({total / 60:.1f} min) |"])
