"""Learning where drafts fail: heavier loss at the positions where the served draft was rejected.

A capture store records, per reply token, what the served drafter did there
(:mod:`draftsmith.data_prep.traffic`: accepted, rejected, or not drafted). With
``adapt.rejected_weight`` w a round's traffic rows carry ``loss_weight``: w at the rejected positions
(the target's correction tokens, where the deployed head's draft was wrong), 1 elsewhere. The task's
loss (:func:`~draftsmith.train.unroll.unrolled_loss`) is then, at each depth, the weighted mean
``sum(w_t * loss_t) / sum(w_t)`` over the tokens it scores, so its scale stays that of the uniform loss.
Online Speculative Decoding (Liu et al., 2024; its ``distill_trainer.online_training_step``) trains
only at the positions where the draft was wrong (the limit of a large w); ``all_token_mask`` there is w = 1.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from draftsmith.data_prep.dataset import LOSS_WEIGHT
from draftsmith.data_prep.traffic import REJECTED, SERVED_DRAFT


def rejected_weights(outcomes: torch.Tensor, weight: float) -> torch.Tensor:
    """float32 loss weights for one row's per-token served-draft ``outcomes``: ``weight`` where the
    draft was rejected, 1 elsewhere."""
    ones = torch.ones(outcomes.shape, dtype=torch.float32)
    return torch.where(outcomes == REJECTED, ones * weight, ones)


class RejectedWeighted(Dataset):
    """Feature rows (``rows``: a dataset with ``lengths()``) with ``loss_weight`` from their
    ``served_draft`` record where they have one (a row without one, e.g. replayed data, trains
    uniformly); the record itself is dropped."""

    def __init__(self, rows, weight: float):
        self.rows, self.weight = rows, weight

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        return self.rows.lengths()

    def __getitem__(self, index: int) -> dict:
        row = dict(self.rows[index])
        outcomes = row.pop(SERVED_DRAFT, None)
        if outcomes is not None:
            row[LOSS_WEIGHT] = rejected_weights(outcomes, self.weight)
        return row


def weighted(rows, weight: float):
    """``rows`` as a round trains them under ``adapt.rejected_weight`` ``weight`` (1: unchanged, uniform)."""
    return rows if weight == 1 else RejectedWeighted(rows, weight)
