"""Reading the files of checkpoints (drafter heads, exports, training state, feature shards, the
target cache), where a damaged file is one line naming it and what to do.

A file cut short by a full disk or an interrupted copy, or one that is not what its name says,
makes safetensors, ``json`` or ``torch.load`` fail deep inside a library with a message that names
no file; every reader here turns that into a :class:`~draftsmith.errors.CheckpointError`.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from draftsmith.errors import CheckpointError, one_line

# What to do by default: the file came from somewhere (a copy, an export, a training run).
REWRITE = "copy it again, or write it again (export again, or take an earlier checkpoint-N of its run)"
# What each library raises on a cut-short or foreign file (torch.load's own errors vary with where
# the file ends, so torch files are checked to be whole zip archives first: see load_torch).
DAMAGED = (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, EOFError, pickle.UnpicklingError)
TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")  # torch.save's files (a zip archive since torch 1.6)


@contextmanager
def _reading(path: str | Path, fix: str = REWRITE) -> Iterator[None]:
    """Run a block that reads ``path``: a damaged file ends it with a :class:`CheckpointError`
    naming ``path``, what the reader found and ``fix`` (what to do)."""
    try:
        yield
    except DAMAGED as err:
        raise CheckpointError(f"{path} is damaged or cut short ({one_line(err) or type(err).__name__}): {fix}") from err


def read_json(path: str | Path, fix: str = REWRITE):
    """The JSON document in ``path`` (a ``config.json``, a trainer state)."""
    with _reading(path, fix):
        return json.loads(Path(path).read_text())


def load_tensors(path: str | Path, fix: str = REWRITE) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, on the CPU."""
    with _reading(path, fix):
        return load_file(str(path))


def open_tensors(path: str | Path, fix: str = REWRITE):
    """``safe_open(path)`` (use it as a context manager); opening checks the header and that the
    file holds every byte it lists, so a cut-short file is refused here."""
    with _reading(path, fix):
        return safe_open(str(path), framework="pt")


def load_torch(path: str | Path, fix: str = REWRITE):
    """``torch.load(path, weights_only=True)`` of a ``torch.save`` file."""
    _check_zip(path, fix)
    with _reading(path, fix):
        return torch.load(path, weights_only=True)


def check_files(folder: str | Path, fix: str = REWRITE) -> None:
    """Check every safetensors, JSON and ``torch.save`` file under ``folder`` is whole (headers
    and indexes only: cheap) before a library that names no file (Accelerate's ``load_state``) reads them."""
    for path in sorted(Path(folder).rglob("*")):
        if path.suffix == ".safetensors":
            with open_tensors(path, fix):
                pass
        elif path.suffix == ".json":
            read_json(path, fix)
        elif path.suffix in TORCH_SUFFIXES:
            _check_zip(path, fix)


def _check_zip(path: str | Path, fix: str) -> None:
    # A zip archive's directory is at its end: a cut-short file has none.
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is damaged or cut short (not a whole torch.save zip archive): {fix}")
