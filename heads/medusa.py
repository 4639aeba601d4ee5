"""Medusa heads (Cai et al., 2024): extra decoding heads on the target's last hidden state.

Head k (0-based) reads the hidden state ``h_i`` of position i, the one whose LM-head output is
token i+1, and predicts token i+k+2. Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` with W and b zero-initialised, so a fresh head returns ``h_i`` unchanged and
its logits equal the target's own next-token logits (shifted by k+1 positions). The heads score
through an LM head that is either the target's, shared by reference and never saved
(``lm_head="shared"``), or a trainable per-head copy initialised from it (``"copy"``). Shared
heads run all K LM-head products as one matrix multiply. An optional draft vocabulary restricts
scoring to the N most frequent tokens (see :mod:`draftsmith.heads.vocab`).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PreTrainedModel

from draftsmith.heads.base import Head, target_lm_rows
from draftsmith.target import target_record

KIND = "medusa"
LM_HEAD_MODES = ("shared", "copy")
DEFAULT_TREE_SIZE = 63  # nodes in the Medusa paper's default sparse tree
TOP_K_RECORDED = 10  # ranks whose accuracy is measured per head
# The residual blocks' weights, blocks.<head>.<block>.linear.<weight|bias>: what the export formats rename.
BLOCK = re.compile(r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)")
BLOCK_NAME = "blocks.{0}.{1}.linear.{2}"


def rank_accuracy(top_k_accuracy: list[list[float]]) -> list[list[float]]:
    """Per head, the probability that its rank-r guess is right, from cumulative top-k accuracies."""
    return [[max(0.0, hi - lo) for lo, hi in zip([0.0, *row[:-1]], row)] for row in top_k_accuracy]


def head_positions(batch: dict, num_heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per head k: flat indices of positions i whose label (token i+k+2) is an assistant token of
    the same conversation (a packed batch's ``attention_mask`` holds each token's conversation), and those labels."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    segments = batch.get("attention_mask", torch.ones_like(ids))
    n = ids.shape[1]
    positions, labels = [], []
    for k in range(num_heads):
        shift = k + 2
        valid = torch.zeros_like(mask)
        shifted = torch.zeros_like(ids)
        if n > shift:
            valid[:, : n - shift] = mask[:, shift:] & (segments[:, shift:] == segments[:, : n - shift])
            shifted[:, : n - shift] = ids[:, shift:]
        index = valid.flatten().nonzero().squeeze(1)
        positions.append(index)
        labels.append(shifted.flatten()[index])
    return positions, labels


def top_k_hits(heads: MedusaHeads, logits: torch.Tensor, gold: torch.Tensor, ranks: int) -> torch.Tensor:
    """``[ranks]``: for r = 1..ranks, how many ``gold`` tokens are among the head's top-r guesses
    (``logits`` over the draft vocabulary of ``heads``, a row per gold token)."""
    top = heads.draft_vocab[logits.topk(ranks, dim=-1).indices]
    return (top == gold[:, None]).cumsum(-1).clamp_max(1).sum(0)


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``, zero-initialised: the identity until trained."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(Head):
    """K Medusa heads over one target."""

    kind = KIND

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        lm_head: str = "shared",
        draft_vocab: torch.Tensor | None = None,
        target_info: dict | None = None,
        head_accuracy: list[list[float]] | None = None,
    ):
        super().__init__(vocab_size, target_info)
        if lm_head not in LM_HEAD_MODES:
            raise ValueError(f"Medusa lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads} and {num_layers}")
        self.hidden_size = hidden_size
        self.num_heads, self.num_layers, self.lm_head_mode = num_heads, num_layers, lm_head
        # Held-out top-k accuracy of each head (k = 1..10), written by the trainer; the drafter
        # builds its default tree from it.
        self.head_accuracy = head_accuracy
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.keep_draft_vocab(draft_vocab)
        self.lm_weight = (
            nn.Parameter(torch.zeros(num_heads, self.draft_vocab.numel(), hidden_size)) if lm_head == "copy" else None
        )

    # -- forward -----------------------------------------------------------------------------
    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each head's residual-block output ``[K, ..., h]`` for hidden states ``[..., h]``."""
        return torch.stack([block(hidden) for block in self.blocks])

    def draft_logits_per_head(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[K, ..., N]`` of head states ``[K, ..., h]``: one batched product."""
        if self.lm_weight is None:
            return self.draft_logits(states)
        flat = states.reshape(states.shape[0], -1, states.shape[-1])
        out = torch.bmm(flat, self.lm_weight.to(flat.dtype).transpose(1, 2))
        return out.reshape(*states.shape[:-1], -1)

    def forward(self, hidden: torch.Tensor, positions: list[torch.Tensor] | None = None):
        """Draft-vocabulary logits ``[K, ..., N]`` of every head for hidden states ``[..., h]``.

        With ``positions`` (per head, indices into the flattened leading dimensions of ``hidden``)
        only those rows are scored: a list of K ``[M_k, N]`` tensors. Training uses this to skip
        positions without a label; shared LM heads still score all heads in one product.
        """
        if positions is None:
            return self.draft_logits_per_head(self.head_states(hidden))
        flat = hidden.reshape(-1, hidden.shape[-1])
        states = [self.blocks[k](flat[index]) for k, index in enumerate(positions)]
        if self.lm_weight is None:
            return list(self.draft_logits(torch.cat(states)).split([len(s) for s in states]))
        return [s @ self.lm_weight[k].to(s.dtype).T for k, s in enumerate(states)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 full-vocabulary logits ``[K, ..., V]`` (``-inf`` outside the draft vocabulary)."""
        return self.to_full_vocab(self(hidden))

    # -- construction and checkpoints ------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        target_name: str,
        num_heads: int = 4,
        num_layers: int = 1,
        lm_head: str = "shared",
        draft_vocab: torch.Tensor | None = None,
    ) -> MedusaHeads:
        """Fresh heads for ``target``: identity blocks, LM head shared with or copied from the target's."""
        config = target.config
        vocab_size = target.get_output_embeddings().weight.shape[0]
        heads = cls(
            config.hidden_size,
            vocab_size,
            num_heads,
            num_layers,
            lm_head,
            draft_vocab,
            target_record(target, target_name),
        )
        heads.bound_to(target)
        if heads.lm_weight is not None:
            with torch.no_grad():
                heads.lm_weight.copy_(target_lm_rows(target, heads.draft_vocab).expand(num_heads, -1, -1))
        return heads

    def checkpoint_config(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "lm_head": self.lm_head_mode,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": int(self.draft_vocab.numel()),
            "head_accuracy": self.head_accuracy,
            "target": self.target_info,
        }

    @classmethod
    def from_checkpoint(cls, config: dict, state: dict, layer_classes: tuple) -> MedusaHeads:
        return cls(
            config["hidden_size"],
            config["vocab_size"],
            config["num_heads"],
            config["num_layers"],
            config["lm_head"],
            state["draft_vocab"],
            config["target"],
            config.get("head_accuracy"),
        )
