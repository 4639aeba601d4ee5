"""Training-time test: run a feature-level head on its own outputs, as it drafts, while training.

A head trained only on the target's true features drafts its second and later tokens from its
own imperfect ones, and acceptance collapses with depth. EAGLE-3's training-time test and HASS's
context alignment fix that the same way: pass 0 reads the target's features at every position;
pass j reads the head's outputs of pass j-1 (and the next ground-truth token), so position t of
pass j is the draft at depth j+1 below token t+1. Its queries attend to pass 0's keys causally
(the real context) and to their own position in passes 1..j (the draft's ancestors): exactly the
keys an EAGLE-2 tree node sees at inference. All passes share one KV cache.

Pass j's keys are one causal block plus j diagonals, so the head's attention is computed that way
(:func:`unrolled_attention`, as the EAGLE-3 and SpecForge trainers do): one ``n x n`` block and one
dot product per position for each earlier pass, not ``n x (j+1) n`` scores of which all but
``n (n + 1) / 2 + j n`` are masked. Seven passes then cost ~7 ``n^2`` in attention scores, not ~28.

Shapes: a batch of ``L`` tokens gives ``n = L - 1`` positions; position t of pass j predicts
token ``t + j + 2`` from the target's distribution at position ``t + j + 1``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


@dataclass
class UnrollLoss:
    """How the passes are weighed and scored."""

    steps: int = 1  # passes (1: the head sees only the target's features)
    decay: float = 0.8  # the loss of pass j is weighted decay ** j
    top_k: int | None = None  # HASS: add a distillation term over the target's K most likely tokens only
    ce_weight: float = 1.0  # weight of the distillation term over the target's whole distribution
    top_k_weight: float = 1.0  # weight of the top-K term (HASS: 1.0, beside 0.1 x the full term for EAGLE-1)
    regression_weight: float = 0.0  # weight of Smooth-L1 on the target's next feature (EAGLE-1)


UNROLLED_ATTENTION = "draftsmith_unrolled"


def pass_mask(padding: torch.Tensor, step: int) -> torch.Tensor:
    """Boolean ``[b, 1, n, (step + 1) n]`` mask of pass ``step`` over the keys of passes 0..step
    (the head turns it into an additive mask in its own dtype). With :func:`unrolled_attention`
    only the first block (``step=0``: causal over the real tokens) is given."""
    batch, n = padding.shape
    eye = torch.eye(n, dtype=torch.bool, device=padding.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=padding.device).tril()
    first = causal[None] & padding.bool()[:, None, :]
    return torch.cat([first] + [eye.expand(batch, n, n)] * step, dim=-1)[:, None]


def unrolled_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of unroll pass j (an ``AttentionInterface`` function, HF's calling convention).

    ``query`` ``[b, heads, n, d]``; ``key``/``value`` ``[b, kv_heads, (j+1) n, d]``: the cached keys
    of passes 0..j. Query t attends to pass 0's keys under ``attention_mask`` (``[b, 1, n, n]``,
    additive: causal over the real tokens) and to key t of each later pass, and to nothing else,
    which is what :func:`pass_mask` allows, computed without the masked-out scores.
    """
    heads, n = query.shape[1], query.shape[2]
    kv_heads, passes = key.shape[1], key.shape[2] // n
    if passes == 1:  # pass 0 is plain causal attention: the fused kernel
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    q = query.unflatten(1, (kv_heads, heads // kv_heads))  # grouped-query heads share a kv head
    scores = q @ key[:, :, None, :n].transpose(-1, -2) * scaling  # [b, kv, g, n, n]
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :n]
    ancestors_k = key[:, :, None, n:].unflatten(3, (passes - 1, n))  # [b, kv, 1, j, n, d]
    ancestors_v = value[:, :, None, n:].unflatten(3, (passes - 1, n))
    diagonal = (q.unsqueeze(3) * ancestors_k).sum(-1) * scaling  # [b, kv, g, j, n]
    probs = torch.cat([scores, diagonal.transpose(-1, -2)], dim=-1).softmax(-1, dtype=torch.float32)
    probs = F.dropout(probs.to(query.dtype), p=dropout, training=module.training)
    out = probs[..., :n] @ value[:, :, None, :n]
    out = out + (probs[..., n:].transpose(-1, -2).unsqueeze(-1) * ancestors_v).sum(3)
    return out.flatten(1, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register(UNROLLED_ATTENTION, unrolled_attention)


@contextmanager
def _attention_implementation(config, name: str):
    """Run the head's attention layers (which read their shared config at call time) with ``name``."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def unroll(head, input_ids: torch.Tensor, features: torch.Tensor, padding: torch.Tensor, steps: int,
           feedback: str = "features", detach: bool = False) -> list[torch.Tensor]:
    """The head's outputs ``[b, n, h]`` for passes ``0..steps-1``.

    ``input_ids`` ``[b, L]`` and ``features`` ``[b, L - 1, d]`` (the target's, paired with the
    next token); ``padding`` ``[b, L]`` is 1 on real tokens. Pass j>0 feeds the previous outputs
    back as the head's ``feedback`` input (its ``feedback_input``: ``head`` may be wrapped for
    DDP) with the tokens shifted j places left; ``detach`` stops gradients through the fed-back
    outputs (HASS), else later passes also train the earlier ones (EAGLE-3's training-time test). Attention runs as :func:`unrolled_attention`,
    except for heads whose layers soft-cap attention logits (Gemma-2: eager attention over the
    dense :func:`pass_mask`).
    """
    tokens, padding = input_ids[:, 1:], padding[:, 1:]
    batch, n = tokens.shape
    cache = DynamicCache()
    positions = torch.arange(n, device=tokens.device).expand(batch, n)
    outputs: list[torch.Tensor] = []
    inputs = {"features": features}
    config = getattr(head, "module", head).config
    blockwise = not getattr(config, "attn_logit_softcapping", None)
    implementation = UNROLLED_ATTENTION if blockwise else config._attn_implementation
    with _attention_implementation(config, implementation):
        for step in range(steps):
            shifted = torch.cat([tokens[:, step:], tokens.new_zeros(batch, step)], dim=1) if step else tokens
            out = head(shifted, position_ids=positions + step, past_key_values=cache, use_cache=True,
                       attention_mask=pass_mask(padding, 0 if blockwise else step), **inputs).last_hidden_state
            outputs.append(out)
            inputs = {feedback: out.detach() if detach else out}
    return outputs


def unrolled_loss(head, outputs: list[torch.Tensor], target_hidden: torch.Tensor, loss_mask: torch.Tensor,
                  padding: torch.Tensor, cfg: UnrollLoss, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted loss over the passes and metrics: ``top1``/``top3`` (pass 0, as without unrolling)
    and ``top1@d`` for every draft depth d, all summed over the positions of pass 0.

    ``target_hidden`` ``[b, L, h]``: the target's last hidden states (what its LM head reads).
    """
    valid = (loss_mask & padding.bool())
    total = outputs[0].new_zeros((), dtype=torch.float32)
    # The target's distributions are the same for every pass, shifted: computed once for all positions.
    with torch.no_grad():
        target_next = target_hidden[:, 1:].to(outputs[0].dtype)
        target_logits = head.target_logits(target_next).float()
        target_probs = target_logits.softmax(-1)
        best = _target_choice(head, target_next, target_logits, exact=not training)
    sums: dict[str, torch.Tensor] = {}  # read back together at the end: one host sync for all metrics
    for step, pred in enumerate(outputs):
        n = pred.shape[1] - step
        # Position t scores token t + step + 2 with the target's distribution at t + step + 1.
        mask = torch.zeros_like(valid[:, 1:])
        mask[:, : n - 1] = valid[:, step + 2:]
        mask = mask[:, :n]
        pred_t = pred[:, :n][mask]
        if step == 0:
            sums["tokens"] = mask.sum()
        if pred_t.shape[0] == 0:
            total = total + pred.sum() * 0.0
            continue
        probs_t, best_t = target_probs[:, step: step + n][mask], best[:, step: step + n][mask]
        log_q = head.draft_logits(pred_t).float().log_softmax(-1)
        ce = -(probs_t * log_q).sum(-1)
        per_token = cfg.ce_weight * ce
        if cfg.top_k:
            top = probs_t.topk(min(cfg.top_k, probs_t.shape[-1]), dim=-1).indices
            per_token = per_token - cfg.top_k_weight * (probs_t.gather(-1, top) * log_q.gather(-1, top)).sum(-1)
        if cfg.regression_weight:
            target_t = target_next[:, step: step + n][mask]
            regression = F.smooth_l1_loss(pred_t.float(), target_t.float(), reduction="none").mean(-1)
            per_token = per_token + cfg.regression_weight * regression
        total = total + cfg.decay ** step * per_token.mean()
        with torch.no_grad():
            top3 = head.draft_vocab[log_q.topk(min(3, log_q.shape[-1]), dim=-1).indices]
            hits = (top3[:, 0] == best_t).sum()
            sums[f"top1@{step + 1}"] = hits
            if step == 0:
                sums["top1"] = hits
                sums["top3"] = (top3 == best_t[:, None]).any(-1).sum()
                sums["ce_loss"] = ce.detach().sum()
                if cfg.regression_weight:
                    sums["regression_loss"] = regression.detach().sum()
    sums["loss"] = total.detach() * sums["tokens"]
    metrics = dict(zip(sums, torch.stack([v.float() for v in sums.values()]).tolist()))
    return total, metrics


def _target_choice(head, target_hidden: torch.Tensor, draft_logits: torch.Tensor, exact: bool) -> torch.Tensor:
    """The target's next token ids: its argmax within the draft vocabulary, or (``exact``, with a
    reduced vocabulary) over the full vocabulary, which costs a full LM-head pass."""
    if head.full_vocab or not exact:
        return head.draft_vocab[draft_logits.argmax(-1)]
    weight = head.target.get_output_embeddings().weight
    return (target_hidden @ weight.to(target_hidden.dtype).T).argmax(-1)
