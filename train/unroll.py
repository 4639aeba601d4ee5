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

Rows longer than :data:`DENSE_MASK_ROWS` positions (16K-32K-token conversations) hold no ``n x n``
tensor: their masks are the positions' segment ids, and :func:`segment_attention` builds each query
chunk's scores, uses them and (under autograd) recomputes them in the backward pass. Every pass then
runs over all positions (chain sampling still chooses the rows each pass scores, which the outputs
keep, zeros elsewhere, as sampled passes give them), and the loss scores a pass's rows a chunk at a
time, each chunk's logits recomputed in the backward pass (:func:`draft_scores`), so memory grows
with the row's length, not its square.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from draftsmith.data_prep.packing import block_causal_mask, head_segments, same_segment, segment_positions
from draftsmith.heads.base import same_dtype
from draftsmith.train.objectives import parse_objective, soft_coefficients, token_loss


@dataclass
class UnrollLoss:
    """How the passes are weighed and scored."""

    steps: int = 1  # passes (1: the head sees only the target's features)
    decay: float = 0.8  # the loss of pass j is weighted decay ** j
    top_k: int | None = None  # HASS: add a distillation term over the target's K most likely tokens only
    ce_weight: float = 1.0  # weight of the distillation term over the target's whole distribution
    top_k_weight: float = 1.0  # weight of the top-K term (HASS: 1.0, beside 0.1 x the full term for EAGLE-1)
    regression_weight: float = 0.0  # weight of Smooth-L1 on the target's next feature (EAGLE-1)
    mask_out_of_vocab: bool = False  # no token loss where the target's argmax is outside the draft vocabulary
    # One mean over the scored rows of all passes (P-EAGLE, as speculators and SpecForge reduce it: each
    # depth then weighs as many rows as it scores) instead of each pass's own mean, summed (EAGLE-3).
    pool_depths: bool = False
    # Weigh pass j by its reach, the product of passes 0..j-1's top-1 rates on the batch (the chance a
    # greedy chain gets that deep, what its draft's acceptance is worth), in place of decay ** j.
    reach: bool = False
    # The token term over the target's whole distribution (weighted ce_weight): train/objectives.py's mix.
    objective: dict[str, float] = field(default_factory=lambda: {"kl_div": 1.0})


def loss_settings(drafter, **extra) -> UnrollLoss:
    """The :class:`UnrollLoss` a feature-level head's ``drafter`` recipe section gives (its passes
    and their decay, HASS's top-K term, the token objective), with ``extra`` fields of the kind's own."""
    return UnrollLoss(
        steps=drafter.ttt_steps,
        decay=drafter.ttt_step_loss_decay,
        top_k=drafter.top_k_loss,
        top_k_weight=drafter.top_k_weight,
        objective=parse_objective(drafter.objective),
        **extra,
    )


UNROLLED_ATTENTION = "draftsmith_unrolled"
DENSE_MASK_ROWS = 4096  # head positions up to which a pass's mask is built whole (n x n); longer rows: segment ids
ATTENTION_CHUNK = 1 << 23  # mask elements of one query chunk of a long row (queries x keys): 8 MiB as booleans
LOSS_CHUNK = 1 << 25  # scored rows x draft vocabulary above which a pass's logits are taken a chunk at a time


def pass_mask(padding: torch.Tensor, step: int) -> torch.Tensor:
    """Boolean ``[b, 1, n, (step + 1) n]`` mask of pass ``step`` over the keys of passes 0..step
    (the head turns it into an additive mask in its own dtype). With :func:`unrolled_attention`
    only the first block (``step=0``: causal over the real tokens of the query's own conversation)
    is given. ``padding`` ``[b, n]``: the head positions' segments (:func:`head_segments`; 0 on
    padding, which sees earlier padding only)."""
    batch, n = padding.shape
    eye = torch.eye(n, dtype=torch.bool, device=padding.device)
    first = block_causal_mask(padding)[:, 0]
    return torch.cat([first] + [eye.expand(batch, n, n)] * step, dim=-1)[:, None]


