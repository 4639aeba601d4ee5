import json
import re

import pytest

from draftsmith.assets import asset_path
from draftsmith.data_prep.sharegpt import DataError, load_conversations


def test_bundled_file_recovers_every_complete_record():
    path = asset_path("sharegpt")
    text = path.read_text(encoding="utf-8")
    # Independent count: the file is pretty-printed with records at two-space indent, and JSON
    # strings cannot hold raw newlines, so a line "  }" or "  }," closes exactly one record.
    complete = len(re.findall(r"^  },?$", text, flags=re.MULTILINE))
    opened = len(re.findall(r"^  \{$", text, flags=re.MULTILINE))
    assert opened == complete + 1  # one record is cut off
    conversations, summary = load_conversations(verbose=False)
    assert summary.records == complete == 17671
    assert summary.truncated_tail_bytes > 0
    assert summary.dropped["truncated_tail"] == 1
    assert (
        summary.kept
        == len(conversations)
        == complete - sum(n for reason, n in summary.dropped.items() if reason != "truncated_tail")
    )
    assert all(c["messages"][0]["role"] in ("user", "system") for c in conversations)


def _turn(role, value):
    return {"from": role, "value": value}


def test_bad_records_are_counted_per_reason(tmp_path, capsys):
    good = {"id": "good", "conversations": [_turn("human", "hi"), _turn("gpt", "hello")]}
    records = [
        good,
        {"id": "order", "conversations": [_turn("human", "a"), _turn("human", "b"), _turn("gpt", "c")]},
        {"id": "empty", "conversations": [_turn("human", "  "), _turn("gpt", "x")]},
        {"id": "nonstr", "conversations": [_turn("human", "a"), {"from": "gpt", "value": 3}]},
        {"id": "role", "conversations": [_turn("robot", "a"), _turn("gpt", "b")]},
        {"id": "noreply", "conversations": [_turn("human", "a")]},
        {"id": "none", "conversations": []},
        {"id": "lead", "conversations": [_turn("gpt", "cont."), _turn("human", "q"), _turn("gpt", "a")]},
    ]
    body = json.dumps(records, indent=2)
    cut = json.dumps({"id": "cut", "conversations": [_turn("human", "this record never ends")]})[:30]
    path = tmp_path / "bad.json"
    path.write_text(body[:-2] + ",\n  " + cut)  # drop the closing bracket, append a cut-off record
    conversations, summary = load_conversations(str(path))
    assert [c["id"] for c in conversations] == ["good", "lead"]
    assert conversations[1]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert dict(summary.dropped) == {
        "bad_turn_order": 1,
        "empty_turn": 1,
        "non_string_content": 1,
        "unknown_role": 1,
        "no_assistant_turn": 1,
        "empty_conversation": 1,
        "truncated_tail": 1,
    }
    assert summary.repaired["leading_assistant_turn_removed"] == 1
    assert summary.records == len(records)
    printed = capsys.readouterr().out
    assert "dropped      1 bad_turn_order (e.g. order)" in printed
    assert "file is truncated" in printed


def test_jsonl_with_messages_layout_and_a_broken_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    ok = {"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    path.write_text(json.dumps(ok) + "\n{not json}\n" + json.dumps(ok | {"id": "b"}) + "\n")
    conversations, summary = load_conversations(str(path), verbose=False)
    assert [c["id"] for c in conversations] == ["a", "b"]
    assert summary.dropped == {"malformed_json": 1}
    assert summary.examples["malformed_json"][0].startswith("line 2")


def test_corrupt_middle_record_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "corrupt.json"
    path.write_text('[\n  {"id": "a", "conversations": []},\n  {"id": oops},\n  {"id": "c"}\n]\n')
    with pytest.raises(DataError, match=r"corrupt.json: record 1 is not valid JSON at line 3"):
        load_conversations(str(path), verbose=False)
    with pytest.raises(DataError, match="does not exist"):
        load_conversations(str(path.with_name("missing.json")), verbose=False)
