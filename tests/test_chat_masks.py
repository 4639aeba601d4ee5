import pytest

from draftsmith.data_prep.chat import tokenize_conversation
from draftsmith.data_prep.dataset import build_dataset, is_held_out
from draftsmith.recipe import DataConfig
from draftsmith.target import load_tokenizer

MESSAGES = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "That makes 12, since 4 x 3 = 12."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _masked_runs(ids, mask):
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    encoded = tokenize_conversation(tokenizer, MESSAGES, max_length=4096)
    runs = [tokenizer.decode(run) for run in _masked_runs(encoded["input_ids"], encoded["loss_mask"])]
    # Each assistant reply plus the template's end-of-turn text, nothing from the user or system.
    assert runs == ["2 + 2 = 4.<|im_end|>\n", "That makes 12, since 4 x 3 = 12.<|im_end|>\n"]
    full = tokenizer.decode(encoded["input_ids"])
    assert full == tokenizer.apply_chat_template(MESSAGES, tokenize=False)


def test_truncation_keeps_mask_aligned(tokenizer):
    full = tokenize_conversation(tokenizer, MESSAGES, max_length=4096)
    cut = tokenize_conversation(tokenizer, MESSAGES, max_length=40)
    assert cut["truncated"] and len(cut["input_ids"]) == 40 == len(cut["loss_mask"])
    assert cut["loss_mask"] == full["loss_mask"][:40]


def test_tokenised_set_is_split_deterministically_and_cached(tokenizer, tmp_path, capsys):
    cfg = DataConfig(limit=40, max_length=256, held_out_fraction=0.25, cache_dir=str(tmp_path))
    first, summary = build_dataset(cfg, tokenizer)
    assert "17671 records read" not in capsys.readouterr().out  # the limit stops reading early
    second, cached = build_dataset(cfg, tokenizer)
    assert "loaded cached tokenised set" in capsys.readouterr().out
    assert cached == summary
    total = summary.conversations["train"] + summary.conversations["held_out"]
    assert total + sum(summary.dropped.values()) == 40
    held_ids = set(first["held_out"]["id"])
    all_ids = list(first["held_out"]["id"]) + list(first["train"]["id"])
    assert held_ids and held_ids == {i for i in all_ids if is_held_out(i, 0.25)}
    assert first["train"][0]["input_ids"] == second["train"][0]["input_ids"]
    row = first["train"][0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) <= 256
    assert summary.tokens["train"] == sum(len(x) for x in first["train"]["input_ids"])


def test_a_fixed_held_out_file_is_the_held_out_split_and_leaves_training(tokenizer, tmp_path):
    """``data.held_out_path``: its conversations are the held-out split whatever the fraction, those
    also in ``data.path`` leave training (counted), and the file is part of the cache key."""
    import json

    held = [
        {"id": "fixed-a", "messages": MESSAGES},
        {"id": "fixed-b", "messages": MESSAGES[:2]},
    ]
    train = [{"id": f"t{i}", "messages": MESSAGES} for i in range(5)] + [{"id": "fixed-a", "messages": MESSAGES}]
    for name, rows in (("held.jsonl", held), ("train.jsonl", train)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        path=str(tmp_path / "train.jsonl"),
        held_out_path=str(tmp_path / "held.jsonl"),
        held_out_fraction=0.5,
        cache_dir=str(tmp_path / "cache"),
    )
    data, summary = build_dataset(cfg, tokenizer, verbose=False)
    assert list(data["held_out"]["id"]) == ["fixed-a", "fixed-b"]
    assert list(data["train"]["id"]) == [f"t{i}" for i in range(5)]
    assert summary.dropped == {"in_data_held_out_path": 1}
    assert data["held_out"][1]["input_ids"] == tokenize_conversation(tokenizer, MESSAGES[:2], 2048)["input_ids"]
    # Another held-out file is another tokenised set, not the cached one.
    (tmp_path / "held.jsonl").write_text(json.dumps(held[1]) + "\n")
    again, _ = build_dataset(cfg, tokenizer, verbose=False)
    assert list(again["held_out"]["id"]) == ["fixed-b"] and len(again["train"]) == 6
