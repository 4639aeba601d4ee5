"""Writes that a killed process cannot leave half done, and the clean-up of what it leaves behind.

A file or folder is written under a hidden sibling stage whose name carries its writer's host and
process id (``.NAME.HOST.PID.RANDOM.tmp``; a file inside it) and renamed onto its real name once
complete, so readers see all of it or nothing. A writer killed before the rename (SIGKILL runs no
``finally``) leaves its stage behind; the next writer of the same name removes the stages of writers
that no longer run on this host and leaves those of live ones (another process building the same
cache) alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUFFIX = ".tmp"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_stages(path: Path) -> list[Path]:
    """Remove the stages of ``path`` left by writers on this host that are no longer running;
    returns what was removed."""
    prefix, host, removed = f".{path.name}.", socket.gethostname(), []
    for stage in path.parent.glob(f"{prefix}*{SUFFIX}") if path.parent.is_dir() else []:
        writer_host, _, rest = stage.name[len(prefix) : -len(SUFFIX)].rpartition(".")[0].rpartition(".")
        if writer_host != host or not rest.isdigit() or _running(int(rest)):
            continue
        if stage.is_dir() and not stage.is_symlink():
            shutil.rmtree(stage, ignore_errors=True)
        else:
            stage.unlink(missing_ok=True)
        removed.append(stage)
    return removed


@contextmanager
def staged(path: str | Path, folder: bool = False) -> Iterator[Path]:
    """A fresh path to write ``path``'s content to (an empty file, or with ``folder`` an empty
    folder) under a hidden stage beside ``path``; renamed onto ``path`` when the block ends, removed
    when it raises.

    A file is staged as ``STAGE/NAME`` inside a stage folder of its own, so that whatever a library
    writes beside it (safetensors saves through a ``.tmpXXXXXX`` sibling it renames) is inside the
    stage too, and goes with it when a killed writer's stage is removed. A folder replaces ``path``
    only where that is missing or an empty folder (the rename raises ``OSError`` otherwise, after
    removing the stage). Stale stages of ``path`` are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(path)
    prefix = f".{path.name}.{socket.gethostname()}.{os.getpid()}."
    stage = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=SUFFIX))
    content = stage if folder else stage / path.name
    try:
        if not folder:
            content.touch()
        yield content
        os.replace(content, path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
