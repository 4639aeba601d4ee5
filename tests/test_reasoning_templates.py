"""Loss masks and regeneration under chat templates with reasoning blocks (issue 58): Qwen3's
``<think>`` tags and gpt-oss's harmony channels (``tests/reasoning_templates.py``: the published
templates, set on the bundled tokenizer).

Both render a conversation's last assistant turn otherwise than the same turn followed by more:
Qwen3 gives the last turn a ``<think>`` block and drops the reasoning of turns before the last user
query, harmony ends the last turn with ``<|return|>`` (earlier ones ``<|end|>``) and renders the
analysis channel for it only. The loss mask must still cover exactly the assistant's tokens of the
conversation as rendered: every reply with its end-of-turn text, the reasoning where the template
keeps it, no user, system or header token; a regenerated reply's own ids, with the end-of-turn
text alone after them (not Qwen3's empty ``<think>`` block).
"""

from __future__ import annotations

import json

import pytest
from reasoning_templates import GPT_OSS, HARMONY_TOKENS, QWEN3
from test_chat_masks import masked_runs

from draftsmith.data_prep.chat import render_prompt, tokenize_conversation
from draftsmith.data_prep.regenerate import Reply, regenerate
from draftsmith.recipe import RegenerateConfig
from draftsmith.target import load_tokenizer


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("default", chat_template=QWEN3)


@pytest.fixture(scope="module")
def gpt_oss():
    tokenizer = load_tokenizer("default", chat_template=GPT_OSS)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tokenizer


QWEN3_TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nSmall sum.\n</think>\n\n2 + 2 = 4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "reasoning_content": "4 x 3.", "content": "It makes 12."},
]


def test_qwen3_masks_every_turn_as_rendered_reasoning_where_the_template_keeps_it(qwen3):
    encoded = tokenize_conversation(qwen3, QWEN3_TALK, max_length=4096)
    text = qwen3.apply_chat_template(QWEN3_TALK, tokenize=False)
    assert qwen3.decode(encoded["input_ids"]) == text
    # The first turn's reasoning is dropped by the template (before the last user query); the last keeps it.
    assert "Small sum." not in text
    assert masked_runs(qwen3, encoded) == [
        "2 + 2 = 4.<|im_end|>\n",
        "<think>\n4 x 3.\n</think>\n\nIt makes 12.<|im_end|>\n",
    ]
    one_turn = tokenize_conversation(qwen3, QWEN3_TALK[:3], max_length=4096)
    assert masked_runs(qwen3, one_turn) == ["<think>\nSmall sum.\n</think>\n\n2 + 2 = 4.<|im_end|>\n"]


GPT_OSS_TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "thinking": "Small sum.", "content": "4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "thinking": "4 x 3.", "content": "12."},
]


def test_harmony_masks_the_channels_the_assistant_writes_and_its_end_tokens(gpt_oss):
    encoded = tokenize_conversation(gpt_oss, GPT_OSS_TALK, max_length=4096)
    assert gpt_oss.decode(encoded["input_ids"]) == gpt_oss.apply_chat_template(GPT_OSS_TALK, tokenize=False)
    # After the <|start|>assistant header: an earlier turn's final channel ending <|end|> (its
    # analysis dropped by the template); the last turn's analysis, its own next header and its
    # final channel ending <|return|>, all written by the assistant.
    assert masked_runs(gpt_oss, encoded) == [
        "<|channel|>final<|message|>4.<|end|>",
        "<|channel|>analysis<|message|>4 x 3.<|end|><|start|>assistant<|channel|>final<|message|>12.<|return|>",
    ]


@pytest.mark.parametrize(
    "template, reply, closing",
    [
        ("qwen3", "<think>\nSmall sum.\n</think>\n\n2 + 2 = 4.", "<|im_end|>\n"),
        (
            "gpt_oss",
            "<|channel|>analysis<|message|>Small sum.<|end|><|start|>assistant<|channel|>final<|message|>4.",
            "<|return|>",
        ),
    ],
)
def test_a_regenerated_reply_keeps_its_ids_and_gets_the_end_of_turn_alone(request, template, reply, closing):
    tokenizer = request.getfixturevalue(template)
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": tokenizer.decode(ids), "token_ids": ids, "finished": True},
    ]
    encoded = tokenize_conversation(tokenizer, messages, max_length=4096)
    closing_ids = tokenizer(closing, add_special_tokens=False)["input_ids"]
    assert [t for t, m in zip(encoded["input_ids"], encoded["loss_mask"]) if m] == ids + closing_ids
    prompt = render_prompt(tokenizer, messages[:1])
    assert encoded["input_ids"][: len(prompt)] == prompt and not any(encoded["loss_mask"][: len(prompt)])


