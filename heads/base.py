"""What every drafter head is: bound to one target, scoring over a draft vocabulary, saved self-describing.

A head uses the target's embedding (and, unless it has an LM head of its own, the target's LM head)
by reference: the target is never registered as a submodule and never saved. Its draft vocabulary
is either a saved buffer of token ids (``draft_vocab``: EAGLE-1, Medusa) or speculators' maps
(``d2t`` and ``t2d`` saved, ``draft_vocab`` derived: the fused-feature heads), so that exports
are copies. A checkpoint is a folder of ``config.json`` (``draftsmith_kind``, ``architectures``,
then the head's own fields) and ``model.safetensors`` (the head's weights only).

Logit scaling. Training targets are the target's real distribution: its LM head's logits through
:func:`~draftsmith.target.final_logits` (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
Gemma's soft cap), as its forward and the engine's verification compute them. Draft logits carry
only the multiplicative part (:func:`~draftsmith.target.logit_scale`), because that is all vLLM
0.32's drafters apply (``LogitsProcessor(scale=config.logit_scale)``, no soft cap; a cap is
monotone, so greedy drafts are the same): a head reading the target's LM head multiplies by it at
run time (exports tell vLLM through ``logit_scale``), a head's own LM head starts as the target's
rows times it (:func:`target_lm_rows`) and keeps it in its weights, so every engine computes it
from the weights alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from draftsmith.heads.common import load_head_parts, save_head
from draftsmith.heads.vocab import scatter_to_vocab, vocab_positions
from draftsmith.target import final_logits, logit_scale


def target_lm_rows(target: PreTrainedModel, token_ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``[N, h]`` of ``target``'s LM head for ``token_ids`` times its logit scale: where a
    head's own LM head starts, scoring as the target does short of a soft cap."""
    return target.get_output_embeddings().weight.detach()[token_ids].float() * logit_scale(target.config)