def unrolled_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of unroll pass j (an ``AttentionInterface`` function, HF's calling convention).

    ``query`` ``[b, heads, n, d]``; ``key``/``value`` ``[b, kv_heads, (j+1) n, d]``: the cached keys
    of passes 0..j. Query t attends to pass 0's keys under ``attention_mask`` (``[b, 1, n, n]``,
    additive: causal over the real tokens) and to key t of each later pass, and to nothing else,
    which is what :func:`pass_mask` allows, computed without the masked-out scores. An integer
    ``attention_mask`` ``[b, 1, 1, n]`` holds the positions' segment ids instead (a long row's,
    :func:`segment_attention`).
    """
    if attention_mask is not None and not attention_mask.is_floating_point():
        return segment_attention(module, query, key, value, attention_mask[:, 0, 0], scaling, dropout)
    heads, n = query.shape[1], query.shape[2]
    kv_heads, passes = key.shape[1], key.shape[2] // n
    if passes == 1:  # pass 0 is plain causal attention: the fused kernel
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
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


def segment_attention(
    module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor, scaling: float, dropout
) -> tuple[torch.Tensor, None]:
    """:func:`unrolled_attention` with pass 0's mask given as the positions' ``segments`` ``[b, n]``
    (:func:`pass_mask`'s first block: causal within a segment, padding's 0 seeing earlier padding),
    computed a chunk of queries at a time (:data:`ATTENTION_CHUNK` mask elements), each chunk by the
    fused kernel and under activation checkpointing where gradients flow: no ``n x n`` tensor is
    built or saved."""
    batch, n = query.shape[0], query.shape[2]
    rows = max(1, ATTENTION_CHUNK // (batch * n))
    # A chunk reads pass 0's keys up to its last query, rounded up to an eighth of the row: a few
    # shapes, not one per chunk (each shape's buffers are sized apart; one per chunk grew the heap).
    span = max(rows, -(-n // 8))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    parts = []
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        width = min(n, -(-stop // span) * span)
        args = (query, key, value, segments, start, stop, width, scaling, dropout, module.training)
        parts.append(checkpoint(_attention_rows, *args, use_reentrant=False) if grad else _attention_rows(*args))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _attention_rows(
    query, key, value, segments, start: int, stop: int, width: int, scaling: float, dropout: float, training: bool
):
    """Queries ``start:stop`` of :func:`segment_attention`, ``[b, heads, stop - start, d]``: one fused
    attention over pass 0's first ``width`` (>= ``stop``) keys (none past ``stop`` is visible) and,
    for each later pass, the chunk's own positions, of which a query sees only its own (the diagonal)."""
    n = query.shape[2]
    passes = key.shape[2] // n
    chunk = stop - start
    device = query.device
    causal = torch.arange(width, device=device)[None, :] <= torch.arange(start, stop, device=device)[:, None]
    mask = causal & (segments[:, start:stop, None] == segments[:, None, :width])  # [b, c, width]
    keys, values = key[:, :, :width], value[:, :, :width]
    later = [slice(p * n + start, p * n + stop) for p in range(1, passes)]
    if later:  # each later pass's keys at the chunk's positions, after pass 0's (pass 0 alone: views, no copy)
        keys = torch.cat([keys] + [key[:, :, rows] for rows in later], dim=2)
        values = torch.cat([values] + [value[:, :, rows] for rows in later], dim=2)
        diagonal = torch.eye(chunk, dtype=torch.bool, device=device).expand(mask.shape[0], chunk, chunk)
        mask = torch.cat([mask] + [diagonal] * len(later), dim=-1)
    return F.scaled_dot_product_attention(
        query[:, :, start:stop],
        keys,
        values,
        attn_mask=mask[:, None],
        dropout_p=dropout if training else 0.0,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


@contextmanager
def attention_implementation(config, name: str):
    """Run the head's attention layers (which read their shared config at call time) with ``name``."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


LaterInputs = Callable[[torch.Tensor, torch.Tensor | None, int, torch.Tensor], tuple[torch.Tensor, dict]]
"""What pass ``step`` > 0 of :func:`unroll` reads: ``(tokens, rows, step, previous) -> (ids, inputs)``,
given the pass-0 tokens ``[b, n]``, the head positions the pass runs (``rows`` ``[b, m]``, a sampled
pass's; None: all ``n``) and pass ``step - 1``'s outputs ``previous`` ``[b, n, h]``: the token ids at
those positions (``[b, m]`` or ``[b, n]``) and the head's keyword inputs there (its features or fed-back
hidden states; none: the head's own stand-in)."""


def unroll(
    head,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    padding: torch.Tensor,
    steps: int,
    feedback: str = "features",
    detach: bool = False,
    later_inputs: LaterInputs | None = None,
    chains: list[Chains] | None = None,
    dense_rows: int | None = None,
) -> list[torch.Tensor]:
    """The head's outputs ``[b, n, h]`` for passes ``0..steps-1``.

    ``input_ids`` ``[b, L]`` and ``features`` ``[b, L - 1, d]`` (the target's, paired with the next
    token); ``padding`` ``[b, L]`` is 1 on real tokens, or a packed batch's segment ids
    (:mod:`draftsmith.data_prep.packing`): attention and positions then stop at each conversation.
    ``later_inputs`` gives pass j>0's token ids and head inputs (:data:`LaterInputs`); by default
    (:func:`fed_back`) it feeds the previous outputs back as the head's ``feedback`` input (its
    ``feedback_input``: ``head`` may be wrapped for DDP) with the tokens shifted j places left;
    ``detach`` stops gradients through the fed-back outputs (HASS), else later passes also train the
    earlier ones (EAGLE-3's training-time test). A kind whose later passes read other inputs passes
    its own (``feedback`` and ``detach`` then go unused). Attention runs as :func:`unrolled_attention`,
    except for heads whose layers soft-cap attention logits (Gemma-2: eager attention over the dense
    :func:`pass_mask`). ``chains`` (chain sampling, :func:`chain_sample`) runs pass j>0 on pass j's
    sampled positions only, reading ``later_inputs``' ids and inputs there; the other rows of its
    output are zeros (no loss may read them).
    Rows of more than ``dense_rows`` (default :data:`DENSE_MASK_ROWS`) positions run every pass over
    all positions with segment-id masks (:func:`segment_attention`), their outputs zeroed where
    ``chains`` did not sample: the same outputs without an ``n x n`` tensor.
    """
    # Head position t reads token t's feature and token t + 1: a pair of one conversation (packed
    # rows hold several; ``padding`` holds their segment ids), at token t's position within it.
    tokens, positions, padding = input_ids[:, 1:], segment_positions(padding)[:, :-1], head_segments(padding)
    n = tokens.shape[1]
    cache = DynamicCache()
    outputs: list[torch.Tensor] = []
    inputs = {"features": features}
    later_inputs = later_inputs or partial(fed_back, feedback=feedback, detach=detach)
    config = getattr(head, "module", head).config
    softcapped = getattr(config, "attn_logit_softcapping", None)
    # Soft-capped heads (Gemma-2) attend eagerly over dense masks, whatever the length.
    long = n > (DENSE_MASK_ROWS if dense_rows is None else dense_rows) and not softcapped
    # Sampled passes hold fewer keys than n: their masks are dense (a chain's ancestors are not on a diagonal).
    blockwise = not softcapped and (chains is None or long)
    implementation = UNROLLED_ATTENTION if blockwise else config._attn_implementation
    passes: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # a long row's keys and values, per pass and layer
    with attention_implementation(config, implementation):
        for step in range(steps):
            sampled = chains is not None and step and not long  # a pass over its chains' positions only
            ids = tokens
            if step:
                ids, inputs = later_inputs(tokens, chains[step - 1].positions if sampled else None, step, outputs[-1])
            if sampled:
                outputs.append(_sampled_pass(head, chains[:step], padding, positions, step, cache, ids, inputs))
                continue
            if long:
                grad = torch.is_grad_enabled()
                # A copy of the list: the recomputation must see the passes this one saw, not later ones.
                args = (head, list(passes), ids, positions + step, padding, inputs)
                out, keys = checkpoint(_long_pass, *args, use_reentrant=False) if grad else _long_pass(*args)
                passes.append(keys)
            else:
                out = head(
                    ids,
                    position_ids=positions + step,
                    past_key_values=cache,
                    use_cache=True,
                    attention_mask=pass_mask(padding, 0 if blockwise else step),
                    **inputs,
                ).last_hidden_state
            if chains is not None and step:
                out = out * chains[step - 1].rows(n)[:, :, None]
            outputs.append(out)
    return outputs


def fed_back(
    tokens: torch.Tensor,
    rows: torch.Tensor | None,
    step: int,
    previous: torch.Tensor,
    feedback: str = "features",
    detach: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`unroll`'s default :data:`LaterInputs` (EAGLE-1, EAGLE-3, HASS): position t reads token
    ``t + step`` (0 past the end) and the previous pass's output at t as the head's ``feedback``
    input, ``detach``-ed for HASS."""
    shifted = torch.cat([tokens[:, step:], tokens.new_zeros(tokens.shape[0], step)], dim=1)
    fed = previous.detach() if detach else previous
    if rows is not None:
        shifted, fed = shifted.gather(1, rows), fed.gather(1, rows[:, :, None].expand(-1, -1, fed.shape[-1]))
    return shifted, {feedback: fed}


def _long_pass(head, passes, input_ids, position_ids, segments, inputs):
    """One pass of a long row: ``(outputs, keys)``, the head's outputs and its layers' keys and values
    of this pass, attending to the earlier ``passes``' keys and values (per pass, per layer) under
    the segment-id mask. Run under activation checkpointing, it keeps nothing of the pass for the
    backward pass but its arguments and results: the cache it fills is its own, built again when
    it is recomputed."""
    cache = DynamicCache()
    for layer, pairs in enumerate(zip(*passes)):
        cache.update(torch.cat([k for k, _ in pairs], dim=2), torch.cat([v for _, v in pairs], dim=2), layer)
    n = input_ids.shape[1]
    # Set here, not only by unroll: the backward pass recomputes this pass after unroll has returned.
    with attention_implementation(getattr(head, "module", head).config, UNROLLED_ATTENTION):
        out = head(
            input_ids,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            attention_mask=segments[:, None, None, :],
            **inputs,
        ).last_hidden_state
    # Copies: a view would keep the whole concatenated cache of this pass alive until the backward pass.
    return out, [(layer.keys[:, :, -n:].clone(), layer.values[:, :, -n:].clone()) for layer in cache.layers]


@dataclass
class Chains:
    """Pass j's sampled draft chains: ``positions`` ``[b, m]`` (the position t whose draft at depth
    j + 1 is trained; rows padded with unsampled positions) and ``valid`` ``[b, m]`` (False on padding)."""

    positions: torch.Tensor
    valid: torch.Tensor

    def rows(self, n: int) -> torch.Tensor:
        """Boolean ``[b, n]``: the sampled positions."""
        return torch.zeros(self.valid.shape[0], n, dtype=torch.bool, device=self.valid.device).scatter(
            1, self.positions, self.valid
        )


def chain_sample(
    supervised: torch.Tensor, steps: int, ratio: float, floor: float, segments: torch.Tensor | None = None
) -> list[Chains]:
    """P-EAGLE's chain (COD) sampling for passes ``1..steps-1``: pass j trains the drafts at depth
    j + 1 of a random ``max(ratio ** j, floor)`` share of the positions whose depth-(j + 1) token is
    supervised, drawn among the chains pass j - 1 kept (so every sampled draft's ancestors are
    computed), as speculators' and SpecForge's P-EAGLE trainers sample. Draws from the device's
    default generator (checkpointed with the run); reads back the largest row count once.

    ``supervised`` ``[b, n]``: whether position i's target (the token two places on) is supervised
    (:func:`supervised_next`); pass j's position t is scored there at ``t + j`` if that token is
    in t's conversation (:func:`scored_rows`; ``segments`` ``[b, n + 1]``: a packed batch's
    ``attention_mask``, None: one conversation a row).
    """
    batch, n = supervised.shape
    if steps < 2:
        return []
    shares = [max(ratio**j, floor) for j in range(1, steps)]
    shifted = [scored_rows(supervised, segments, j) for j in range(1, steps)]
    counts = torch.stack([(s.sum(-1) * share).floor().long() for s, share in zip(shifted, shares)])  # [steps-1, b]
    widths = counts.amax(-1).clamp(min=1).tolist()  # the one host sync: each pass's row width
    chains, kept = [], torch.ones_like(supervised)
    for need, count, width in zip(shifted, counts, widths):
        candidate = kept & need
        score = torch.rand(batch, n, device=supervised.device).masked_fill(~candidate, -1.0)
        top = score.topk(min(width, n), dim=-1)
        valid = (top.values >= 0) & (torch.arange(top.indices.shape[1], device=supervised.device) < count[:, None])
        chains.append(Chains(top.indices, valid))
        kept = chains[-1].rows(n)
    return chains


def _sampled_pass(
    head,
    chains: list[Chains],
    padding: torch.Tensor,
    positions: torch.Tensor,
    step: int,
    cache,
    input_ids: torch.Tensor,
    inputs: dict,
) -> torch.Tensor:
    """Pass ``step`` (> 0) over its sampled chains, scattered back to ``[b, n, h]``: each query reads
    ``input_ids`` ``[b, m]`` and ``inputs`` (:data:`LaterInputs`' at its chain) at its position + step
    and attends to the real context up to its position in its own conversation (``padding``: the head
    positions' segments, as :func:`pass_mask`; ``positions`` theirs within the conversation) and to its
    own chain's keys in passes 1..step."""
    own = chains[-1]
    batch, n = padding.shape
    context = torch.arange(n, device=padding.device)[None, None, :] <= own.positions[:, :, None]
    blocks = [context & (padding[:, None, :] == padding.gather(1, own.positions)[:, :, None])]
    for earlier in chains[:-1]:
        blocks.append(
            (earlier.positions[:, None, :] == own.positions[:, :, None])
            & earlier.valid[:, None, :]
            & own.valid[:, :, None]
        )
    blocks.append(torch.eye(own.positions.shape[1], dtype=torch.bool, device=padding.device).expand(batch, -1, -1))
    out = head(
        input_ids,
        position_ids=positions.gather(1, own.positions) + step,
        past_key_values=cache,
        use_cache=True,
        attention_mask=torch.cat(blocks, dim=-1)[:, None],
        **inputs,
    ).last_hidden_state
    index = own.positions[:, :, None].expand_as(out)
    return out.new_zeros(batch, n, out.shape[-1]).scatter(1, index, out * own.valid[:, :, None])


def scored_rows(supervised: torch.Tensor, segments: torch.Tensor | None, step: int) -> torch.Tensor:
    """Boolean ``[b, n]``: position t of pass ``step`` is scored, i.e. token ``t + step + 2`` is
    supervised (``supervised`` from :func:`supervised_next`) and of position t's conversation
    (``segments`` ``[b, n + 1]``, a packed batch's ``attention_mask``; None: one a row)."""
    batch = supervised.shape[0]
    rows = torch.cat([supervised[:, step:], supervised.new_zeros(batch, step)], dim=1)
    return rows if segments is None else rows & same_segment(segments, step + 2)


def supervised_next(loss_mask: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Boolean ``[b, L - 1]``: index i is True where token i + 2 is supervised (the target's
    distribution at i + 1, which scores it, is needed)."""
    valid = loss_mask.bool() & padding.bool()
    needed = torch.zeros_like(valid[:, 1:])
    needed[:, :-1] = valid[:, 2:]
    return needed


def depth_rates(logs: dict[str, float]) -> dict[str, float]:
    """Each depth's ``top1@d`` over that depth's own scored rows (``rows@d``, dropped): the loop
    divides every sum by one token count, and depths score different numbers of rows (sequence
    ends; sampled chains). ``top1`` defaults to depth 1's."""
    out = {key: value for key, value in logs.items() if "rows@" not in key.rpartition("/")[2]}
    for key, value in logs.items():
        prefix, _, name = key.rpartition("/")
        if name.startswith("top1@") and f"{prefix}/rows@{name[5:]}" in logs:
            rows = logs[f"{prefix}/rows@{name[5:]}"]
            out[key] = value / rows if rows else 0.0
    for prefix in {key.rpartition("/")[0] for key in out if key.endswith("/top1@1")}:
        out.setdefault(f"{prefix}/top1", out[f"{prefix}/top1@1"])
    return out


def record_depth_accuracy(head, metrics: dict[str, float]) -> None:
    """Keep an evaluation's held-out top-1 at every draft depth (``eval/top1@d``) on ``head``, which
    saves it in its checkpoint: ``depth=auto`` plans the draft tree from it."""
    depths = sorted(int(key.rsplit("@", 1)[1]) for key in metrics if key.startswith("eval/top1@"))
    if depths:
        head.depth_accuracy = [round(metrics[f"eval/top1@{d}"], 4) for d in depths]


def unrolled_loss(
    head,
    outputs: list[torch.Tensor],
    target_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    padding: torch.Tensor,
    cfg: UnrollLoss,
    training: bool,
    chains: list[Chains] | None = None,
    weights: torch.Tensor | None = None,
    greedy_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted loss over the passes and metrics: ``top1``/``top3`` (pass 0, as without unrolling)
    and ``top1@d`` with ``rows@d`` for every draft depth d (hits and scored positions: the task's
    :func:`depth_rates` divides them).

    ``target_hidden`` ``[b, L, h]``: the target's last hidden states (what its LM head reads).
    Metrics count every supervised position; with ``cfg.mask_out_of_vocab`` the loss skips those
    whose target token (full-vocabulary argmax) the draft vocabulary lacks (``t2d`` false), as the
    EAGLE-3 and SpecForge trainers do, instead of fitting the distribution renormalised over it.
    With ``chains`` pass j > 0 scores its sampled positions only. The loss is the sum over passes of
    ``decay ** j`` x each pass's mean over its scored rows, or with ``cfg.pool_depths`` one mean: the
    sum of ``decay ** j`` x every pass's row losses over the rows all passes score. With ``cfg.reach``
    pass j weighs its reach in place of ``decay ** j``: the product of passes 0..j-1's top-1 rates
    against the target's next token on this batch (detached, on the device: no host sync), so a depth
    trains in proportion to the chance a greedy chain drafted by this head gets there.

    ``weights`` ``[b, L]`` (None: uniform): a loss weight per token, applied wherever that token is
    scored, at every depth; each token-loss mean above becomes the weighted mean ``sum(w * loss) /
    sum(w)`` over its rows (``adapt.rejected_weight``: heavier where the served draft was rejected);
    EAGLE-1's feature regression stays unweighted (no kind that adapts trains one). Metrics stay
    unweighted counts. Weights of 1 give the unweighted loss exactly.

    ``greedy_ids`` ``[b, L]``: the batch's token ids where the target wrote its replies greedily,
    read as its next tokens in training (:func:`target_terms`'s ``greedy_next``).
    """
    total = outputs[0].new_zeros((), dtype=torch.float32)
    # pool_depths: the passes' weighted row sums and row counts (token loss, regression), divided at the end.
    pooled = {"token": total, "token_rows": total, "regression": total, "regression_rows": total}
    # The target's distribution at index i of target_next scores token i + 2: it is needed where
    # that token is supervised, by pass j at position i - j. Computed once for all passes, only there.
    needed = supervised_next(loss_mask, padding)
    row_of = torch.cumsum(needed.flatten(), 0).view_as(needed) - 1  # row of each needed index in `coeff`
    # Index i of `needed` stands for token i + 2 (its last index is never needed): the needed tokens'
    # weights and, on greedy replies, ids.
    next_needed = needed[:, :-1]
    row_weight = weights[:, 2:][next_needed].float() if weights is not None else None
    with torch.no_grad():
        greedy_next = greedy_ids[:, 2:][next_needed] if greedy_ids is not None else None
        target_probs, best, coeff, keep = target_terms(
            head, target_hidden[:, 1:][needed].to(outputs[0].dtype), cfg, training, greedy_next
        )
        if cfg.regression_weight:
            next_feature = target_hidden[:, 1:][needed]
    sums: dict[str, torch.Tensor] = {}  # read back together at the end: one host sync for all metrics
    reach = total.new_ones(())  # pass 0's weight under cfg.reach
    for step, pred in enumerate(outputs):
        weight = reach if cfg.reach else cfg.decay**step
        n = pred.shape[1] - step
        # Position t scores token t + step + 2 (of its own conversation) with the target's distribution at t + step + 1.
        mask = scored_rows(needed, padding, step)[:, :n]
        if chains is not None and step:
            mask = mask & chains[step - 1].rows(pred.shape[1])[:, :n]
        rows = row_of[:, step : step + n][mask]
        pred_t = pred[:, :n][mask]
        if step == 0:
            sums["tokens"] = mask.sum()
        if pred_t.shape[0] == 0:
            total = total + pred.sum() * 0.0
            continue
        kept = keep.index_select(0, rows)
        ce, lse, top3, dot = draft_scores(head, pred_t, rows, coeff, target_probs, cfg.objective, cfg.ce_weight * kept)
        counted = kept  # each row's share of the mean's denominator
        if row_weight is not None:
            weight_t = row_weight.index_select(0, rows)
            ce, counted = ce * weight_t, kept * weight_t
        if cfg.regression_weight:
            target_t = next_feature.index_select(0, rows)
            regression = F.smooth_l1_loss(pred_t.float(), target_t.float(), reduction="none").mean(-1)
        if cfg.pool_depths:
            pooled["token"] = pooled["token"] + weight * ce.sum()
            pooled["token_rows"] = pooled["token_rows"] + counted.sum()
            if cfg.regression_weight:
                pooled["regression"] = pooled["regression"] + weight * regression.sum()
                pooled["regression_rows"] = pooled["regression_rows"] + regression.shape[0]
        else:
            loss = ce.sum() / counted.sum().clamp(min=1)
            if cfg.regression_weight:
                loss = loss + cfg.regression_weight * regression.mean()
            total = total + weight * loss
        with torch.no_grad():
            best_t = best.index_select(0, rows)
            top3 = head.draft_vocab[top3]
            hits = (top3[:, 0] == best_t).sum()
            sums[f"top1@{step + 1}"] = hits
            sums[f"rows@{step + 1}"] = mask.sum()
            reach = reach * hits / sums[f"rows@{step + 1}"].clamp(min=1)
            if step == 0:
                sums["top1"] = hits
                sums["top3"] = (top3 == best_t[:, None]).any(-1).sum()
                # The plain soft cross-entropy, whatever the loss's terms: lse - p.z (p sums to 1).
                sums["ce_loss"] = (lse - dot).sum()
                if cfg.regression_weight:
                    sums["regression_loss"] = regression.detach().sum()
    if cfg.pool_depths:
        total = total + pooled["token"] / pooled["token_rows"].clamp(min=1)
        if cfg.regression_weight:
            total = total + cfg.regression_weight * pooled["regression"] / pooled["regression_rows"].clamp(min=1)
    sums["loss"] = total.detach() * sums["tokens"]
    metrics = dict(zip(sums, torch.stack([v.float() for v in sums.values()]).tolist()))
    return total, metrics


def draft_scores(
    head,
    pred: torch.Tensor,
    rows: torch.Tensor,
    coeff: torch.Tensor,
    probs: torch.Tensor,
    objective: dict[str, float],
    weight: torch.Tensor,
    chunk: int = LOSS_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, top3, dot)`` per scored row of the head's outputs ``pred`` ``[rows, h]``: the
    token loss of its draft logits ``z`` (:func:`~draftsmith.train.objectives.token_loss` with the
    weights ``coeff``, the target's ``probs`` (tables ``[needed, V]`` read at ``rows``) and the
    per-row ``weight``), their log-sum-exp, the 3 most likely draft ids and ``p.z``. Past ``chunk``
    logits (rows x vocabulary) the rows are taken a chunk at a time under activation checkpointing:
    only ``pred`` and ``rows`` are kept for the backward pass, never a whole long row's
    ``[rows, vocab]`` logits or its rows of the tables."""
    size = max(1, chunk // coeff.shape[-1])
    if pred.shape[0] <= size:
        return _scores(head, pred, rows, coeff, probs, objective, weight)
    grad = torch.is_grad_enabled() and pred.requires_grad
    parts = []
    for start in range(0, pred.shape[0], size):
        part = slice(start, start + size)
        args = (head, pred[part], rows[part], coeff, probs, objective, weight[part])
        parts.append(checkpoint(_scores, *args, use_reentrant=False) if grad else _scores(*args))
    return tuple(torch.cat(values) for values in zip(*parts))


def _scores(head, pred, rows, coeff, probs, objective, weight):
    logits = head.draft_logits(pred)
    probs = probs.index_select(0, rows)
    loss, lse = token_loss(logits, coeff.index_select(0, rows), probs, objective, weight)
    with torch.no_grad():
        top3 = logits.topk(min(3, logits.shape[-1]), dim=-1).indices
        dot = torch.bmm(probs.unsqueeze(1), logits.float().unsqueeze(2)).view(-1)
    return loss, lse, top3, dot


def greedy_replies(data) -> bool:
    """Whether the recipe's ``data`` section has the target rewrite every reply greedily
    (``data.regenerate``, temperature 0, all conversations): each reply token is then the target's
    argmax there."""
    regenerate = getattr(data, "regenerate", None)
    return bool(
        regenerate is not None
        and regenerate.enabled
        and regenerate.temperature == 0
        and regenerate.conversations is None
    )


@torch.no_grad()
def target_terms(head, target_next: torch.Tensor, cfg: UnrollLoss, training: bool, greedy_next=None):
    """``(probs, best, coeff, kept)`` for rows of the target's last hidden states ``target_next``:
    its distribution over the draft vocabulary, its next token (exact, over the full vocabulary, in
    evaluation or when masking), the loss weights ``c`` (:func:`loss_coefficients`, zeroed where
    ``cfg.mask_out_of_vocab`` drops the row) and which rows keep a token loss.

    ``greedy_next``: the data's tokens these rows predict, where the target wrote them greedily
    (:func:`greedy_replies`); where training needs the exact argmax (the out-of-vocabulary mask over a
    reduced draft vocabulary) they are its next token, read instead of computed: that argmax is a
    full-vocabulary LM-head pass, a quarter of an EAGLE-3 step on the bundled target. Held-out
    evaluation still computes it."""
    probs = head.target_logits(target_next).float().softmax(-1)
    exact = not training or cfg.mask_out_of_vocab
    if training and exact and greedy_next is not None and not head.full_vocab:
        best = greedy_next  # where the exact pass would run; elsewhere the argmax is cheap and stays as it was
    else:
        best = _target_choice(head, target_next, probs, exact=exact)
    coeff = loss_coefficients(probs, cfg)
    kept = head.to_draft_ids(best) >= 0 if cfg.mask_out_of_vocab else torch.ones_like(best, dtype=torch.bool)
    coeff[~kept] = 0.0
    return probs, best, coeff, kept


def loss_coefficients(probs: torch.Tensor, cfg: UnrollLoss) -> torch.Tensor:
    """Weights ``c`` over the draft vocabulary with loss ``-sum_i c_i log q_i``: ``ce_weight`` x the
    objective's terms linear in ``log q`` (forward KL, CE on the argmax:
    :func:`~draftsmith.train.objectives.soft_coefficients`; the others are scored apart, see
    :func:`~draftsmith.train.objectives.token_loss`), plus ``top_k_weight`` x the target's K most
    likely entries (HASS)."""
    coeff = soft_coefficients(cfg.objective, probs, cfg.ce_weight)
    if cfg.top_k:
        top = probs.topk(min(cfg.top_k, probs.shape[-1]), dim=-1).indices
        coeff.scatter_add_(-1, top, probs.gather(-1, top) * cfg.top_k_weight)
    return coeff


def _target_choice(
    head, target_hidden: torch.Tensor, target_probs: torch.Tensor, exact: bool, chunk: int = 1024
) -> torch.Tensor:
    """The target's next token ids ``[rows]``: its argmax within the draft vocabulary, or (``exact``,
    with a reduced vocabulary) over the full vocabulary, which costs a full LM-head pass (taken
    ``chunk`` rows at a time: the full logits of a long batch of a 128k-vocabulary target would
    not fit)."""
    if head.full_vocab or not exact:
        # max's indices, the first maximum as argmax's, in half argmax's time over a full vocabulary
        return head.draft_vocab[target_probs.max(-1).indices]
    weight = same_dtype(head.target.get_output_embeddings().weight, target_hidden)
    return (
        torch.cat([(part @ weight.T).argmax(-1) for part in target_hidden.split(chunk)])
        if target_hidden.shape[0]
        else target_hidden.new_zeros(0, dtype=torch.long)
    )
