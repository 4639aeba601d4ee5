import pytest

from draftsmith.data_prep.chat import tokenize_conversation
from draftsmith.data_prep.dataset import build_dataset, encode_all, is_held_out
from draftsmith.data_prep.sharegpt import DataError
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


def masked_runs(tokenizer, encoded: dict) -> list[str]:
    """The decoded runs of masked tokens of a tokenised conversation, in order."""
    runs, current = [], []
    for token, keep in zip(encoded["input_ids"], encoded["loss_mask"]):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    encoded = tokenize_conversation(tokenizer, MESSAGES, max_length=4096)
    runs = masked_runs(tokenizer, encoded)
    # Each assistant reply plus the template's end-of-turn text, nothing from the user or system.
    assert runs == ["2 + 2 = 4.<|im_end|>\n", "That makes 12, since 4 x 3 = 12.<|im_end|>\n"]
    full = tokenizer.decode(encoded["input_ids"])
    assert full == tokenizer.apply_chat_template(MESSAGES, tokenize=False)


def test_truncation_keeps_mask_aligned(tokenizer):
    full = tokenize_conversation(tokenizer, MESSAGES, max_length=4096)
    cut = tokenize_conversation(tokenizer, MESSAGES, max_length=40)
    assert cut["truncated"] and len(cut["input_ids"]) == 40 == len(cut["loss_mask"])
    assert cut["loss_mask"] == full["loss_mask"][:40]


def test_worker_processes_tokenise_exactly_as_one_process(tokenizer):
    """Large sets are tokenised by forked workers (data_prep.dataset.POOL_MIN): same rows, same order."""
    long = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "reply " * 20}]
    conversations = [MESSAGES, MESSAGES[:2], long] * 30
    alone = encode_all(tokenizer, conversations, 64, processes=1)
    assert encode_all(tokenizer, conversations, 64, processes=2) == alone
    assert {e["truncated"] for e in alone} == {False, True}  # both kinds of row cross the pipe


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


def asked(question: str, reply: str = "It depends.") -> list[dict]:
    """A one-turn conversation."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def test_a_fixed_held_out_file_is_the_held_out_split_and_its_prompts_leave_training(tokenizer, tmp_path):
    """``data.held_out_path``: its conversations are the held-out split whatever the fraction,
    training conversations with one of their prompts leave training (counted) whatever their ids or
    replies, and the file is part of the cache key."""
    import json

    held = [
        {"id": "fixed-a", "messages": MESSAGES},
        {"id": "fixed-b", "messages": asked("Why is the sky blue?", "Rayleigh scattering.")},
    ]
    # t5 is fixed-a's prompt with another reply (a regenerated copy); t6 carries fixed-b's id only.
    train = [{"id": f"t{i}", "messages": asked(f"Question {i}?")} for i in range(5)]
    train += [
        {"id": "t5", "messages": MESSAGES[:1] + asked("x", "Four.")[1:]},
        {"id": "fixed-b", "messages": asked("Hi?")},
    ]
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
    assert list(data["train"]["id"]) == [f"t{i}" for i in range(5)] + ["fixed-b"]
    assert summary.dropped == {"prompt_in_data_held_out_path": 1}
    assert data["held_out"][0]["input_ids"] == tokenize_conversation(tokenizer, MESSAGES, 2048)["input_ids"]
    # Another held-out file is another tokenised set, not the cached one.
    (tmp_path / "held.jsonl").write_text(json.dumps(held[1]) + "\n")
    again, _ = build_dataset(cfg, tokenizer, verbose=False)
    assert list(again["held_out"]["id"]) == ["fixed-b"] and len(again["train"]) == 7


def test_held_out_and_training_files_without_ids_do_not_collide(tokenizer, tmp_path):
    """Both files number their id-less records from 0: no training conversation is lost to the
    held-out file's numbers; only the one sharing a held-out prompt leaves."""
    import json

    held = [{"messages": asked(f"Held {i}?")} for i in range(3)]
    train = [{"messages": asked(f"Train {i}?")} for i in range(6)] + [{"messages": asked("Held 1?", "Other.")}]
    for name, rows in (("held.jsonl", held), ("train.jsonl", train)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        path=str(tmp_path / "train.jsonl"), held_out_path=str(tmp_path / "held.jsonl"), cache_dir=str(tmp_path / "c")
    )
    data, summary = build_dataset(cfg, tokenizer, verbose=False)
    assert len(data["train"]) == 6 and len(data["held_out"]) == 3
    assert summary.dropped == {"prompt_in_data_held_out_path": 1}
    train_text = [tokenizer.decode(ids) for ids in data["train"]["input_ids"]]
    assert all(any(f"Train {i}?" in t for t in train_text) for i in range(6))


def test_held_out_prompts_match_by_user_turns_with_a_prefix(tokenizer, tmp_path):
    """A regenerated copy keeps fewer turns: a conversation leaves training when its user turns
    start the held-out one's or the other way round (same system message); one sharing only its
    first prompt ("continue", then something else) stays, and nothing is left is one clear line."""
    import json

    def talk(*questions: str, system: str | None = None) -> dict:
        head = [{"role": "system", "content": system}] if system else []
        return {"messages": head + [m for q in questions for m in asked(q)]}

    held = [talk("continue", "and then?"), talk("Plan a trip.")]
    train = [
        talk("continue"),  # its turns start the held-out one's: a regenerated copy of it
        talk("continue", "and then?", "more"),  # extends it
        talk("continue", "something else"),  # shares the first prompt only: stays
        talk("Plan a trip.", system="Be brief."),  # another system message: stays
        talk("Plan a trip.", "To Rome."),  # extends a one-turn held-out conversation
    ]
    for name, rows in (("held.jsonl", held), ("train.jsonl", train)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        path=str(tmp_path / "train.jsonl"), held_out_path=str(tmp_path / "held.jsonl"), cache_dir=str(tmp_path / "c")
    )
    data, summary = build_dataset(cfg, tokenizer, verbose=False)
    assert list(data["train"]["id"]) == ["2", "3"] and summary.dropped == {"prompt_in_data_held_out_path": 3}
    cfg.path = cfg.held_out_path
    with pytest.raises(
        DataError, match=r"\(2 held out, 2 with prompts of data\.held_out_path, 0 .*another data\.held_out"
    ):
        build_dataset(cfg, tokenizer, verbose=False)
