"""The built-in drafter kinds: one declaration module per kind, registered here.

Each module declares its kind once (``KIND``, a :class:`~draftsmith.kinds.DrafterKind`) from the
pieces the layers below provide: the engine's drafter, the trainer, the export converters. This
package sits above all of them; the entry points (``eval/run.py``, ``draftsmith-export``,
``draftsmith-serve-check``, ``draftsmith-train``) call :func:`register_builtin` before they look a
kind up. A new kind is its modules plus one line in :data:`BUILTIN`.
"""

from __future__ import annotations

from draftsmith.kinds import DrafterKind, register
from draftsmith.plugins import (
    dflash,
    draft_lm,
    dspark,
    eagle,
    eagle3,
    hierarchical,
    hybrid,
    medusa,
    oracle,
    peagle,
    prompt_lookup,
    suffix,
)

# In the order eval/run.py --help lists them.
BUILTIN: tuple[DrafterKind, ...] = (
    prompt_lookup.KIND,
    suffix.KIND,
    oracle.KIND,
    draft_lm.KIND,
    eagle.KIND,
    eagle3.KIND,
    peagle.KIND,
    dflash.KIND,
    dspark.KIND,
    hierarchical.KIND,
    hybrid.KIND,
    medusa.KIND,
)


def register_builtin() -> None:
    """Register every built-in kind (again is a no-op)."""
    for kind in BUILTIN:
        register(kind)
