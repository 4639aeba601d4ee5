"""Durations wait for the device: one clock, used by every timer in the package."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from draftsmith.timing import clock

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("core", "data_prep", "heads", "train", "eval", "bench")


def test_every_duration_is_taken_with_the_synchronising_clock():
    raw = re.compile(r"\btime\.(perf_counter|time|monotonic)(_ns)?\(|from time import")
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in PACKAGE_FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != REPO / "core" / "timing.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if raw.search(line)
    ]
    assert offenders == []


def test_clock_waits_for_an_accelerator_but_not_for_the_cpu(monkeypatch):
    # No accelerator on CI: record what the clock asks of torch's device-generic API instead.
    waited = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waited.append(device))
    clock("cuda:1")
    clock(torch.device("cpu"))
    clock()
    assert waited == [torch.device("cuda:1"), None]
