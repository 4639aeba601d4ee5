"""The DSpark drafter (DeepSeek's DSpark; ``speculators``' and vLLM's ``dspark``): DFlash's one-pass
block drafter plus two small heads.

- A **Markov head** biases the logits of each drafted position by the token drafted just before
  it: a low-rank ``B = W1 @ W2`` (``markov_w1`` an embedding over the target's vocabulary,
  ``markov_w2`` a projection onto the draft vocabulary, rank ``markov_rank``), ``vanilla`` (the
  previous token alone), ``gated`` (its embedding gated by the slot's hidden state) or ``rnn`` (a
  recurrent state over the block). Drafting is then sequential over the block's positions, but
  each step is a rank-r lookup and product, not a pass of the layers.
- A **confidence head** (one linear unit over the slot's hidden state, and the previous token's
  Markov embedding where ``confidence_head_with_markov``) predicts each position's probability of
  being accepted, so the engine can cut the block where drafting stops paying.

With ``sample_from_anchor`` (DeepSeek's convention, speculators' default for DSpark) every slot of
the block drafts the token after its own position, the anchor's included: a block of b slots drafts
b tokens. Without it the layout is DFlash's (the anchor slot drafts nothing, b - 1 tokens).

Parameter names are speculators 0.9's ``DSparkDraftModel``'s (``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``markov_head.gate_proj.*``, ``markov_head.joint_proj.*``,
``confidence_head.proj.*``), which vLLM 0.32's ``Qwen3DSparkModel`` also loads (vanilla only).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.heads.dflash import DFlashHead

KIND = "dspark"
MARKOV_TYPES = ("vanilla", "gated", "rnn")
MarkovType = Literal["vanilla", "gated", "rnn"]


class MarkovHead(nn.Module):
    """The low-rank logit bias of the previous token: ``W2 f``, where ``f`` is the previous token's
    ``W1`` row (vanilla), that row gated by the slot's hidden state (gated), or the output of a
    small recurrent cell over the block's positions (rnn)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, kind: MarkovType):
        super().__init__()
        if kind not in MARKOV_TYPES:
            raise ValueError(f"markov head type must be one of {', '.join(MARKOV_TYPES)}, got {kind!r}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        # speculators 0.9's MarkovHead.__init__ (models/dspark/model_definitions.py) draws W1 from
        # N(0, 0.01) after the embedding's own N(0, 1); W2 and the gate/rnn projections keep torch's
        # Linear default. Built in the same order, a seed gives speculators' very tensors.
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            # One projection to [gate; candidate; output] over [state; previous token; hidden].
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(
        self, embedded: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(f, state)`` of one block position: ``embedded`` the previous tokens' ``W1`` rows
        ``[..., r]``, ``hidden`` the slots' normed hidden states ``[..., h]``; the bias is
        ``markov_w2(f)``. ``state`` is the rnn's (None at the block's first position; vanilla and
        gated have none, so their step applies to every position at once)."""
        embedded = embedded.to(self.markov_w2.weight.dtype)
        if self.kind == "vanilla":
            return embedded, None
        hidden = hidden.to(embedded.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded, None
        if state is None:
            state = embedded.new_zeros(embedded.shape)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(out), state

    def block_features(
        self, embedded: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``f`` ``[..., S, r]`` for whole blocks (teacher-forced previous tokens ``embedded``
        ``[..., S, r]``, hidden states ``[..., S, h]``); the rnn runs over the S positions in order,
        from ``state`` (None: zeros)."""
        if self.kind != "rnn":
            return self.step(embedded, hidden, None)[0]
        out = []
        for k in range(embedded.shape[-2]):
            f, state = self.step(embedded[..., k, :], hidden[..., k, :], state)
            out.append(f)
        return torch.stack(out, dim=-2)


class DSparkHead(DFlashHead):
    """A :class:`~draftsmith.heads.dflash.DFlashHead` with a Markov head and a confidence head."""

    kind = KIND

    def __init__(
        self,
        target_config: PretrainedConfig,
        aux_layers: list[int],
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        d2t: torch.Tensor,
        target_info: dict | None = None,
        learn_mask_embedding: bool = False,
        markov_rank: int = 256,
        markov_head_type: MarkovType = "vanilla",
        confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        sample_from_anchor: bool = True,
    ):
        if learn_mask_embedding:
            # vLLM 0.32's Qwen3DSparkModel drops mask_embedding ("DSpark masks via the vocab row").
            raise ValueError("a DSpark drafter reads the target's row for its mask token; it cannot learn its own")
        super().__init__(target_config, aux_layers, num_layers, block_size, mask_token_id, d2t, target_info)
        if confidence_head and confidence_head_with_markov and markov_rank < 1:
            raise ValueError("a confidence head reading the Markov embedding needs markov_rank >= 1")
        hidden = self.config.hidden_size
        self.sample_from_anchor = bool(sample_from_anchor)
        self.markov_head = (
            MarkovHead(target_config.vocab_size, d2t.numel(), markov_rank, hidden, markov_head_type)
            if markov_rank > 0
            else None
        )
        self.confidence_with_markov = bool(confidence_head_with_markov and markov_rank > 0)
        if confidence_head:
            self.add_confidence_head()

    @property
    def shift(self) -> int:
        """1 with ``sample_from_anchor``: every slot drafts the token after its own position."""
        return int(self.sample_from_anchor)

    def embed_previous(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's ``W1`` rows of ``token_ids`` (target vocabulary), None without one."""
        return None if self.markov_head is None else self.markov_head.markov_w1(token_ids)

    @property
    def markov_reads_anchor_slot(self) -> bool:
        """Whether the Markov recurrence runs over the anchor's slot before the first drafting one:
        speculators 0.9 (``DSparkDraftModel.forward``) runs ``block_bias`` over all ``block_size``
        slots, and without ``sample_from_anchor`` the anchor's slot drafts nothing but still steps
        the rnn (previous token: the anchor), so depth 1 starts from that state, not from zeros.
        Vanilla and gated heads have no state: the anchor's slot changes nothing for them."""
        return self.markov_head is not None and self.markov_head.kind == "rnn" and not self.sample_from_anchor

    def markov_start(self, anchor: torch.Tensor | None, anchor_normed: torch.Tensor | None) -> torch.Tensor | None:
        """The rnn's state entering depth 1: one step over the anchor's slot (``anchor`` its token's
        ``W1`` row ``[..., r]``, ``anchor_normed`` its normed hidden state ``[..., h]``) where
        :attr:`markov_reads_anchor_slot`, else None (zeros)."""
        if not self.markov_reads_anchor_slot:
            return None
        return self.markov_head.step(anchor, anchor_normed, None)[1]

    def teacher_forced(
        self, hidden: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(normed, features, embedded)`` of whole blocks as training scores them: ``hidden``
        ``[..., block, h]`` every slot of each block (the anchor's first), ``previous`` ``[..., S]``
        the token before each drafting slot's label (S = :attr:`draft_slots`). ``normed`` is the
        drafting slots' ``[..., S, h]``; ``features`` the Markov features for :meth:`markov_logits`
        and ``embedded`` the ``W1`` rows for :meth:`confidence_logits` (None without a Markov head)."""
        first = 1 - self.shift
        normed = self.norm(hidden)
        slots = normed[..., first:, :]
        embedded = self.embed_previous(previous)
        if embedded is None:
            return slots, None, None
        # Without sample_from_anchor the first drafting slot's previous token is the anchor itself.
        state = self.markov_start(embedded[..., 0, :], normed[..., 0, :]) if first else None
        return slots, self.markov_head.block_features(embedded, slots, state), embedded

    def markov_logits(self, normed: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Draft logits of normed hidden states plus the Markov bias of ``features`` (from
        :meth:`MarkovHead.step` or :meth:`MarkovHead.block_features`), if any."""
        logits = self.lm_head(normed)
        return logits if features is None else logits + self.markov_head.markov_w2(features).to(logits.dtype)

    def confidence_features(self) -> int:
        """The normed hidden state, and the previous token's ``W1`` row where ``confidence_head_with_markov``."""
        return self.config.hidden_size + (self.markov_head.rank if self.confidence_with_markov else 0)

    def confidence_logits(self, normed: torch.Tensor, embedded: torch.Tensor | None = None) -> torch.Tensor | None:
        """As :meth:`DFlashHead.confidence_logits`, reading also the previous tokens' ``W1`` rows
        ``embedded`` where ``confidence_head_with_markov``."""
        if self.confidence_with_markov:
            normed = torch.cat([normed, embedded.to(normed.dtype)], dim=-1)
        return super().confidence_logits(normed)

    def checkpoint_config(self) -> dict:
        config = super().checkpoint_config()
        del config["learn_mask_embedding"]
        config.update(
            markov_rank=self.markov_head.rank if self.markov_head is not None else 0,
            markov_head_type=self.markov_head.kind if self.markov_head is not None else "vanilla",
            confidence_head=self.confidence_head is not None,
            confidence_head_with_markov=self.confidence_with_markov,
            sample_from_anchor=self.sample_from_anchor,
        )
        return config

    @staticmethod
    def checkpoint_options(config: dict) -> dict:
        keys = (
            "markov_rank",
            "markov_head_type",
            "confidence_head",
            "confidence_head_with_markov",
            "sample_from_anchor",
        )
        return {key: config[key] for key in keys}
