"""Loading exported folders back (``eagle3:EXPORT_DIR`` and the like): the weights under draftsmith's names.

An export's config.json records, under :data:`EXPORT_KEY`, its format and its drafter's kind; the
kind's declaration says how that format reads back (``DrafterKind.readers``: each format's reader
lives with its writer in :mod:`draftsmith.export`, with the kind's own part bound in). So a head
loads an export through the registry, without importing the exporters or naming a kind here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.checkpoint_files import read_json
from draftsmith.errors import CheckpointError
from draftsmith.kinds import get

# The key under which ``draftsmith-export`` keeps a drafter's own config inside an exported
# folder's config.json, so the engine can load the export back (see :mod:`draftsmith.export`).
EXPORT_KEY = "draftsmith_export"


def native_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The drafter's weights under draftsmith names from the exported folder ``path``."""
    path = Path(path)
    config = read_json(path / "config.json")
    record = config[EXPORT_KEY]
    fmt, kind = record.get("format"), record.get("kind")
    reader = get(kind, f"{path}: {EXPORT_KEY}.kind").readers.get(fmt)
    if reader is None:
        raise CheckpointError(
            f"{path}: a {fmt!r} export of a {kind} drafter, which the engine does not load back; "
            f"give the training checkpoint it came from ({record.get('source')})"
        )
    return reader(path, config)