def regenerated_two_turns(tokenizer, talk: list[dict], replies: list[str], end: str, tmp_path) -> tuple[str, list]:
    """Regenerate ``talk``'s user turns with ``replies`` as the target's two replies; asserts that the
    stored conversation starts with the first turn's prompt and masks exactly both replies' own ids,
    each followed by ``end``. Returns the second turn's prompt as text and the stored messages."""
    prompts: list[list[int]] = []

    def generate(histories, seeds):
        prompts.extend(render_prompt(tokenizer, history) for history in histories)
        turn = sum(m["role"] == "assistant" for m in histories[0])
        return [Reply(tokenizer(replies[turn], add_special_tokens=False)["input_ids"], True) for _ in histories]

    conversations = [{"id": "a", "messages": [m for m in talk if m["role"] != "assistant"]}]
    out = tmp_path / "regenerated.jsonl"
    stats = regenerate(generate, tokenizer, conversations, out, RegenerateConfig(max_turns=None), show=False)
    assert stats["turns"] == 2
    messages = json.loads(out.read_text())["messages"]
    encoded = tokenize_conversation(tokenizer, messages, max_length=4096)
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    expected = [t for reply in replies for t in tokenizer(reply, add_special_tokens=False)["input_ids"] + end_ids]
    assert [t for t, m in zip(encoded["input_ids"], encoded["loss_mask"]) if m] == expected
    assert encoded["input_ids"][: len(prompts[0])] == prompts[0]
    return tokenizer.decode(prompts[1]), messages


def test_qwen3_regeneration_of_two_turns_prompts_as_served_and_masks_exactly_the_replies(qwen3, tmp_path):
    """The second turn's prompt renders the first reply as the template does for history (its
    reasoning dropped, as a served chat does); the stored conversation masks exactly both replies'
    own ids and their end-of-turn text."""
    replies = ["<think>\nSmall sum.\n</think>\n\n2 + 2 = 4.", "<think>\n4 x 3.\n</think>\n\nIt makes 12."]
    second, _ = regenerated_two_turns(qwen3, QWEN3_TALK, replies, "<|im_end|>\n", tmp_path)
    assert second.endswith("<|im_start|>user\nAnd times three?<|im_end|>\n<|im_start|>assistant\n")
    assert "2 + 2 = 4.<|im_end|>" in second and "Small sum." not in second


def test_harmony_regeneration_of_two_turns_prompts_as_served_and_masks_exactly_the_replies(gpt_oss, tmp_path):
    """gpt-oss's template refuses channel tags in a history message's content: the first reply goes
    back as its final channel (content) and analysis (thinking), which the template drops from
    history as a served chat does; the stored conversation masks exactly both replies' own ids, each
    followed by the end token the target wrote there (``<|return|>``: the template writes ``<|end|>``
    only when it renders a turn as history)."""
    replies = [
        "<|channel|>analysis<|message|>Small sum.<|end|><|start|>assistant<|channel|>final<|message|>4.",
        "<|channel|>analysis<|message|>4 x 3.<|end|><|start|>assistant<|channel|>final<|message|>12.",
    ]
    second, messages = regenerated_two_turns(gpt_oss, GPT_OSS_TALK, replies, "<|return|>", tmp_path)
    assert second.endswith(
        "<|start|>assistant<|channel|>final<|message|>4.<|end|>"
        "<|start|>user<|message|>And times three?<|end|><|start|>assistant"
    )
    assert "Small sum." not in second
    assert [(m["content"], m["thinking"]) for m in messages if m["role"] == "assistant"] == [
        ("4.", "Small sum."),
        ("12.", "4 x 3."),
    ]
