"""The EAGLE-1 head: a feature-level autoregressive drafter (Li et al., 2024).

At position i the head reads ``[embedding of token i+1 ; f_i]`` (``f_i`` the target's last
hidden state, the one its LM head reads), maps it from 2h to h with a linear layer and runs
``num_layers`` decoder layers of the target's own architecture (a dense Llama layer of its shape
over MoE and latent-attention targets, :func:`eagle_layer_config`) to predict ``f_{i+1}``; the
target's frozen LM head turns that into draft logits. The target's embedding and LM head are
used by reference and never saved into the head's checkpoint. An optional reduced draft
vocabulary (the most frequent tokens) makes every draft step's LM head call that much cheaper.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from draftsmith.heads.base import Head
from draftsmith.heads.common import Fp32RotaryMixin, decoder_classes
from draftsmith.target import target_record

KIND = "eagle"
FULL = "full_attention"
# Config fields that make a target's decoder layer sparse (routed experts) or its attention latent
# (DeepSeek's MLA): an EAGLE-1 head over such a target is one dense Llama layer of its shape.
ROUTED_OR_LATENT = ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank")


class EagleHead(Fp32RotaryMixin, Head):
    """``fc`` over ``[embedding ; feature]`` then decoder layers of the target's architecture."""

    kind = KIND
    # The input that carries the head's own output into its next draft step: a predicted feature.
    feedback_input = "features"

    def __init__(
        self,
        target_config: PretrainedConfig,
        num_layers: int = 1,
        draft_vocab: torch.Tensor | None = None,
        target_info: dict | None = None,
        layer_class: type | None = None,
        rotary_class: type | None = None,
    ):
        super().__init__(target_config.vocab_size, target_info)
        layer_config = eagle_layer_config(target_config)
        self.config = config = head_config(layer_config, num_layers)
        # The target's classes build the layers only where the layers are the target's own.
        if layer_class is None or rotary_class is None or layer_config is not target_config:
            layer_class, rotary_class = architecture_classes(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(layer_class(config, layer_idx=i) for i in range(num_layers))
        # The fc output is already a mixed feature: EAGLE drops the first layer's input norm.
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config)
        self._rotary_kwargs = rotary_kwargs(rotary_class)
        self.keep_draft_vocab(draft_vocab)
        # Held-out top-1 at draft depths 1, 2, ... from training's last evaluation: what depth=auto plans from.
        self.depth_accuracy: list[float] | None = None

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
    ):
        """Predicted next features ``[b, n, h]`` (as ``.last_hidden_state``, like an HF decoder).

        ``attention_mask`` is a 4D mask (additive, or boolean: True = attend), a ``[b, n]`` padding
        mask (1 = token), or None for plain causal attention after whatever ``past_key_values`` holds.
        """
        embeds = self.target.get_input_embeddings()(input_ids).to(features.dtype)
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        batch, n = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=hidden.device).expand(batch, n)
        attention_mask = attention_4d(attention_mask, batch, n, past, hidden)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids, **self._rotary_kwargs)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
            )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)

    # -- construction and checkpoints ------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        target_name: str,
        num_layers: int = 1,
        draft_vocab: torch.Tensor | None = None,
        init: str = "identity",
    ) -> EagleHead:
        """A fresh head for ``target``.

        ``identity`` sets ``fc`` to pass the feature through (``[0 | I]``) and zeroes the layers'
        residual output projections, so the head starts as ``f_{i+1} = f_i`` (measured here: a
        copy of the target's last layer instead starts ~40x worse in loss); ``random`` is the
        paper's initialisation.
        """
        head = cls(target.config, num_layers, draft_vocab, target_record(target, target_name), *decoder_classes(target))
        if init == "identity":
            with torch.no_grad():
                head.fc.bias.zero_()
            pass_last_feature_through(head)
        elif init != "random":
            raise ValueError(f"unknown EAGLE head init {init!r}; use 'identity' or 'random'")
        return head.bound_to(target)

    def checkpoint_config(self) -> dict:
        return self.recorded(self.config, num_layers=len(self.layers))

    @classmethod
    def from_checkpoint(cls, config: dict, state: dict, layer_classes: tuple) -> EagleHead:
        target_config = cls.recorded_target_config(config)
        return cls(
            target_config, config["num_layers"], state["draft_vocab"], config["target"], *layer_classes
        ).restored(config)