def same_dtype(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``weight`` ready to multiply ``hidden``: in its dtype, unless autocast is on for its device,
    which runs the product in its own dtype whatever the inputs' (a copy of a frozen LM-head table
    in fp32 would only be cast back)."""
    return weight if torch.is_autocast_enabled(hidden.device.type) else weight.to(hidden.dtype)


def embedding_table(model: PreTrainedModel) -> torch.Tensor:
    """``model``'s token embeddings as its embedding module gives them, one row per token: the
    table itself, or for a module that scales its lookups (Gemma's ``embed_scale``) the scaled
    rows, for a plain ``nn.Embedding`` (a head's own table, the engines' EAGLE-3 layers) to hold."""
    module = model.get_input_embeddings()
    if type(module) is torch.nn.Embedding:
        return module.weight
    with torch.no_grad():
        return module(torch.arange(module.weight.shape[0], device=module.weight.device))


class Head(nn.Module, ABC):
    """A drafter head over one target.

    A subclass names its checkpoint ``kind``, calls ``super().__init__(vocab_size, target_info)``,
    keeps its draft vocabulary with :meth:`keep_draft_vocab` or :meth:`keep_vocab_maps`, and says
    what its checkpoint holds (:meth:`checkpoint_config`) and how to rebuild it (:meth:`from_checkpoint`).
    """

    kind: str  # the checkpoint's draftsmith_kind

    def __init__(self, vocab_size: int, target_info: dict | None = None):
        super().__init__()
        self.vocab_size = int(vocab_size)  # the target's full vocabulary
        self.target_info = target_info or {}  # the target record checked on load
        self._target: tuple = ()  # a tuple: nn.Module neither registers nor saves it

    # -- the target ----------------------------------------------------------------------------
    def bind(self, target):
        """Use ``target``'s embedding and LM head (by reference, frozen); returns ``self``."""
        self._target = (target,)
        return self

    @property
    def target(self):
        if not self._target:
            raise RuntimeError(f"bind(target) the {type(self).__name__} before running it")
        return self._target[0]

    def bound_to(self, target: PreTrainedModel | None):
        """``self`` moved to ``target``'s device and bound to it (as it is without a target); for new
        and loaded heads alike."""
        if target is None:
            return self
        return self.to(device=next(target.parameters()).device).bind(target)

    # -- the draft vocabulary --------------------------------------------------------------------
    def keep_draft_vocab(self, draft_vocab: torch.Tensor | None) -> None:
        """Save the draft vocabulary as a buffer of sorted target ids ``draft_vocab`` (None: all of them)."""
        vocab = draft_vocab if draft_vocab is not None else torch.arange(self.vocab_size)
        self.register_buffer("draft_vocab", vocab.long(), persistent=True)

    def keep_vocab_maps(self, d2t: torch.Tensor) -> None:
        """Save speculators' maps of the draft vocabulary: ``d2t`` (target id = draft id +
        ``d2t[draft id]``) and ``t2d`` (marks the drafted target ids); ``draft_vocab`` (the draft
        vocabulary's target ids) is derived, not saved."""
        d2t = d2t.long()
        draft_vocab = torch.arange(d2t.numel()) + d2t
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[draft_vocab] = True
        self.register_buffer("d2t", d2t, persistent=True)
        self.register_buffer("t2d", t2d, persistent=True)
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab.numel() == self.vocab_size

    def draft_lm_weight(self) -> torch.Tensor:
        """The target LM head's rows for the draft vocabulary ``[N, h]`` (gathered once, then cached)."""
        weight = self.target.get_output_embeddings().weight
        if self.full_vocab:
            return weight
        # Gathering 8k of 49k rows on every call took 14% of a decode (torch.profiler); the
        # target's LM head is frozen, so the gathered copy stays valid until it changes.
        key = (weight.data_ptr(), weight.dtype, weight._version, self.draft_vocab.data_ptr())
        if getattr(self, "_draft_weight_key", None) != key:
            self._draft_weight = weight.detach()[self.draft_vocab]
            self._draft_weight_key = key
        return self._draft_weight

    def _target_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ same_dtype(self.draft_lm_weight(), hidden).T

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's fp32 logits over the draft vocabulary ``[..., N]`` from its last hidden states,
        as its forward gives them (:func:`~draftsmith.target.final_logits`): training targets."""
        return final_logits(self.target.config, self._target_lm_head(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., N]``: the target's LM head times its logit scale,
        not soft-capped (see the module's note); heads with an LM head of their own override it."""
        scale = logit_scale(self.target.config)
        logits = self._target_lm_head(hidden)
        return logits if scale == 1.0 else logits * scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the full vocabulary (``-inf`` outside the draft vocabulary)."""
        return self.to_full_vocab(self.draft_logits(hidden))

    def to_full_vocab(self, small: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the full vocabulary from draft-vocabulary logits (``-inf`` elsewhere)."""
        if self.full_vocab:
            return small.float()
        return scatter_to_vocab(small, self.draft_vocab, self.vocab_size)

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions of full-vocabulary ``tokens`` in the draft vocabulary; -1 where absent."""
        if self.full_vocab:
            return tokens
        # Built once per vocabulary and device: training maps every head's labels on every step.
        key = (self.draft_vocab.data_ptr(), tokens.device)
        if getattr(self, "_draft_lookup_key", None) != key:
            self._draft_lookup = vocab_positions(self.draft_vocab.to(tokens.device), self.vocab_size)
            self._draft_lookup_key = key
        return self._draft_lookup[tokens]

    @torch.no_grad()
    def copy_target_scoring(self, target: PreTrainedModel) -> None:
        """Start the head's own ``lm_head`` as the target's rows for the draft vocabulary and its
        ``norm`` as the target's final norm (if the target's decoder has one with a weight), so that
        it first scores as the target would."""
        self.lm_head.weight.copy_(target_lm_rows(target, self.draft_vocab))
        final_norm = getattr(target.get_decoder(), "norm", None)
        if final_norm is None or getattr(final_norm, "weight", None) is None:
            return
        self.norm.weight.copy_(final_norm.weight.float())
        if type(final_norm) is type(self.norm):
            return
        # A norm of another class: the copy stands where it computes what the target's does (Llama's
        # and Qwen3's RMSNorm); else (Gemma's scales by 1 + weight, a Llama-layer head's by weight)
        # the weight that makes the head's norm give the target's output on a unit-RMS input.
        device = self.norm.weight.device
        probe = torch.randn(2, self.norm.weight.numel(), generator=torch.Generator().manual_seed(0)).to(device)

        def target_norm(x: torch.Tensor) -> torch.Tensor:
            weight = final_norm.weight
            return final_norm(x.to(weight.device, weight.dtype)).float().to(device)

        if torch.allclose(
            self.norm(probe.to(self.norm.weight.dtype)).float(), target_norm(probe), rtol=1e-3, atol=1e-5
        ):
            return
        ones = torch.ones_like(probe[:1])
        self.norm.weight.fill_(1.0)
        self.norm.weight.copy_((target_norm(ones) / self.norm(ones.to(self.norm.weight.dtype)).float())[0])

    # -- checkpoints -----------------------------------------------------------------------------
    @abstractmethod
    def checkpoint_config(self) -> dict:
        """What ``config.json`` records after ``draftsmith_kind`` and ``architectures``: everything
        :meth:`from_checkpoint` rebuilds the head from."""

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, config: dict, state: dict, layer_classes: tuple) -> Head:
        """A head shaped as checkpoint ``config`` says (its weights are loaded after), from the
        checkpoint's ``state`` (buffers such as the draft vocabulary) and the target's
        ``(layer_class, rotary_class)`` (``(None, None)`` without a target)."""

    def recorded(self, target_config: PretrainedConfig, **fields) -> dict:
        """A checkpoint config of a head that plans its trees: a kind's own ``fields``, then its draft
        vocabulary's size, its held-out top-1 per depth (``depth_accuracy``, the planner's input),
        its target and the target config it was built from."""
        return {
            **fields,
            "draft_vocab_size": int(self.draft_vocab.numel()),
            "depth_accuracy": getattr(self, "depth_accuracy", None),
            "target": self.target_info,
            "target_config": target_config.to_dict(),
        }

    @staticmethod
    def recorded_target_config(config: dict) -> PretrainedConfig:
        """The target config a :meth:`recorded` checkpoint ``config`` was built from."""
        return AutoConfig.for_model(**config["target_config"])

    def restored(self, config: dict):
        """This head with the held-out record of a :meth:`recorded` checkpoint ``config``."""
        self.depth_accuracy = config.get("depth_accuracy")
        return self

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the head only, never the target's weights)."""
        save_head(self, path, self.kind, {"architectures": [type(self).__name__], **self.checkpoint_config()})

    @classmethod
    def from_pretrained(cls, path: str | Path, target: PreTrainedModel | None = None):
        """Load a head (a training checkpoint or an export); with ``target`` it is checked against
        the recorded target and bound to it."""
        config, state, layer_classes = load_head_parts(path, cls.kind, target)
        head = cls.from_checkpoint(config, state, layer_classes)
        head.load_state_dict(state)
        return head.bound_to(target)
