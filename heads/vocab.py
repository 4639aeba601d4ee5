"""Draft vocabularies: heads that score only the N most frequent tokens through the target's LM head.

On small targets the LM head (vocab x hidden) dominates both training steps and draft steps, so
a head may carry a ``draft_vocab`` buffer of token ids and score only those rows. Tokens outside
it get ``-inf`` in full-vocabulary logits, so they are never drafted (and never wrongly accepted:
verification always uses the target's full distribution).
"""

from __future__ import annotations

import torch

from draftsmith.config import RecipeError


def token_counts(dataset, vocab_size: int = 0) -> torch.Tensor:
    """How often each token id occurs among the assistant (loss-masked) tokens of ``dataset``."""
    masked = [torch.as_tensor(row["input_ids"])[torch.as_tensor(row["loss_mask"], dtype=torch.bool)] for row in dataset]
    return torch.bincount(torch.cat(masked), minlength=vocab_size)


def most_frequent(counts: torch.Tensor, size: int, always: set[int]) -> torch.Tensor:
    """``size`` token ids, sorted: ``always`` and then the most frequent by ``counts``."""
    chosen = set(torch.argsort(counts, descending=True)[:size].tolist()) | always
    ranked = sorted(chosen, key=lambda t: (t not in always, -int(counts[t]) if t < len(counts) else 0))[:size]
    return torch.tensor(sorted(ranked))


def scatter_to_vocab(
    small: torch.Tensor, token_ids: torch.Tensor, vocab_size: int, fill: float = float("-inf")
) -> torch.Tensor:
    """fp32 full-vocabulary values from values over ``token_ids``, ``fill`` elsewhere (``-inf`` for
    logits, 0 for probabilities)."""
    small = small.float()
    full = small.new_full((*small.shape[:-1], vocab_size), fill)
    return full.index_copy_(-1, token_ids, small)


def vocab_positions(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: each token id's position in ``vocab`` (token ids, on their device), -1 where absent."""
    positions = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab.device)
    positions[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return positions


def d2t_for(draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """speculators' ``d2t`` (target id = draft id + ``d2t[draft id]``) of a draft vocabulary of
    sorted target ids (None: the full vocabulary of ``vocab_size``)."""
    vocab = draft_vocab if draft_vocab is not None else torch.arange(vocab_size)
    return vocab.long() - torch.arange(vocab.numel())


def frequent_tokens(dataset, size: int, always: set[int], vocab_size: int = 0) -> torch.Tensor:
    """``size`` token ids, sorted: ``always`` and then the most frequent assistant tokens of ``dataset``."""
    return most_frequent(token_counts(dataset, vocab_size), size, always)


def draft_vocab_for(size: int | None, dataset, tokenizer, vocab_size: int) -> torch.Tensor | None:
    """The ``size`` most frequent assistant tokens of ``dataset`` plus the tokenizer's special
    tokens (never without an end of turn), or None for the full vocabulary."""
    if not size:
        return None
    special = {i for i in tokenizer.all_special_ids if i is not None}
    return frequent_tokens(dataset, size, special, vocab_size)


def unused_token_id(tokenizer, dataset, vocab_size: int) -> int | None:
    """A token id for the mask: the tokenizer's mask token if it has one, else its highest special
    (or added special) token that is not BOS, EOS, PAD or UNK and never occurs in ``dataset``'s
    ``input_ids`` (None if there is none)."""
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for row in dataset:
        seen[torch.as_tensor(row["input_ids"])] = True
    # Added special tokens (SmolLM2's <repo_name> ... <empty_output>) are not all in all_special_ids.
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    candidates = [i for i in special if i is not None and i not in reserved and i < vocab_size and not seen[i]]
    return max(candidates) if candidates else None


def mask_token_for(given: int | None, tokenizer, dataset, vocab_size: int) -> int:
    """The mask token of a parallel drafter: ``given`` (in the vocabulary and absent from the data),
    else :func:`unused_token_id`; a one-line recipe error when it cannot be."""
    if given is None:
        given = unused_token_id(tokenizer, dataset, vocab_size)
        if given is None:
            raise RecipeError(
                "drafter.mask_token_id: the tokenizer has no mask token and every special token "
                "occurs in the data; set drafter.mask_token_id to an id the data never uses"
            )
        return int(given)
    if not 0 <= given < vocab_size:
        raise RecipeError(f"drafter.mask_token_id = {given}: give a token id in [0, {vocab_size})")
    # A mask that is also a real token makes the drafter read that token as "not yet drafted".
    used = next((i for i, row in enumerate(dataset) if given in row["input_ids"]), None)
    if used is not None:
        raise RecipeError(
            f"drafter.mask_token_id = {given}: token {given} occurs in the training data (row {used}); "
            "choose an id the data never uses, or null to pick one"
        )
    return int(given)
