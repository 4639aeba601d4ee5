"""Train a DFlash drafter: ``accelerate launch train/dflash.py recipes/smollm2-dflash.yaml [--resume] [--key value]``.

The drafter (:mod:`draftsmith.heads.dflash`) drafts a block in one pass. Each step samples up to
``anchors_per_sequence`` anchor positions a in every batch row's supervised spans (where tokens
a and a + 1 are supervised: an anchor is a reply token, as the target's bonus token is), builds the
block ``[token a, MASK x (block_size - 1)]`` at positions ``a .. a + block_size - 1`` for each, and
runs all blocks of a row in one pass: a block's queries attend to the injected context of its own
conversation at positions before a and to their own block, both ways. A padded row is one
conversation; a packed row (``training.packing``) shares its anchors among its conversations, drawn
uniformly over all its candidates, as speculators 0.9 draws ``max_anchors`` per packed sequence
(``select_anchors``): every supervised token is equally likely an anchor, and a row's blocks, so
its cost and memory, do not grow with the conversations it holds.
Slot k is scored against the target's distribution (over the draft vocabulary) for token a + k,
where that token is supervised, weighted ``exp(-(k - 1) / decay_gamma)`` (DFlash) or by D-PACE
(``weighting: dpace``: the chance the block's earlier slots were all accepted, from each slot's
detached probability of the target's token). With ``drafter.labels: data`` slot k learns the
data's token a + k instead, by cross-entropy, as SpecForge trains the DFlash family. Data,
regenerated replies, the draft vocabulary, online or offline features and the out-of-vocabulary
mask are EAGLE-3's (:mod:`draftsmith.train.fused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

from draftsmith.config import COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, Range, RecipeError
from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.packing import same_segment, segment_positions
from draftsmith.heads.aux_layers import resolve_aux_layers
from draftsmith.heads.dflash import DFlashHead, weak_mask_row
from draftsmith.heads.vocab import mask_token_for
from draftsmith.recipe import DRAFT_VOCAB, DataConfig, DrafterConfig, Recipe
from draftsmith.train.cli import entry_point
from draftsmith.train.fused import build_task, fused_target_features, regenerated_data
from draftsmith.train.objectives import SOFT, describe, parse_objective, row_dot, token_loss
from draftsmith.train.unroll import (
    UnrollLoss,
    attention_implementation,
    depth_rates,
    greedy_replies,
    record_depth_accuracy,
    target_terms,
)


@dataclass
class DFlashDrafterConfig(DrafterConfig):
    """The DFlash drafter, its blocks and its loss."""

    kind: str = "dflash"
    # target layers fused as the context (HF hidden_states ids); null: [2, N/2, N-3]
    aux_layers: Annotated[list[int], NON_NEGATIVE_INT] | None = None
    num_layers: Annotated[int, COUNT] = 2  # Qwen3 decoder layers (speculators' default: 5)
    # anchor + block_size - 1 drafted tokens (speculators' default: 16); at least an anchor and a drafted token
    block_size: Annotated[int, Range(2, integer=True)] = 8
    # blocks trained per batch row and step (a packed row's conversations share them)
    anchors_per_sequence: Annotated[int, COUNT] = 64
    # The token term's slot weights: exp(-(k-1)/decay_gamma), or D-PACE. A confidence head's BCE
    # stays on the decay either way, as speculators 0.9 weighs DSpark's (models/dspark/metrics.py).
    weighting: Literal["decay", "dpace"] = "decay"
    decay_gamma: Annotated[float, POSITIVE] = 4.0  # DFlash's gamma (speculators' default)
    # D-PACE: a slot's survival is (1 - alpha) exp(-loss) + alpha
    dpace_alpha: Annotated[float, Range(0, 1)] = 0.5
    # the N most frequent tokens of the training replies; null: all
    draft_vocab_size: Annotated[int, DRAFT_VOCAB] | None = 8192
    # null: the tokenizer's mask token, else a special token absent from the data
    mask_token_id: Annotated[int, NON_NEGATIVE_INT] | None = None
    # Learn the mask slots' input row (exported as mask_embedding.pt, which vLLM 0.32 reads) instead of
    # reading the target's frozen row, which training refuses where it is near zero (never trained).
    learn_mask_embedding: bool = False
    out_of_vocab_targets: Literal["mask", "renormalise"] = "mask"  # as EAGLE-3's
    # Train the drafter's LM head (it starts as the target's rows for the draft vocabulary), or keep
    # those rows frozen, as speculators' and z-lab's trainers do: at 10 minutes on a CPU frozen took
    # 44-46% more steps and was level with speculators' trainer where trained was behind (BENCHMARKS.md).
    train_lm_head: bool = False
    objective: str | dict[str, float] = "kl_div"  # kl_div, rkl, jsd, ce, tv, nla, lk_hybrid or a mix {ce: 0.1, tv: 0.9}
    # What each slot learns: the target's distribution at its position (speculators'), or the data's
    # own next token, a hard label (SpecForge's DFlash, Domino and DSpark; meant for regenerated
    # data, where it is the target's greedy token): no target LM head, softmax or [slots, vocab]
    # distribution per step, and the objective is the cross-entropy (kl_div or ce). auto: data where
    # the target rewrites every reply greedily (data.regenerate) and nothing needs its distribution
    # (the objective, a confidence head), else target.
    labels: Literal["auto", "target", "data"] = "auto"
    features: Literal["online", "offline", "served"] = "online"  # target features: per step, on disk first, or served
    features_dir: str | None = None  # offline cache (default: under the draftsmith cache)
    # A per-position acceptance predictor (the engine's cut=priced/threshold), trained with the
    # drafter by binary cross-entropy against each slot's analytic acceptance rate (DSpark's).
    confidence_head: bool = False
    # weight of the confidence head's loss (speculators' confidence_head_alpha)
    confidence_alpha: Annotated[float, NON_NEGATIVE] = 1.0
    # A trained drafter's checkpoint: train only a confidence head for it, its other weights frozen
    # (the recipe's data and loop; the drafter's own settings are read from the checkpoint).
    confidence_for: str | None = None

    def validate(self) -> None:
        need = distribution_need(self)
        if self.labels == "data" and need:
            raise ValueError(f"{need}, which drafter.labels: data does not compute: set drafter.labels: target")
        if self.confidence_for is not None and not self.confidence_head:
            raise ValueError("drafter.confidence_for trains a confidence head: set drafter.confidence_head: true")


@dataclass
class DFlashRecipe(Recipe):
    data: DataConfig = field(default_factory=regenerated_data)
    drafter: DFlashDrafterConfig = field(default_factory=DFlashDrafterConfig)


def distribution_need(cfg: DFlashDrafterConfig) -> str | None:
    """What in ``cfg`` needs the target's distribution, which ``labels: data`` does not compute
    (None: nothing; each slot then has one token to learn, whose ``kl_div`` and ``ce`` are its
    cross-entropy)."""
    mix = parse_objective(cfg.objective)
    if not set(mix) <= set(SOFT):
        return f"drafter.objective {describe(mix)} needs the target's distribution (kl_div or ce do not)"
    if cfg.confidence_head:
        return "drafter.confidence_head learns each slot's acceptance rate against the target's distribution"
    if cfg.out_of_vocab_targets == "renormalise":
        return (
            "drafter.out_of_vocab_targets: renormalise spreads the target's distribution over the draft "
            "vocabulary (mask drops the slots whose label lies outside it)"
        )
    return None


def resolve_labels(cfg: DFlashDrafterConfig, data: DataConfig | None) -> str:
    """``cfg.labels``, with ``auto`` resolved (and said on stdout, as ``dtype: auto`` is): ``data``
    where the target rewrites every reply greedily (:func:`~draftsmith.train.unroll.greedy_replies`),
    so the data's tokens are its own choices, and nothing in the recipe needs its distribution
    (:func:`distribution_need`); else ``target``."""
    if cfg.labels != "auto":
        return cfg.labels
    chosen, why = auto_labels(cfg, data)
    print(f"drafter.labels auto -> {chosen}: {why}")
    return chosen


def auto_labels(cfg: DFlashDrafterConfig, data: DataConfig | None) -> tuple[str, str]:
    """``(labels, why)``: what ``labels: auto`` resolves to for ``cfg`` on ``data`` (:func:`resolve_labels`)."""
    need = distribution_need(cfg)
    if not greedy_replies(data):
        return "target", "not every reply is the target's greedy one (data.regenerate off, sampled or partial)"
    if need:
        return "target", need
    return "data", "the target regenerates the replies: each slot learns its token there by cross-entropy"


def sample_anchors(
    loss_mask: torch.Tensor, padding: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors, valid)`` ``[b, count]``: per row up to ``count`` distinct positions a (sorted)
    where tokens a and a + 1 are both supervised, drawn uniformly; rows with fewer fill up with
    invalid ones. In serving the anchor is always the target's bonus token, a reply token, never
    the prompt's last one: speculators 0.9.0 (models/dflash/utils.py:44-45) and SpecForge
    (core/dflash.py ``_sample_anchor_positions``) anchor only on supervised tokens, and a + 1
    supervised keeps every block's first slot scored (neither reference trains the anchor slot).

    ``generator``: a CPU generator (the same anchors on any device); None draws from the device's
    default generator, whose state the trainer's checkpoints hold, so a resumed run draws what an
    uninterrupted one would."""
    candidate = torch.zeros_like(loss_mask, dtype=torch.bool)
    supervised = loss_mask.bool() & padding.bool()
    candidate[:, :-1] = supervised[:, :-1] & supervised[:, 1:] & same_segment(padding, 1)
    if generator is None:
        scores = torch.rand(loss_mask.shape, device=loss_mask.device)
    else:
        scores = torch.rand(loss_mask.shape, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~candidate, -1.0)
    top = scores.topk(min(count, loss_mask.shape[1]), dim=-1)
    anchors, valid = top.indices, top.values >= 0
    order = anchors.masked_fill(~valid, loss_mask.shape[1]).argsort(-1)  # valid anchors first, ascending
    return anchors.gather(-1, order), valid.gather(-1, order)


