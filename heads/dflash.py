"""The DFlash drafter (z-lab's DFlash; ``speculators``' and vLLM's ``dflash``): a block of tokens in one pass.

A small stack of Qwen3 decoder layers (the speculators / z-lab design uses Qwen3 layers, q/k norms
included, whatever the target) reads a block ``[anchor token, MASK x (b - 1)]`` at positions
``anchor .. anchor + b - 1``: its queries attend to each other in both directions and to the
context, which is not run through the layers but injected: the target's fused ``aux_layers``
states of every earlier position, through ``fc`` and ``hidden_norm``, become each layer's keys and
values by that layer's own ``k_proj`` (with ``k_norm`` and RoPE at the context's positions) and
``v_proj`` (:meth:`DFlashHead.add_context`). Slot k of the block, after the final norm and the
head's LM head (over a reduced draft vocabulary), scores the token at ``anchor + k``. The drafter
keeps the context keys in its cache and drops the block's after each pass.

Parameter names are speculators' ``DFlashDraftModel``'s (``fc``, ``hidden_norm``, ``layers.N.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d``); the token embedding is the target's, used by reference and
never saved, as speculators does. The mask slots read the target's row for ``mask_token_id`` too,
unless the head learns its own (``learn_mask_embedding``: a ``mask_embedding`` vector, which vLLM
0.32 reads from an export's ``mask_embedding.pt``), as it must where that row was never trained
(Llama-3's reserved tokens: near zero, :func:`weak_mask_row`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from draftsmith.heads.aux_layers import resolve_aux_layers
from draftsmith.heads.base import Head
from draftsmith.heads.common import Fp32RotaryMixin
from draftsmith.heads.vocab import d2t_for
from draftsmith.target import target_record

KIND = "dflash"
WEAK_MASK_ROW = 0.05  # a mask row under this fraction of the table's median row norm was never trained


def weak_mask_row(embedding: torch.Tensor, mask_token_id: int) -> tuple[float, float] | None:
    """``(row norm, median row norm)`` when ``embedding``'s row for the mask token is near zero
    (under :data:`WEAK_MASK_ROW` of the table's median row norm: an untrained reserved token, every
    mask slot entering layer 0 as ~0), else None."""
    norms = embedding.detach().float().norm(dim=-1)
    row, median = float(norms[mask_token_id]), float(norms.median())
    return (row, median) if row < WEAK_MASK_ROW * median else None


def initial_mask_embedding(embedding: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """A learned mask row's start: the target's row, or where that is near zero the table's mean
    row scaled to the median row norm."""
    table = embedding.detach().float()
    if weak_mask_row(table, mask_token_id) is None:
        return table[mask_token_id].clone()
    mean = table.mean(0)
    return mean * table.norm(dim=-1).median() / mean.norm().clamp(min=1e-12)


def draft_config(target_config: PretrainedConfig, num_layers: int) -> Qwen3Config:
    """Qwen3 layers of the target's width, heads, head size, MLP, norm epsilon and RoPE, all full
    attention (Qwen3Config's own defaults, e.g. head_dim 128, would not fit a SmolLM2 target)."""
    heads = target_config.num_attention_heads
    config = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        hidden_act="silu",
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(target_config.rope_parameters),
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    config._attn_implementation = "sdpa"
    return config


class ConfidenceHead(nn.Module):
    """A drafted position's acceptance logit: one linear unit over its features (speculators'
    and vLLM's DSpark ``confidence_head.proj``; any DFlash-family drafter may carry one)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DFlashHead(Fp32RotaryMixin, Head):
    """``fc`` + ``hidden_norm`` over fused target layers (the injected context), Qwen3 layers over the
    block, the final norm and a draft LM head."""

    kind = KIND
    shift = 0  # a slot sits at the token it drafts; the anchor's slot drafts nothing

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
    ):
        super().__init__(target_config.vocab_size, target_info)
        self.config = config = draft_config(target_config, num_layers)
        self.target_config = target_config  # recorded: the layers are built from it
        self.aux_layers, self.block_size, self.mask_token_id = list(aux_layers), int(block_size), int(mask_token_id)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(num_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, d2t.numel(), bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # The mask slots' input when learned (else the target's row for mask_token_id).
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if learn_mask_embedding else None
        # Each drafted position's predicted acceptance (cut=priced/threshold in the engine); may be
        # trained with the drafter or afterwards for a frozen one (drafter.confidence_for).
        self.confidence_head = None
        if confidence_head:
            self.add_confidence_head()
        self.keep_vocab_maps(d2t)
        self.depth_accuracy: list[float] | None = None  # held-out top-1 of block slots 1, 2, ...

    @property
    def draft_slots(self) -> int:
        """Tokens one block drafts at most: its slots after the anchor's (plus the anchor's own where
        a subclass's slots draft the token after their position, ``shift`` 1)."""
        return self.block_size - 1 + self.shift

    # -- scoring -------------------------------------------------------------------------------
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., N]``."""
        return self.lm_head(self.norm(hidden))

    def confidence_features(self) -> int:
        """Width of the confidence head's input: a drafted position's normed hidden state."""
        return self.config.hidden_size

    def add_confidence_head(self) -> None:
        """A fresh confidence head, on the device and in the dtype of the drafter's LM head."""
        weight = self.lm_head.weight
        self.confidence_head = ConfidenceHead(self.confidence_features()).to(weight.device, weight.dtype)

    def confidence_logits(self, normed: torch.Tensor, embedded: torch.Tensor | None = None) -> torch.Tensor | None:
        """Acceptance logits of the drafted positions whose normed hidden states are ``normed``
        (``embedded``: a subclass's extra features of the previous tokens); None without a confidence head."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(normed.to(self.confidence_head.proj.weight.dtype))

    # -- forward -------------------------------------------------------------------------------
    def add_context(self, cache, features: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Append the context's keys and values to ``cache``: ``features`` ``[b, n, len(aux) * h]``
        (the target's fused layers at positions ``position_ids`` ``[b, n]``) through ``fc`` and
        ``hidden_norm``, then each layer's ``k_proj`` + ``k_norm`` + RoPE and ``v_proj``."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(context, position_ids)
        for layer in self.layers:
            attention = layer.self_attn
            shape = (*context.shape[:-1], -1, attention.head_dim)
            keys = attention.k_norm(attention.k_proj(context).view(shape)).transpose(1, 2)
            values = attention.v_proj(context).view(shape).transpose(1, 2)
            # RoPE on the keys alone: apply_rotary_pos_emb would rotate a query too, every drafting step.
            keys = keys * cos.unsqueeze(1) + rotate_half(keys) * sin.unsqueeze(1)
            cache.update(keys, values, attention.layer_idx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The block's inputs: the target's embedding, the mask slots replaced by the learned row if
        there is one (as vLLM's ``embed_input_ids`` does with ``mask_embedding.pt``)."""
        hidden = self.target.get_input_embeddings()(input_ids).to(self.fc.weight.dtype)
        if self.mask_embedding is None:
            return hidden
        is_mask = (input_ids == self.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(hidden.dtype), hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values,
        attention_mask: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[b, q, h]`` of the block queries ``input_ids`` at ``position_ids``, over
        the context in ``past_key_values`` and themselves as ``attention_mask`` (4D: additive, or
        boolean with True = attend) allows; their keys are appended to the cache. ``context``
        (fused target layers at ``context_positions``) is first appended as :meth:`add_context`
        does, inside this call, so a wrapped head (DDP, ZeRO-3) gathers and reduces ``fc``."""
        if context is not None:
            self.add_context(past_key_values, context, context_positions)
        hidden = self.embed(input_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        return hidden

    # -- construction and checkpoints ------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        target_name: str,
        aux_layers: list[int] | None,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        draft_vocab: torch.Tensor | None = None,
        learn_mask_embedding: bool = False,
        **options,
    ) -> DFlashHead:
        """A fresh head for ``target``: random layers, the LM head starting as the target's rows for
        the draft vocabulary (None: the full vocabulary), the final norm as the target's and a learned
        mask row (``learn_mask_embedding``) as :func:`initial_mask_embedding`; ``options`` go to the
        class (a subclass's own settings)."""
        layers = target.config.num_hidden_layers
        aux = resolve_aux_layers(aux_layers, layers)
        head = cls(
            target.config,
            aux,
            num_layers,
            block_size,
            mask_token_id,
            d2t_for(draft_vocab, target.config.vocab_size),
            target_record(target, target_name),
            learn_mask_embedding=learn_mask_embedding,
            **options,
        )
        head.copy_target_scoring(target)
        if head.mask_embedding is not None:
            with torch.no_grad():
                head.mask_embedding.copy_(initial_mask_embedding(target.get_input_embeddings().weight, mask_token_id))
        return head.bound_to(target)

    def checkpoint_config(self) -> dict:
        return self.recorded(
            self.target_config,
            aux_layers=self.aux_layers,
            num_layers=len(self.layers),
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            learn_mask_embedding=self.mask_embedding is not None,
            confidence_head=self.confidence_head is not None,
        )

    @staticmethod
    def checkpoint_options(config: dict) -> dict:
        """Constructor arguments beyond the backbone's, read from a checkpoint's config (a subclass's own)."""
        return {
            "learn_mask_embedding": config.get("learn_mask_embedding", False),  # older checkpoints: the target's row
            "confidence_head": config.get("confidence_head", False),
        }

    @classmethod
    def from_checkpoint(cls, config: dict, state: dict, layer_classes: tuple) -> DFlashHead:
        # Qwen3 layers whatever the target: the target's layer classes are not used.
        return cls(
            cls.recorded_target_config(config),
            config["aux_layers"],
            config["num_layers"],
            config["block_size"],
            config["mask_token_id"],
            state["d2t"],
            config["target"],
            **cls.checkpoint_options(config),
        ).restored(config)
