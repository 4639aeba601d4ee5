"""Checkpoint folders of a training run: ``checkpoint-N`` and ``checkpoint-final`` under the
output folder, each the exported drafter plus ``state/`` (model, optimiser, scheduler and RNG
states and ``trainer_state.json``, the data position).

A checkpoint is written into a hidden staging folder and renamed into place, and an old one is
renamed to a hidden name before it is deleted, so a run killed at any moment leaves only complete
checkpoints under names that :func:`checkpoints` (and ``--resume``) would take.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from draftsmith.checkpoint_files import check_files, read_json

FINAL = "checkpoint-final"
TRAINER_STATE = "trainer_state.json"  # under a checkpoint's state/: where training stands
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def state_dir(checkpoint: Path) -> Path:
    """The resumable state of ``checkpoint`` (Accelerate's files and :data:`TRAINER_STATE`)."""
    return checkpoint / "state"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete numbered checkpoints, oldest first."""
    root = Path(output_dir)
    found = [
        (int(m.group(1)), p)
        for p in root.glob("checkpoint-*")
        if (m := _CHECKPOINT.match(p.name)) and (state_dir(p) / TRAINER_STATE).is_file()
    ]
    return [p for _, p in sorted(found)]


def _discarded(checkpoint: Path) -> Path:
    """Rename ``checkpoint`` to a hidden name and return it, for deleting: a kill during the delete
    then leaves no half checkpoint under a name that :func:`checkpoints` or a reader would take
    (the next save removes the rest)."""
    old = checkpoint.with_name(f".{checkpoint.name}.old")
    os.replace(checkpoint, old)
    return old


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume`` continues from: the newest complete numbered one (None: none)."""
    found = checkpoints(output_dir)
    return found[-1] if found else None


def load_state(accelerator, checkpoint: Path) -> dict:
    """Load ``checkpoint``'s resumable state into ``accelerator``'s model, optimiser, scheduler and
    RNGs, and return its :data:`TRAINER_STATE`. Its files are checked first, so a damaged one is a
    one-line error naming it (Accelerate's loaders name no file)."""
    fix = f"move {checkpoint} aside to resume from the checkpoint before it, or start again without --resume"
    check_files(state_dir(checkpoint), fix)
    accelerator.load_state(str(state_dir(checkpoint)))
    return read_json(state_dir(checkpoint) / TRAINER_STATE, fix)


def staging_folder(final: Path) -> Path:
    """The hidden folder checkpoint ``final`` is written into before :func:`publish` renames it."""
    return final.with_name(f".{final.name}.tmp")


def begin_staging(tmp: Path) -> None:
    """Create the empty staging folder ``tmp``, after removing what a run killed while saving or
    deleting checkpoints left (main process only)."""
    for stale in [tmp, *tmp.parent.glob(".checkpoint-*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename the staged checkpoint ``tmp`` to ``final``, replacing an older one of that name."""
    old = _discarded(final) if final.exists() else None
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest numbered checkpoints (``keep`` <= 0: keep them all)."""
    for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(_discarded(old), ignore_errors=True)
