"""The P-EAGLE head: an EAGLE-3 head that drafts a whole chain of K tokens in one forward pass.

Drafting K tokens with EAGLE-3 takes K sequential head passes, each fed the previous one's output.
P-EAGLE feeds the K - 1 positions after the last known token with stand-ins instead: a mask token
(its row of the head's embedding table) and a mask feature (``mask_hidden``, a learned vector
in the fused target-layer space that goes through ``fc`` like real features). Position k attends
to the context and to the mask positions before it, so one pass over ``[token, MASK x (K - 1)]``
yields all K drafts; training runs the same layout (:func:`draftsmith.train.unroll.unroll` with
:func:`draftsmith.train.peagle.mask_inputs`), so pass j of training is draft depth j + 1.

Unlike EAGLE-3's, the token embedding is the head's own and trains (``embed_tokens``, speculators'
name, started as the target's table): speculators' P-EAGLE config sets ``embed_requires_grad: True``
("matches p-eagle-train", models/peagle/config.py:35-43) and saves ``embed_tokens.weight`` with the
head. SmolLM2's tokenizer fills its whole embedding table, so there is no spare row for a mask token:
the head picks a token id that never occurs in its training data (``mask_token_id``), whose row is
then the mask embedding; exports ship the trained table, which vLLM uses for the draft (it keeps a
draft embedding that differs from the target's).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.errors import CheckpointError
from draftsmith.heads.base import embedding_table
from draftsmith.heads.common import load_head_parts
from draftsmith.heads.eagle3 import Eagle3Head

KIND = "peagle"


class PEagleHead(Eagle3Head):
    """:class:`~draftsmith.heads.eagle3.Eagle3Head` plus a mask feature, with a trained embedding table of its own."""

    kind = KIND
    extra_config = ("mask_token_id", "num_depths")

    def __init__(
        self,
        target_config: PretrainedConfig,
        aux_layers: list[int],
        d2t: torch.Tensor,
        target_info: dict | None = None,
        layer_class: type | None = None,
        rotary_class: type | None = None,
        norm_before_residual: bool = False,
        mask_token_id: int = 0,
        num_depths: int = 1,
        num_layers: int = 1,
    ):
        super().__init__(
            target_config,
            aux_layers,
            d2t,
            target_info,
            layer_class,
            rotary_class,
            norm_before_residual,
            num_layers=num_layers,
        )
        if not 0 <= mask_token_id < target_config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary [0, {target_config.vocab_size})")
        self.mask_token_id = int(mask_token_id)
        self.num_depths = int(num_depths)  # tokens a pass was trained to draft (the drafter's default)
        hidden = self.config.hidden_size
        # speculators' shape: [1, 1, len(aux_layers) * hidden], in the space fc reads.
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, len(self.aux_layers) * hidden))
        self.embed_tokens = nn.Embedding(target_config.vocab_size, hidden)  # the mask token's row included

    @classmethod
    def for_target(
        cls,
        target,
        target_name: str,
        aux_layers: list[int] | None = None,
        draft_vocab: torch.Tensor | None = None,
        init: str = "identity",
        norm_before_residual: bool = False,
        mask_token_id: int = 0,
        num_depths: int = 1,
        num_layers: int = 1,
    ) -> PEagleHead:
        """A fresh head of ``num_layers`` decoder layers (see :meth:`Eagle3Head.for_target`) whose
        embedding table (the mask token's row included) starts as the target's and whose mask
        feature starts small and random."""
        head = super().for_target(
            target,
            target_name,
            aux_layers,
            draft_vocab,
            init,
            norm_before_residual,
            num_layers,
            mask_token_id=mask_token_id,
            num_depths=num_depths,
        )
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embedding_table(target))
            head.mask_hidden.normal_(std=0.02)
        return head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The head's own (trained) token embeddings, the mask token's included."""
        return self.embed_tokens(input_ids)

    @classmethod
    def from_pretrained(cls, path, target: PreTrainedModel | None = None) -> PEagleHead:
        """As :meth:`Head.from_pretrained`; a checkpoint from before the table trained (a
        ``mask_embedding`` row, the target's table by reference) loads with the target's table."""
        config, state, layer_classes = load_head_parts(path, cls.kind, target)
        if "mask_embedding" in state:
            if target is None:
                raise CheckpointError(
                    f"{path}: this P-EAGLE checkpoint keeps only its mask row: load it with its target"
                )
            table = embedding_table(target).detach().float().cpu().clone()
            table[config["mask_token_id"]] = state.pop("mask_embedding").float()
            state["embed_tokens.weight"] = table
        head = cls.from_checkpoint(config, state, layer_classes)
        head.load_state_dict(state)
        return head.bound_to(target)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        **kwargs,
    ):
        """As :meth:`Eagle3Head.forward`; without ``features`` and ``hidden_states`` every position
        reads the mask feature (the positions of not-yet-drafted tokens)."""
        if features is None and hidden_states is None:
            features = self.mask_hidden.expand(*input_ids.shape, -1)
        return super().forward(input_ids, features, hidden_states, **kwargs)
