"""Regeneration keeps the target's own token ids, handles replies cut off at max_new_tokens, keys its
cache by everything it depends on, and writes the same data with vLLM as with Hugging Face generate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from training_helpers import EOS, save_tiny_target
from transformers import AutoModelForCausalLM

from draftsmith.data_prep.chat import tokenize_conversation
from draftsmith.data_prep.regenerate import hf_generator, regenerate, regenerated_path
from draftsmith.data_prep.regenerate import main as regenerate_main
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.recipe import DataConfig, RegenerateConfig
from draftsmith.target import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_generated_ids_are_spliced_in_exactly_with_the_end_of_turn_only_when_finished(tokenizer):
    hel, lo = tokenizer.convert_tokens_to_ids(["Hel", "lo"])
    assert tokenizer("Hello", add_special_tokens=False)["input_ids"] != [hel, lo]  # re-encoding would merge them
    user = {"role": "user", "content": "Say hello."}
    finished = [
        user,
        {"role": "assistant", "content": "Hello", "token_ids": [hel, lo], "finished": True},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Hello", "token_ids": [hel, lo, hel], "finished": False},
    ]
    row = tokenize_conversation(tokenizer, finished, 512)
    ids, mask = row["input_ids"], row["loss_mask"]
    closing = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    first = ids.index(hel)
    assert ids[first : first + 2 + len(closing)] == [hel, lo, *closing]
    assert mask[first : first + 2 + len(closing)] == [1] * (2 + len(closing)) and mask[first - 1] == 0
    # The unfinished reply ends the conversation: its ids, no end-of-turn token after them.
    assert ids[-3:] == [hel, lo, hel] and mask[-3:] == [1, 1, 1]
    # Everything that is not a reply is the template's own text, as rendering it whole gives.
    text_only = tokenize_conversation(tokenizer, [user, {"role": "assistant", "content": "Hello"}], 512)
    assert ids[:first] == text_only["input_ids"][:first]
    assert sum(mask) == 2 + len(closing) + 3


def test_replies_keep_their_ids_and_cut_off_ones_stay_open_or_are_dropped(tokenizer, tmp_path):
    target_dir = save_tiny_target(tmp_path / "target", tokenizer, scale=8.0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    conversations, _ = load_conversations("sharegpt", limit=4, verbose=False)
    cfg = RegenerateConfig(
        enabled=True, engine="hf", max_new_tokens=5, max_turns=2, batch_size=2, max_prompt_tokens=400
    )
    stats = regenerate(
        hf_generator(target, tokenizer, cfg), tokenizer, conversations, tmp_path / "keep.jsonl", cfg, show=False
    )
    rows = [json.loads(line) for line in (tmp_path / "keep.jsonl").read_text().splitlines()]
    replies = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert replies and stats["cut_off"] == len(replies) == stats["turns"]
    for row in rows:  # a cut-off first reply ends its conversation: no second turn
        assert [m["role"] for m in row["messages"] if m["role"] != "system"] in (["user", "assistant"], [])
    by_id = {c["id"]: c for c in conversations}
    for row in rows:
        if not row["messages"]:
            continue
        reply = row["messages"][-1]
        assert reply["finished"] is False and len(reply["token_ids"]) == 5 and EOS not in reply["token_ids"]
        # The ids are what greedy generate wrote for this prompt, unbatched.
        prompt = tokenizer.apply_chat_template(
            row["messages"][:-1], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"]
        alone = target.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=EOS)[0, prompt.shape[1] :]
        assert reply["token_ids"] == alone.tolist()
        assert row["messages"][0]["content"] == next(
            m["content"] for m in by_id[row["id"]]["messages"] if m["role"] == "user"
        )
    # The loader keeps the ids; the tokenised conversation ends with them, open.
    loaded, summary = load_conversations(str(tmp_path / "keep.jsonl"), verbose=False)
    assert len(loaded) == sum(bool(r["messages"]) for r in rows), summary
    tokens = tokenize_conversation(tokenizer, loaded[0]["messages"], 1024)
    assert tokens["input_ids"][-5:] == loaded[0]["messages"][-1]["token_ids"] and tokens["loss_mask"][-5:] == [1] * 5

    dropped = regenerate(
        hf_generator(target, tokenizer, cfg),
        tokenizer,
        conversations,
        tmp_path / "drop.jsonl",
        replace(cfg, on_length="drop"),
        show=False,
    )
    assert dropped["turns"] == 0 and dropped["cut_off"] == len(replies)
    assert all(not json.loads(line)["messages"] for line in (tmp_path / "drop.jsonl").read_text().splitlines())


def test_a_mix_rewrites_the_first_conversations_and_keeps_the_others_own_replies(tokenizer, tmp_path):
    """``data.regenerate.conversations: N``: the first N get the target's replies, the rest keep
    ShareGPT's own, every conversation is in the file once, and a finished file is left alone."""
    target_dir = save_tiny_target(tmp_path / "target", tokenizer, scale=8.0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    conversations, _ = load_conversations("sharegpt", limit=5, verbose=False)
    cfg = RegenerateConfig(enabled=True, engine="hf", max_new_tokens=3, batch_size=2, conversations=2)
    out = tmp_path / "mix.jsonl"
    stats = regenerate(hf_generator(target, tokenizer, cfg), tokenizer, conversations, out, cfg, show=False)
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert len(rows) == 5 and stats["kept"] == 3 and stats["written"] == 2
    for i, conversation in enumerate(conversations):
        replies = [m for m in rows[conversation["id"]]["messages"] if m["role"] == "assistant"]
        if i < 2:  # rewritten: the target's ids, one turn
            assert len(replies) == 1 and len(replies[0]["token_ids"]) == 3
        else:
            assert rows[conversation["id"]]["messages"] == conversation["messages"]
    again = regenerate(hf_generator(target, tokenizer, cfg), tokenizer, conversations, out, cfg, show=False)
    assert again["written"] == 0 and len(out.read_text().splitlines()) == 5


def test_the_cache_key_covers_engine_options_and_target_weights(tokenizer):
    data = DataConfig(limit=8, regenerate=RegenerateConfig(enabled=True, engine="hf"))
    base = regenerated_path(data, "org/model", tokenizer, [1.0, 2.0])
    assert regenerated_path(data, "org/model", tokenizer, [1.0, 2.0]) == base
    changed = [
        regenerated_path(
            replace(data, regenerate=replace(data.regenerate, **change)), "org/model", tokenizer, [1.0, 2.0]
        )
        for change in ({"engine": "vllm"}, {"on_length": "drop"}, {"temperature": 0.7}, {"top_p": 0.9}, {"seed": 1})
    ]
    changed.append(regenerated_path(data, "org/model", tokenizer, [1.0, 2.5]))  # same name, other weights
    assert len({base, *changed}) == len(changed) + 1


@pytest.mark.slow
def test_vllm_regenerates_what_hf_generate_does(tokenizer, tmp_path):
    from draftsmith.vllm_engine import why_unavailable

    if why_unavailable():
        pytest.skip(why_unavailable())
    target_dir = save_tiny_target(tmp_path / "target", tokenizer, hidden_size=128, layers=2, scale=8.0)
    common = [
        "--target",
        str(target_dir),
        "--dtype",
        "float32",
        "--limit",
        "6",
        "--max-new-tokens",
        "12",
        "--max-turns",
        "2",
        "--batch-size",
        "3",
    ]
    stats = {
        engine: regenerate_main([*common, "--engine", engine, "--out", str(tmp_path / f"{engine}.jsonl")])
        for engine in ("vllm", "hf")
    }
    assert stats["vllm"] == stats["hf"] and stats["vllm"]["turns"] > 0
    rows = {
        engine: [json.loads(line) for line in (tmp_path / f"{engine}.jsonl").read_text().splitlines()]
        for engine in ("vllm", "hf")
    }
    assert rows["vllm"] == rows["hf"]
