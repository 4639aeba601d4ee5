"""The Domino drafter (SpecForge's ``DominoDraftModel``, ModelOpt's ``DominoModule``): DFlash's
one-pass block drafter plus a small causal correction head.

DFlash drafts every depth of a block from the same pass, so depth d cannot see which tokens were
drafted above it. Domino adds what it lacks at the logits: a GRU (``prefix_gru``, no biases) runs
over the target's embeddings of the tokens before each depth (the anchor, then the drafted
tokens), and a two-layer MLP (``embed_proj``: ``[normed hidden ; GRU state] -> emb_dim -> SiLU ->
vocabulary``) turns the slot's normed hidden state and that state into an additive logit
correction. Depths up to ``pure_draft_prefix_len`` keep the backbone's logits alone. Drafting is
then sequential over the block's depths, but each step is one GRU cell and a small MLP, not a pass
of the layers.

With ``shift_label`` (the reference's default) every slot drafts the token after its own
position, the anchor's included: a block of b slots drafts b tokens (DSpark's
``sample_from_anchor``); without it the layout is DFlash's (b - 1 tokens).

As the reference, the drafter scores with the target's LM head (the full vocabulary, kept frozen
here) and its own final norm. Parameter names are the reference checkpoint's
(``prefix_gru.weight_ih_l0``, ``prefix_gru.weight_hh_l0``, ``embed_proj.0.weight``,
``embed_proj.2.weight``), beside DFlash's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.heads.dflash import DFlashHead

KIND = "domino"


class DominoHead(DFlashHead):
    """A :class:`~draftsmith.heads.dflash.DFlashHead` with Domino's GRU logit correction."""

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
        confidence_head: bool = False,
        shift_label: bool = True,
        pure_draft_prefix_len: int = 1,
        gru_hidden_dim: int = 256,
        emb_dim: int = 64,
    ):
        if learn_mask_embedding or confidence_head:
            # The reference checkpoint holds neither; its loaders read the target's mask row.
            raise ValueError("a Domino drafter has no learned mask row and no confidence head")
        super().__init__(target_config, aux_layers, num_layers, block_size, mask_token_id, d2t, target_info)
        self.shift_label = bool(shift_label)
        if not 0 <= pure_draft_prefix_len < self.draft_slots:
            raise ValueError(
                f"pure_draft_prefix_len must be in [0, {self.draft_slots - 1}] (the block drafts "
                f"{self.draft_slots} tokens), got {pure_draft_prefix_len}"
            )
        self.pure_draft_prefix_len = int(pure_draft_prefix_len)
        hidden = self.config.hidden_size
        self.prefix_gru = nn.GRU(hidden, gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + gru_hidden_dim, emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(emb_dim, d2t.numel(), bias=False),
        )

    @property
    def shift(self) -> int:
        """1 with ``shift_label``: every slot drafts the token after its own position."""
        return int(self.shift_label)

    def corrected(self, depth: int) -> bool:
        """Whether depth ``depth`` (1-based) gets the GRU's correction."""
        return depth > self.pure_draft_prefix_len

    def previous_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The GRU's inputs: the target's embeddings of ``token_ids``."""
        return self.target.get_input_embeddings()(token_ids).to(self.prefix_gru.weight_ih_l0.dtype)

    def prefix_states(self, previous: torch.Tensor) -> torch.Tensor:
        """GRU states ``[..., S, G]`` of whole blocks, teacher-forced: ``previous`` ``[..., S]`` the
        token before each drafted depth's (the anchor first); state d has read tokens 1..d."""
        inputs = self.previous_embeddings(previous)
        states, _ = self.prefix_gru(inputs.reshape(-1, *inputs.shape[-2:]))
        return states.view(*previous.shape, -1)

    def advance(self, previous: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """One GRU step while drafting: the state ``[1, G]`` after ``previous`` ``[1]`` (the token
        just chosen, the anchor at the first depth) from ``state`` (None: zeros, the block's start)."""
        inputs = self.previous_embeddings(previous)[:, None]
        hidden = None if state is None else state[None]
        return self.prefix_gru(inputs, hidden)[1][0]

    def correction(self, normed: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The additive logits ``[..., N]`` of slots with normed hidden states ``normed`` ``[..., h]``
        and GRU states ``states`` ``[..., G]``."""
        features = torch.cat([normed.to(states.dtype), states], dim=-1)
        return self.embed_proj(features.to(self.embed_proj[0].weight.dtype))

    def checkpoint_config(self) -> dict:
        config = super().checkpoint_config()
        del config["learn_mask_embedding"], config["confidence_head"]
        config.update(
            shift_label=self.shift_label,
            pure_draft_prefix_len=self.pure_draft_prefix_len,
            gru_hidden_dim=self.prefix_gru.hidden_size,
            emb_dim=self.embed_proj[0].out_features,
        )
        return config

    @staticmethod
    def checkpoint_options(config: dict) -> dict:
        keys = ("shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")
        return {key: config[key] for key in keys}
