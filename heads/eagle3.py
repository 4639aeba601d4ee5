"""The EAGLE-3 head (Li et al., 2025): drafts from fused low/mid/high target features and from itself.

At position i the head reads the embedding of token i+1 and a hidden state: for tokens the target
has processed, ``fc`` over the concatenated hidden states of several target layers
(``aux_layers``, by default 2, N/2 and N-3: HF ``hidden_states[L]``, the input of decoder layer
L); for tokens it drafted itself, its own previous output. ``num_layers`` decoder layers of the
target's architecture (1 by default; upstream P-EAGLE drafters use 4) turn that into the next hidden
state: the first one's q/k/v projections take ``[input_layernorm(embedding) ; hidden_norm(hidden)]``
(``2 * hidden`` inputs), the later ones are the target's plain decoder layers over the hidden state
alone (no embedding, no ``hidden_norm``). The head's own norm and LM head (over a reduced draft
vocabulary) score the next token from the last layer's output, which is also what a later draft
step reads back. There is no feature regression: training unrolls the head on its own outputs
(training-time test, see :mod:`draftsmith.train.unroll`).

The head's layers are the target's own architecture when that is one the serving engines build
EAGLE-3 layers of (Llama, Qwen3: :data:`OWN_LAYER_TYPES`); any other target (MoE ones: Qwen3-MoE,
Mixtral, gpt-oss, DeepSeek-V3; and dense ones whose layers differ: Gemma 3, Phi-3's fused qkv)
gets one dense Llama layer shaped from its config (:func:`draft_layer_config`), as the references
build them: speculators 0.9.0's trainer makes every EAGLE-3 draft a dense ``llama`` (or ``qwen3``)
decoder from the verifier's config (``train/cli.py`` ``create_transformer_layer_config``, its MLP
width from ``models/utils.py`` ``resolve_draft_intermediate_size``: "the draft is an independent
small *dense* decoder"), and SpecForge's Qwen3-30B-A3B config is a one-layer
``LlamaForCausalLMEagle3`` (``configs/qwen3-30B-eagle3.json``; its MoE draft is an opt-in variant).

That layer layout is the one vLLM 0.32 and speculators 0.9.0 build from ``num_hidden_layers``:
vLLM's ``llama_eagle3.py`` / ``qwen3_eagle3.py`` give layer 0 ``2 * hidden`` q/k/v inputs and
layers 1.. ``hidden`` ones, fed the hidden state and residual only; speculators' ``Eagle3DraftModel``
builds its first-layer class at index 0 and the verifier's own decoder layer class at 1.. (without
``hidden_norm``, which vLLM builds but never reads past layer 0). Parameter and buffer names are
speculators' (``fc``, ``layers.0.hidden_norm``, ``layers.N.self_attn.q_proj``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), so export is a copy. Each layer has its own ``layer_idx`` (its slot
in a KV cache). The token embedding is the target's, used by reference and never saved.

EAGLE 3.1 (its attention-drift fix for deep drafts and long context; speculators 0.9.0
``models/eagle3/core.py`` and vLLM 0.32 ``llama_eagle3.py``, from vLLM PR #42764) adds two options,
both off by default, so an EAGLE-3 checkpoint is an EAGLE 3.1 head with both off: ``fc_norm``, an
RMSNorm per aux layer (``fc_norm.{i}``) over that layer's chunk of the features before ``fc``; and
``norm_output``, the head's ``norm`` applied to its output, so a later draft step reads the normed
state back and the LM head scores it without norming again.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from draftsmith.heads.aux_layers import resolve_aux_layers
from draftsmith.heads.base import Head
from draftsmith.heads.common import Fp32RotaryMixin, decoder_classes
from draftsmith.heads.eagle import (
    architecture_classes,
    attention_4d,
    dense_layer_config,
    head_config,
    pass_last_feature_through,
    rotary_kwargs,
)
from draftsmith.heads.vocab import d2t_for
from draftsmith.target import target_record

KIND = "eagle3"
# Targets of these architectures lend the head their own decoder layer: the EAGLE-3 layers
# speculators 0.9.0 builds (models/eagle3/model_definitions.py model_classes) and vLLM serves
# (llama_eagle3.py, qwen3_eagle3.py). Any other target gets a dense Llama layer of its shape.
OWN_LAYER_TYPES = ("llama", "qwen3")
# EAGLE 3.1's options (speculators 0.9's and vLLM 0.32's config fields of the same names), both off by default.
EAGLE31_OPTIONS = ("fc_norm", "norm_output")


def draft_layer_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The config the head's decoder layers are built from: ``target_config`` itself for a target in
    :data:`OWN_LAYER_TYPES`, else a dense Llama layer of the target's shape
    (:func:`~draftsmith.heads.eagle.dense_layer_config`)."""
    return target_config if target_config.model_type in OWN_LAYER_TYPES else dense_layer_config(target_config)


