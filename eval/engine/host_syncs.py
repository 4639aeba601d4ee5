"""Count device-to-host transfers (host syncs) made through Python while a block runs.

On an accelerator every ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``.cpu()`` or ``.numpy()`` waits for all queued kernels, so a decode step's host overhead is
set by how many of them it makes. :func:`count_host_syncs` wraps those entry points on
``torch.Tensor`` (on any device, so a CPU run counts what a GPU run would pay) and counts the
outermost calls; the benchmark and the tests read the counter per decode step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class SyncCounter:
    """The number of host syncs seen so far (read ``count`` at any time)."""

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0  # a sync method calling another counts once


@contextmanager
def count_host_syncs():
    """Yield a :class:`SyncCounter` that counts host syncs until the block ends."""
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(original):
        def counted(self, *args, **kwargs):
            if counter._depth == 0:
                counter.count += 1
            counter._depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter._depth -= 1

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