def _context_rows(anchors: torch.Tensor, valid: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Boolean ``[b, A, L]``: the real context positions before each valid anchor, in its own
    conversation (``padding``: a packed batch's segment ids)."""
    context = torch.arange(padding.shape[1], device=anchors.device)[None, None, :] < anchors[:, :, None]
    own = padding[:, None, :] == padding.gather(1, anchors)[:, :, None]
    return context & own & padding.bool()[:, None, :] & valid[:, :, None]


def block_attention(anchors: torch.Tensor, valid: torch.Tensor, padding: torch.Tensor, block: int) -> torch.Tensor:
    """Boolean ``[b, 1, A * block, L + A * block]`` mask: a block's queries see the real context
    before its anchor and their own block, in both directions (an invalid anchor's block sees only itself).
    The dense layout (one drafting pass, the reference of :func:`block_sparse_attention`)."""
    batch, count = anchors.shape
    own = torch.eye(count, dtype=torch.bool, device=anchors.device)  # [A, A]: block a sees block a
    blocks = own[None, :, :, None].expand(batch, count, count, block).reshape(batch, count, count * block)
    rows = torch.cat([_context_rows(anchors, valid, padding), blocks], dim=-1)  # [b, A, L + A * block]
    return rows.repeat_interleave(block, dim=1)[:, None]


def blocks_per_group(count: int, length: int, block: int) -> int:
    """Blocks scored together by :func:`block_sparse_attention`: about ``length / 4`` queries a group,
    so a query scores at most a quarter of the context in other blocks' keys while the context keys,
    copied once per group, take at most four times the queries' room (one group, the dense layout,
    when all blocks fit)."""
    return min(count, max(1, length // (4 * block)))


def grouped_block_attention(
    anchors: torch.Tensor, valid: torch.Tensor, padding: torch.Tensor, block: int
) -> torch.Tensor:
    """Boolean ``[b * G, 1, P * block, L + P * block]``: :func:`block_attention`'s mask for each group
    of P consecutive blocks (:func:`blocks_per_group`) over the context and the group's own keys;
    blocks that pad the last group see only themselves. :func:`block_sparse_attention` reads G and P
    from its shape."""
    batch, length = padding.shape
    count = anchors.shape[1]
    per = blocks_per_group(count, length, block)
    groups = -(-count // per)
    context = F.pad(_context_rows(anchors, valid, padding), (0, 0, 0, groups * per - count))  # [b, G * P, L]
    rows = context.repeat_interleave(block, dim=1).view(batch * groups, per * block, length)
    own = torch.eye(per, dtype=torch.bool, device=anchors.device).repeat_interleave(block, 0)
    own = own.repeat_interleave(block, 1).expand(batch * groups, -1, -1)  # [b * G, P * block, P * block]
    return torch.cat([rows, own], dim=-1)[:, None]


BLOCK_SPARSE_ATTENTION = "draftsmith_dflash_blocks"


def block_sparse_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """DFlash's training attention (an ``AttentionInterface`` function, HF's calling convention).

    ``query`` ``[b, heads, A * block, d]``, the blocks' queries; ``key``/``value`` ``[b, kv_heads,
    L + A * block, d]``: the L context keys, then the blocks'. ``attention_mask`` is
    :func:`grouped_block_attention`'s ``[b * G, 1, P * block, L + P * block]``: each group of P
    blocks runs as one batch row of a fused ``scaled_dot_product_attention`` over the context and
    its own blocks' keys, so the scores between blocks of different groups are never computed; the
    result equals dense SDPA under :func:`block_attention`'s mask. Static shapes (no host syncs);
    grouped-query heads share their kv head's keys (the queries of a kv head's g heads are stacked).
    """
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    group_heads = heads // kv_heads
    rows, span = attention_mask.shape[-2:]
    groups = attention_mask.shape[0] // batch
    length = span - rows

    def by_group(x: torch.Tensor) -> torch.Tensor:  # [b, n, A * block, d] -> [b * G, n, P * block, d]
        x = F.pad(x, (0, 0, 0, groups * rows - x.shape[2]))
        return x.unflatten(2, (groups, rows)).transpose(1, 2).flatten(0, 1)

    def with_context(x: torch.Tensor) -> torch.Tensor:  # the context's keys (values) ahead of each group's
        context = x[:, None, :, :length].expand(batch, groups, -1, -1, -1).flatten(0, 1)
        return torch.cat([context, by_group(x[:, :, length:])], dim=2)

    q = by_group(query).unflatten(1, (kv_heads, group_heads)).flatten(2, 3)  # [b * G, kv, g * P * block, d]
    mask = attention_mask.repeat(1, 1, group_heads, 1) if group_heads > 1 else attention_mask
    out = F.scaled_dot_product_attention(
        q.contiguous(),
        with_context(key),
        with_context(value),
        attn_mask=mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
    )
    out = out.unflatten(2, (group_heads, rows)).flatten(1, 2)  # [b * G, heads, P * block, d]
    out = out.unflatten(0, (batch, groups)).transpose(1, 2).flatten(2, 3)[:, :, :queries]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(BLOCK_SPARSE_ATTENTION, block_sparse_attention)


def slot_weights(accept: torch.Tensor, supervised: torch.Tensor, cfg: DFlashDrafterConfig) -> torch.Tensor:
    """Weights ``[b, A, block - 1]`` of the drafted slots: DFlash's decay, or D-PACE's expected
    reach (``accept``: each slot's detached chance of drafting the target's token; unsupervised
    slots weigh 0 and pass through)."""
    slots = accept.shape[-1]
    if cfg.weighting == "decay":
        decay = torch.exp(-torch.arange(slots, device=accept.device, dtype=torch.float32) / cfg.decay_gamma)
        return decay * supervised
    survive = torch.where(supervised, (1 - cfg.dpace_alpha) * accept + cfg.dpace_alpha, 1.0)
    reach = torch.cumprod(survive, dim=-1) * supervised
    return reach.flip(-1).cumsum(-1).flip(-1) * supervised


class DFlashTask:
    """The DFlash block loss over a frozen target (the fused features and draft vocabulary of
    :mod:`draftsmith.train.fused`, as EAGLE-3's)."""

    def __init__(self, recipe: DFlashRecipe, target, head: DFlashHead):
        self.cfg = recipe.drafter
        self.target = target
        self.model = head
        self.loss_config = UnrollLoss(
            mask_out_of_vocab=self.cfg.out_of_vocab_targets == "mask", objective=parse_objective(self.cfg.objective)
        )
        data = getattr(recipe, "data", None)
        self.labels = resolve_labels(self.cfg, data)
        self.greedy_replies = greedy_replies(data)
        self.block_sparse = True  # False: dense SDPA under block_attention's mask (the reference; bench/dflash_cost.py)
        # Under hard labels kl_div and ce are both the cross-entropy: a mix weighs it by their sum.
        self.label_weight = sum(self.loss_config.objective.values())

    head_class = DFlashHead

    @classmethod
    def new_head(cls, recipe: DFlashRecipe, target, draft_vocab, tokenizer, train_set) -> DFlashHead:
        """A fresh drafter for ``target`` as ``recipe.drafter`` describes it, or with
        ``drafter.confidence_for`` that trained drafter, frozen, with a fresh confidence head."""
        drafter = recipe.drafter
        if drafter.confidence_for is not None:
            return cls.frozen_with_confidence_head(drafter, target)
        mask = mask_token_for(drafter.mask_token_id, tokenizer, train_set, len(tokenizer))
        weak = weak_mask_row(target.get_input_embeddings().weight, mask)
        if weak is not None and not drafter.learn_mask_embedding:
            raise RecipeError(
                f"drafter.mask_token_id = {mask}: the target's embedding row for it has norm {weak[0]:.3g}, "
                f"near zero beside the table's median row norm {weak[1]:.3g} (a token never trained), so every "
                f"mask slot would enter the drafter as zeros; {cls.weak_mask_advice}"
            )
        return cls.head_class.for_target(
            target,
            recipe.target.name,
            drafter.aux_layers,
            drafter.num_layers,
            drafter.block_size,
            mask,
            draft_vocab,
            drafter.learn_mask_embedding,
            confidence_head=drafter.confidence_head,
            **cls.head_options(drafter),
        )

    weak_mask_advice = (
        "set drafter.learn_mask_embedding: true (exported as mask_embedding.pt, which vLLM reads) "
        "or choose another drafter.mask_token_id"
    )

    @staticmethod
    def head_options(drafter: DFlashDrafterConfig) -> dict:
        """Constructor arguments of ``head_class`` beyond DFlash's (a subclass's)."""
        return {}

    @classmethod
    def frozen_with_confidence_head(cls, drafter: DFlashDrafterConfig, target) -> DFlashHead:
        """The drafter in ``drafter.confidence_for`` with every weight frozen and a fresh confidence
        head, the one part left to train; its blocks must be the recipe's (train with the
        checkpoint's own recipe.yaml)."""
        head = cls.head_class.from_pretrained(drafter.confidence_for, target)
        layers = resolve_aux_layers(drafter.aux_layers, target.config.num_hidden_layers)
        if (head.block_size, head.aux_layers) != (drafter.block_size, layers):
            raise RecipeError(
                f"drafter.confidence_for {drafter.confidence_for}: its drafter has block_size {head.block_size} and "
                f"aux layers {head.aux_layers}, the recipe block_size {drafter.block_size} and aux layers {layers}; "
                "train with the checkpoint's own recipe.yaml"
            )
        for param in head.parameters():
            param.requires_grad_(False)
        head.add_confidence_head()
        return head

    collate = staticmethod(pad_batch)

    def target_features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux, last)``: the fused ``aux_layers`` states (the context) and the last hidden states
        (see :func:`~draftsmith.train.fused.fused_target_features`)."""
        return fused_target_features(self.target, self.model.aux_layers, batch)

    def score(self, head, hidden: torch.Tensor, previous: torch.Tensor, supervised: torch.Tensor):
        """``(logits, confidence logits or None)`` of the scored slots where ``supervised``
        ``[b, A, S]``: ``hidden`` ``[b, A, block, h]`` holds every slot of each block (the anchor's
        first; the scored ones are the last S), ``previous`` ``[b, A, S]`` the token before each
        scored slot's label."""
        normed = self.model.norm(hidden[:, :, hidden.shape[2] - supervised.shape[2] :][supervised])
        return self.model.lm_head(normed), self.model.confidence_logits(normed)

    def scored_vocab(self) -> tuple:
        """``(to_columns, ids)``: how this step's logits are laid out, ``ids`` the token id of each
        column and ``to_columns`` mapping token ids to columns (-1: none). The drafter's draft
        vocabulary; a kind that scores fewer tokens on some steps (Domino's backbone warm-up) overrides it."""
        return self.model.to_draft_ids, self.model.draft_vocab

    def token_terms(self, head, hidden, previous, supervised, coeff, target_probs, kept) -> tuple:
        """``(per-slot loss, log-normaliser, logits, confidence logits or None)`` of the scored
        slots: :meth:`score`'s logits under the recipe's objective against the target's terms
        (``coeff``, ``target_probs``, ``kept``: :func:`~draftsmith.train.unroll.target_terms`'s). A
        kind whose loss mixes several sets of logits (Domino's backbone and corrected ones) overrides it."""
        logits, confidence = self.score(head, hidden, previous, supervised)
        ce, lse = token_loss(logits, coeff, target_probs, self.loss_config.objective, kept)
        return ce, lse, logits, confidence

    def confidence_loss(self, confidence, accept, weights, sums: dict) -> torch.Tensor:
        """The confidence head's loss as speculators 0.9 computes DSpark's (models/dspark/metrics.py,
        ``_masked_decayed_mean``): binary cross-entropy of its logits against each scored slot's
        acceptance rate ``accept`` (no gradient), times the slot's ``weights`` (DFlash's decay
        whatever ``weighting`` says: "D-PACE expects token CE, so keep the confidence BCE on fixed
        decay"), summed and divided by the number of scored slots (not by the weights' sum), times
        ``confidence_alpha``; Brier score and bias into ``sums``."""
        bce = F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")
        with torch.no_grad():
            predicted = confidence.float().sigmoid()
            sums["confidence_brier"] = ((predicted - accept) ** 2).sum()
            sums["confidence_bias"] = (predicted - accept).sum()
            sums["accept_rate"] = accept.sum()
            sums["accept_rate_sq"] = (accept**2).sum()  # with accept_rate, the rates' variance: a constant's Brier
        return self.cfg.confidence_alpha * (weights * bce).sum() / max(weights.numel(), 1)

    def loss(self, head, batch: dict, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
        aux, last = self.target_features(batch)
        model, block = self.model, self.cfg.block_size
        # DFlash's slots sit at the token they draft (shift 0); DSpark's sample_from_anchor slots draft the next (1).
        shift = model.shift
        ids, padding, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        batch_size, length = ids.shape
        # Held-out evaluations score the same blocks every time.
        generator = None if training else torch.Generator().manual_seed(0)
        anchors, valid = sample_anchors(loss_mask, padding, self.cfg.anchors_per_sequence, generator)
        count = anchors.shape[1]
        offsets = torch.arange(block, device=ids.device)
        positions = anchors[:, :, None] + offsets  # [b, A, block]: where slot k sits in the row
        # Positions within each conversation (a packed row holds several).
        context_positions = segment_positions(padding)
        block_positions = context_positions.gather(1, anchors)[:, :, None] + offsets
        tokens = torch.full_like(positions, model.mask_token_id)
        tokens[:, :, 0] = ids.gather(1, anchors)
        if self.block_sparse:
            mask, attention = grouped_block_attention(anchors, valid, padding, block), BLOCK_SPARSE_ATTENTION
        else:
            mask, attention = block_attention(anchors, valid, padding, block), "sdpa"
        with attention_implementation(model.config, attention):
            hidden = head(
                tokens.flatten(1),
                block_positions.flatten(1),
                DynamicCache(),
                mask,
                context=aux,
                context_positions=context_positions,
            ).view(batch_size, count, block, -1)
        # The scored slots (1.. for DFlash, 0.. for DSpark) draft depths 1..S: the token at `labels`,
        # scored with the target's distribution at labels - 1 (labels: data, against that token).
        labels = positions[:, :, 1 - shift :] + shift
        inside = labels < length
        clamped = labels.clamp(max=length - 1)
        supervised = (
            inside
            & valid[:, :, None]
            & (loss_mask.bool() & padding.bool()).gather(1, clamped.flatten(1)).view_as(labels)
            & (padding.gather(1, clamped.flatten(1)).view_as(labels) == padding.gather(1, anchors)[:, :, None])
        )

        def target_next() -> torch.Tensor:
            """The target's last hidden states each scored slot's token is read from (labels - 1):
            gathered only where something needs its distribution (not a data-labelled training step)."""
            rows = torch.arange(batch_size, device=ids.device)[:, None, None].expand_as(labels)[supervised]
            return last[rows, (clamped - 1)[supervised]].to(hidden.dtype)

        with torch.no_grad():
            data_next = ids.gather(1, clamped.flatten(1)).view_as(labels)[supervised]
            to_columns, columns = self.scored_vocab()
            if self.labels == "data":
                draft_ids = to_columns(data_next)
                # the hard labels in the draft vocabulary; -1 (outside it) scores nothing
                target_probs, coeff, kept = None, draft_ids, draft_ids >= 0
                # Held-out top-1 counts against the target's own argmax, whatever the labels.
                best = data_next if training else target_terms(model, target_next(), self.loss_config, False)[1]
            else:
                greedy_next = data_next if self.greedy_replies else None
                target_probs, best, coeff, kept = target_terms(
                    model, target_next(), self.loss_config, training, greedy_next
                )
                draft_ids = to_columns(best)
        previous = ids.gather(1, (clamped - 1).flatten(1)).view_as(labels)
        ce, lse, logits, confidence = self.token_terms(head, hidden, previous, supervised, coeff, target_probs, kept)
        if self.labels == "data":
            ce = ce * self.label_weight
        with torch.no_grad():
            # D-PACE's per-slot acceptance: the draft's probability of the target's token (0 where
            # the draft vocabulary lacks it), not exp(-soft cross-entropy), which entropy caps.
            chosen = logits.gather(-1, draft_ids.clamp(min=0)[:, None])[:, 0].float()
            hit = torch.where(kept, chosen - lse, -torch.inf)
            accept = torch.zeros(labels.shape, device=ids.device)
            accept[supervised] = hit.exp()
            weights = slot_weights(accept, supervised, self.cfg)[supervised]
        total = (weights * ce).sum() / kept.sum().clamp(min=1)
        depths = labels.shape[-1]
        with torch.no_grad():
            depth = (offsets[:depths] + 1).expand_as(labels)[supervised]
            # max's indices, the first maximum as argmax's: argmax over 49,152-token rows took twice as long
            hits = columns[logits.max(-1).indices] == best
            if target_probs is None:  # the hard labels' cross-entropy, where they lie in the draft vocabulary
                ce_rows = (lse - row_dot(coeff, logits)) * kept
            else:
                ce_rows = lse - row_dot(target_probs, logits)
            sums = {"tokens": supervised.sum(), "ce_loss": ce_rows.sum()}
            for d in range(1, depths + 1):
                at = depth == d
                sums[f"top1@{d}"] = (hits & at).sum()
                sums[f"rows@{d}"] = at.sum()
        if confidence is not None:
            with torch.no_grad():
                # The chance a draft sampled from q is accepted against the target's p: sum_v min(p_v, q_v).
                overlap = torch.minimum((logits.float() - lse[:, None]).exp(), target_probs).sum(-1)
                decay = slot_weights(torch.zeros_like(accept), supervised, replace(self.cfg, weighting="decay"))
            total = total + self.confidence_loss(confidence, overlap, decay[supervised], sums)
        sums["loss"] = total.detach() * sums["tokens"]
        metrics = dict(zip(sums, torch.stack([v.float() for v in sums.values()]).tolist()))
        return total, metrics

    finalise_metrics = staticmethod(depth_rates)

    def on_evaluate(self, metrics: dict[str, float]) -> None:
        record_depth_accuracy(self.model, metrics)

    def save_pretrained(self, model, path) -> None:
        model.save_pretrained(path)


build = partial(build_task, task_class=DFlashTask)
main = entry_point(DFlashRecipe, build, __doc__)


if __name__ == "__main__":
    main()
