"""Loading exported folders back: the format is detected from the exported config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.errors import CheckpointError
from draftsmith.heads.common import EXPORT_KEY


def detect_format(config: dict) -> str | None:
    """The export format whose fields ``config`` (an exported config.json) has, or None."""
    from draftsmith.export import FORMATS

    found = [name for name, module in FORMATS.items() if module.matches(config)]
    return found[0] if len(found) == 1 else None


def native_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The drafter's weights under draftsmith names from the exported folder ``path``."""
    from draftsmith.export import FORMATS

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    fmt = detect_format(config)
    recorded = config[EXPORT_KEY].get("format")
    if fmt is None or fmt != recorded:
        raise CheckpointError(
            f"{path}: config.json says it is a {recorded!r} export but its fields are "
            f"{'of no known format' if fmt is None else f'those of {fmt!r}'}; re-export it"
        )
    return FORMATS[fmt].native_state(path, config)
