"""Render conversations with the target's chat template and mark the assistant tokens.

Chat templates rarely carry ``{% generation %}`` markers, so the assistant spans are found by
rendering growing prefixes of the conversation: an assistant turn starts where the prefix with
a generation prompt ends and ends where the prefix including that turn ends. That span is the
reply plus the template's end-of-turn text, which the drafter must also learn to predict.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TemplateError(ValueError):
    """A chat template whose renderings are not prefixes of each other."""


def assistant_char_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The fully rendered conversation and the ``[start, end)`` character span of each assistant turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(before) or not text.startswith(through) or len(through) <= len(before):
            raise TemplateError(
                "the chat template does not render conversations prefix-stably, so assistant "
                f"spans cannot be located (turn {i}); pass a template with {{% generation %}} markers"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int
) -> dict:
    """Token ids and a 0/1 loss mask that is 1 exactly on assistant tokens.

    Returns ``{"input_ids", "loss_mask", "num_tokens", "truncated"}``; ``num_tokens`` counts the
    tokens before truncation to ``max_length``.
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    # The template already writes the special tokens it wants (BOS included, where it has one).
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    mask = [0] * len(ids)
    span_index = 0
    for t, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start:
            mask[t] = 1
    return {
        "input_ids": ids[:max_length],
        "loss_mask": mask[:max_length],
        "num_tokens": len(ids),
        "truncated": len(ids) > max_length,
    }


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the template's generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