def eagle_layer_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The config an EAGLE-1 head's layers are built from: the target's own, unless its layers route
    tokens to experts or attend through a latent (:data:`ROUTED_OR_LATENT`): then a dense Llama
    layer of its shape (:func:`dense_layer_config`), which is what the EAGLE reference builds for
    every target (SafeAILab/EAGLE ``eagle/model/ea_model.py`` builds ``cnets.Model``, Llama decoder
    layers, over its Mixtral base models too) and what SGLang's and vLLM's ``llama_eagle.py`` serve."""
    if any(getattr(target_config, name, None) for name in ROUTED_OR_LATENT):
        return dense_layer_config(target_config)
    return target_config


def dense_layer_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """A dense :class:`LlamaConfig` of ``target_config``'s shape, for draft layers that are not the
    target's own, derived as speculators 0.9.0 derives its drafts' (``train/cli.py``
    ``create_transformer_layer_config``): the target's width, attention heads, KV heads and head
    size, its dense ``intermediate_size`` (a MoE config without one: 3 x hidden,
    ``resolve_draft_intermediate_size``), activation, norm epsilon and RoPE (per-layer-type RoPE
    collapsed to the sliding layers', else the full ones'; a partial rotary factor dropped), no
    attention bias, untied LM head."""
    hidden, heads = target_config.hidden_size, target_config.num_attention_heads
    rope = copy.deepcopy(getattr(target_config, "rope_parameters", None) or {})
    if "rope_theta" not in rope:  # {"sliding_attention": {...}, "full_attention": {...}}
        rope = dict(rope.get("sliding_attention") or rope.get("full_attention") or {})
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
    for key in ("type", "mrope_interleaved") + (() if "mrope_section" in rope else ("partial_rotary_factor",)):
        rope.pop(key, None)
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=getattr(target_config, "intermediate_size", None) or 3 * hidden,
        num_hidden_layers=target_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        hidden_act=getattr(target_config, "hidden_act", None)
        or getattr(target_config, "hidden_activation", None)
        or "silu",
        max_position_embeddings=target_config.max_position_embeddings,
        initializer_range=getattr(target_config, "initializer_range", 0.02),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", None) or 1e-6,
        rope_parameters=rope,
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )
    config.dtype = getattr(target_config, "dtype", None)
    return config


def head_config(target_config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of the target's config for a head of ``num_layers`` layers attending to the whole
    context: sdpa (the head's mask is a 4D float one), unless the layers soft-cap attention logits
    (Gemma-2), which only eager attention implements."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = num_layers
    _full_attention(config)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    return config


def architecture_classes(config: PretrainedConfig) -> tuple[type, type]:
    """Decoder-layer and rotary-embedding classes of ``config``'s architecture."""
    from transformers import AutoModel

    with torch.device("meta"):
        shell = AutoModel.from_config(config)
    return type(shell.layers[0]), type(shell.rotary_emb)


@torch.no_grad()
def pass_last_feature_through(head: nn.Module) -> None:
    """Identity init: ``fc`` copies the last ``hidden_size`` columns of its input (the target
    feature) and every layer's residual branches start at zero, so the head outputs its input
    feature until training moves it."""
    hidden = head.fc.weight.shape[0]
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:] = torch.eye(hidden)
    for name, param in head.layers.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            param.zero_()


def rotary_kwargs(rotary_class: type) -> dict:
    """Rotary classes of mixed-layer models (Gemma-3) take the layer type they serve."""
    return {"layer_type": FULL} if "layer_type" in inspect.signature(rotary_class.forward).parameters else {}


def _full_attention(config: PretrainedConfig) -> None:
    """Make every layer of ``config`` attend to the whole context.

    A target's sliding windows (Mistral's ``sliding_window``, Gemma/Qwen ``layer_types``) are not
    the head's: it is trained with a full causal mask over the sequence, so it must draft with
    one, and its single layer is cheap at any length.
    """
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [FULL] * config.num_hidden_layers
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    if getattr(config, "use_sliding_window", False):
        config.use_sliding_window = False


def attention_4d(mask: torch.Tensor | None, batch: int, n: int, past: int, hidden: torch.Tensor) -> torch.Tensor:
    """An additive 4D mask in ``hidden``'s dtype from a head's ``attention_mask`` argument.

    Boolean 4D masks are converted here, where the dtype the layers compute in (autocast
    included) is known: boolean masks are silently wrong with eager attention.
    """
    if mask is not None and mask.dim() == 4:
        if mask.dtype != torch.bool:
            return mask
        allowed = mask
    else:
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=hidden.device).tril(diagonal=past)
        allowed = allowed.expand(batch, 1, n, past + n)
        if mask is not None:
            keys = torch.cat([mask.new_ones(batch, past), mask], dim=1).bool()
            allowed = allowed & keys[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
    return additive.masked_fill(~allowed, torch.finfo(hidden.dtype).min)
