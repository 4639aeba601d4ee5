"""The order of training rows: a seeded permutation per epoch, grouped by length or packed when asked.

The order depends only on the seed and the epoch, so a resumed run skips exactly the batches an
uninterrupted one consumed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from draftsmith.data_prep.packing import epoch_rows
from draftsmith.recipe import Recipe

GROUP_WINDOW = 32  # batches whose sequences are sorted together by length (HF's length-grouped sampler uses 50)


def sequence_lengths(dataset) -> list[int] | None:
    """Token count of every row of a training set (tokenised ``datasets`` or feature caches), read
    without decoding the rows; None for data without ``input_ids``."""
    if hasattr(dataset, "lengths"):
        return dataset.lengths()
    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        return None
    import pyarrow.compute as pc

    lengths: list[int] = []
    for chunk in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=65536):
        lengths += pc.list_value_length(chunk["input_ids"]).to_pylist()
    return lengths


def epoch_order(size: int, batch: int, seed: int, lengths: list[int] | None = None) -> list[int]:
    """The rows of an epoch in training order: a seeded permutation; with ``lengths``, every
    window of ``GROUP_WINDOW`` batches is sorted by length before it is cut into batches and the
    full batches are shuffled, so a batch pads its sequences to a similar length (a padded
    position costs as much as a real one in every pass of the head). The partial batch, if any,
    stays last."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(size).tolist()
    if lengths is None:
        return order
    window = batch * GROUP_WINDOW
    batches = []
    for start in range(0, size, window):
        chunk = sorted(order[start : start + window], key=lambda i: -lengths[i])
        batches += [chunk[k : k + batch] for k in range(0, len(chunk), batch)]
    partial = [batches.pop()] if len(batches[-1]) < batch else []
    return [i for b in [batches[j] for j in rng.permutation(len(batches))] + partial for i in b]


class PackedRows(Dataset):
    """Item i: the conversations of packed row ``rows[i]`` (a list of ``dataset``'s rows)."""

    def __init__(self, dataset, rows: list[list[int]]):
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list:
        return [self.dataset[i] for i in self.rows[index]]


def epoch_items(dataset, recipe: Recipe, epoch: int, lengths: list[int] | None = None) -> Dataset:
    """The epoch's items in training order, ``training.batch_size`` a batch: rows of ``dataset``
    (grouped by length with ``lengths``), or with ``training.packing`` packed rows of them
    (:func:`draftsmith.data_prep.packing.epoch_rows`, ``lengths`` then required)."""
    t, seed = recipe.training, recipe.training.seed + epoch
    if t.packing:
        return PackedRows(dataset, epoch_rows(len(dataset), lengths, recipe.data.max_length, t.batch_size, seed))
    return Subset(dataset, epoch_order(len(dataset), t.batch_size, seed, lengths))


def epoch_loader(dataset, collate, recipe: Recipe, epoch: int, lengths: list[int] | None = None) -> DataLoader:
    """The epoch's loader of batches padded by ``collate``; with ``lengths`` (``training.group_by_length``),
    batches of similar lengths; with ``training.packing``, batches of packed rows (``collate`` gets
    lists of conversations)."""
    # Its own generator: creating an iterator then draws its worker seed from it, not from the
    # global RNG, so a resumed run consumes the global RNG exactly as an uninterrupted one.
    generator = torch.Generator().manual_seed(recipe.training.seed + epoch)
    return DataLoader(
        epoch_items(dataset, recipe, epoch, lengths),
        batch_size=recipe.training.batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=recipe.training.num_workers,
        generator=generator,
    )