class Eagle3Layer(nn.Module):
    """A decoder layer of the target's architecture whose attention reads ``[embedding ; hidden]``."""

    def __init__(self, config: PretrainedConfig, layer_class: type, norm_before_residual: bool = False):
        super().__init__()
        base = layer_class(config, layer_idx=0)
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        bias = getattr(config, "attention_bias", False)
        self.self_attn = base.self_attn
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.mlp = base.mlp
        self.input_layernorm = base.input_layernorm
        self.post_attention_layernorm = base.post_attention_layernorm
        self.hidden_norm = type(base.input_layernorm)(hidden, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, **attention) -> torch.Tensor:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        attended = self.self_attn(torch.cat([self.input_layernorm(embeds), hidden], dim=-1), **attention)[0]
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(Fp32RotaryMixin, Head):
    """``fc`` over fused target layers, an EAGLE-3 first layer and ``num_layers - 1`` plain decoder
    layers, its own norm and draft LM head."""

    # The input that carries the head's own output into its next draft step (the drafter uses it).
    feedback_input = "hidden_states"
    kind = KIND
    extra_config: tuple[
        str, ...
    ] = ()  # constructor arguments a subclass adds: saved in config.json, given back on load

    def __init__(
        self,
        target_config: PretrainedConfig,
        aux_layers: list[int],
        d2t: torch.Tensor,
        target_info: dict | None = None,
        layer_class: type | None = None,
        rotary_class: type | None = None,
        norm_before_residual: bool = False,
        num_layers: int = 1,
        fc_norm: bool = False,
        norm_output: bool = False,
    ):
        super().__init__(target_config.vocab_size, target_info)
        if num_layers < 1:
            raise ValueError(f"an EAGLE-3 head needs at least one decoder layer, got num_layers={num_layers}")
        layer_config = draft_layer_config(target_config)
        self.config = config = head_config(layer_config, num_layers)
        self.aux_layers = list(aux_layers)
        # The target's classes build the layers only where the layers are the target's own.
        if layer_class is None or rotary_class is None or layer_config is not target_config:
            layer_class, rotary_class = architecture_classes(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        # Layer 0 reads [embedding ; hidden]; layers 1.. are the target's own over the hidden state
        # (vLLM's and speculators' layout), each with its own layer_idx: its KV cache slot.
        self.layers = nn.ModuleList(
            [Eagle3Layer(config, layer_class, norm_before_residual)]
            + [layer_class(config, layer_idx=i) for i in range(1, num_layers)]
        )
        norm_class = type(self.layers[0].hidden_norm)
        # EAGLE 3.1: each aux layer's state gets an RMSNorm of its own before fc, so that no layer's
        # scale dominates the fusion (speculators' and vLLM's ``fc_norm``, ``fc_norm.{i}``).
        self.fc_norm = (
            nn.ModuleList(norm_class(hidden, eps=config.rms_norm_eps) for _ in self.aux_layers) if fc_norm else None
        )
        self.norm = norm_class(hidden, eps=config.rms_norm_eps)
        # EAGLE 3.1: the state handed to the next draft step (and to the LM head) is the normed one,
        # so its scale cannot drift from step to step (speculators' and vLLM's ``norm_output``).
        self.norm_output = norm_output
        self.lm_head = nn.Linear(hidden, d2t.numel(), bias=False)
        self.rotary_emb = rotary_class(config)
        self._rotary_kwargs = rotary_kwargs(rotary_class)
        self.keep_vocab_maps(d2t)
        # Held-out top-1 at draft depths 1, 2, ... from training's last evaluation: what depth=auto plans from.
        self.depth_accuracy: list[float] | None = None

    # -- scoring -------------------------------------------------------------------------------
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., N]`` (the head's own norm and LM head; with
        ``norm_output`` the head's outputs are normed already)."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
    ):
        """The head's next hidden states ``[b, n, h]`` (as ``.last_hidden_state``).

        Give ``features`` (the target's ``aux_layers`` states concatenated, ``[b, n, k*h]``) for
        tokens the target processed, or ``hidden_states`` (the head's own outputs) for drafted
        ones. ``attention_mask``: 4D (additive or boolean), ``[b, n]`` padding (1 = token), or None (causal).
        """
        if (features is None) == (hidden_states is None):
            raise ValueError("give exactly one of features (target layers) or hidden_states (the head's own)")
        embeds = self.embed(input_ids)
        hidden = self.fuse(features.to(self.fc.weight.dtype)) if features is not None else hidden_states
        embeds = embeds.to(hidden.dtype)
        batch, n = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=hidden.device).expand(batch, n)
        attention_mask = attention_4d(attention_mask, batch, n, past, hidden)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids, **self._rotary_kwargs)
        attention = {
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "use_cache": use_cache,
            "position_embeddings": position_embeddings,
        }
        hidden = self.layers[0](embeds, hidden, **attention)
        for layer in self.layers[1:]:  # the target's own layers: the hidden state only
            hidden = layer(hidden, **attention)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.norm_output:
            hidden = self.norm(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated aux states ``[..., k*h]``, each state normed by its own
        ``fc_norm`` first where the head has them."""
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the target's (by reference)."""
        return self.target.get_input_embeddings()(input_ids)

    # -- construction and checkpoints ------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        target_name: str,
        aux_layers: list[int] | None = None,
        draft_vocab: torch.Tensor | None = None,
        init: str = "identity",
        norm_before_residual: bool = False,
        num_layers: int = 1,
        **extra,
    ) -> Eagle3Head:
        """A fresh head of ``num_layers`` decoder layers for ``target``; ``draft_vocab`` (sorted
        target ids) or None for the full vocabulary.

        The LM head starts as the target's rows for the draft vocabulary and the norm as the
        target's final norm. ``identity`` also makes ``fc`` pass the highest aux layer through and
        zeroes every layer's residual branches, so the head starts as an early exit of the target at
        that layer; ``random`` leaves ``fc`` and the layers as initialised.
        """
        depth = target.config.num_hidden_layers
        aux = resolve_aux_layers(aux_layers, depth)
        head = cls(
            target.config,
            aux,
            d2t_for(draft_vocab, target.config.vocab_size),
            target_record(target, target_name),
            *decoder_classes(target),
            norm_before_residual,
            num_layers=num_layers,
            **extra,
        )
        head.copy_target_scoring(target)
        if init == "identity":
            pass_last_feature_through(head)
        elif init != "random":
            raise ValueError(f"unknown EAGLE-3 head init {init!r}; use 'identity' or 'random'")
        return head.bound_to(target)

    def checkpoint_config(self) -> dict:
        return self.recorded(
            self.config,
            num_layers=len(self.layers),
            aux_layers=self.aux_layers,
            norm_before_residual=self.layers[0].norm_before_residual,
            fc_norm=self.fc_norm is not None,
            norm_output=self.norm_output,
            **{key: getattr(self, key) for key in self.extra_config},
        )

    @classmethod
    def from_checkpoint(cls, config: dict, state: dict, layer_classes: tuple) -> Eagle3Head:
        return cls(
            cls.recorded_target_config(config),
            config["aux_layers"],
            state["d2t"],
            config["target"],
            *layer_classes,
            config.get("norm_before_residual", False),
            num_layers=config.get("num_layers", 1),  # checkpoints from before several layers: 1
            # Only the EAGLE 3.1 options a checkpoint sets: off is the constructor's default (and
            # every checkpoint's from before them), and heads built on this one (P-EAGLE) take none.
            **{key: True for key in EAGLE31_OPTIONS if config.get(key)},
            **{key: config[key] for key in cls.extra_config},
        ).restored(config)
