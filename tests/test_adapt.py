"""Adaptation rounds on captured traffic: a loss is not promoted, a win is published atomically, a kill
leaves a complete head serving, another target's traffic and NaN rounds are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from training_helpers import save_tiny_target, write_recipe

from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.rounds import Adapter, serving_head
from draftsmith.data_prep.features import FeatureDataset
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import UserError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.plugins import register_builtin
from draftsmith.target import load_target, load_tokenizer
from draftsmith.train.eagle3 import main as train_eagle3

LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A tiny EAGLE-3 head trained briefly on ShareGPT, and 10 requests served and captured."""
    register_builtin()
    root = tmp_path_factory.mktemp("adapt")
    target_dir = save_tiny_target(root / "target", load_tokenizer("default"), scale=8.0, layers=3)
    drafter = {"aux_layers": LAYERS, "ttt_steps": 2, "draft_vocab_size": 512}
    recipe = write_recipe(
        root, target_dir, drafter, data={"regenerate": {"enabled": False}}, learning_rate=3e-3, max_steps=6
    )
    head = train_eagle3([str(recipe), "--output_dir", str(root / "head"), "--training.eval_every", "0"]).last_checkpoint
    target, tokenizer = load_target(str(target_dir), "float32")
    store = TrafficStore.for_target(root / "traffic", target, tokenizer, str(target_dir), LAYERS, shard_size=4)
    decoder = SpeculativeDecoder(target, None, eos_ids=set(), capture=store)
    for i in range(10):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        decoder.generate(tokenizer(text, add_special_tokens=False)["input_ids"], 24)
    store.flush()
    return {"root": root, "head": head, "traffic": root / "traffic", "target": target_dir}


def _config(deployed, out, **fields) -> AdaptConfig:
    base = {
        "head": str(deployed["head"]),
        "traffic": str(deployed["traffic"]),
        "out_dir": str(out),
        "replay_limit": 4,
        "held_out": 3,
        "round_steps": 4,
        "batch_size": 2,
        "judge_max_new_tokens": 16,
        "judge_drafter": "depth=3&top_k=2&budget=4",
        "export_format": "none",
    }
    return AdaptConfig(**{**base, **fields})


def test_a_round_that_loses_is_not_promoted_and_one_that_wins_is(deployed, tmp_path):
    out = tmp_path / "adapt"
    first = Adapter(_config(deployed, out, margin=100.0)).run(1)[0]
    assert not first.verdict["promoted"] and "< the margin 100.0" in first.verdict["reason"]
    assert serving_head(out).parent.name == "round-0000"  # the deployed head still serves
    assert first.trained_rows == 7 and first.replay_rows == 3  # 10 requests - 3 held out; 30% replay
    assert first.verdict["requests"] == 3 and first.steps == 4
    # A margin any challenger clears: promoted, exported as the recipe says, and `current` moved.
    second = Adapter(_config(deployed, out, margin=-100.0, export_format="speculators")).run(1)[0]
    assert second.number == 2 and second.verdict["promoted"]
    assert serving_head(out) == (out / "rounds" / "round-0002" / "checkpoint").resolve()
    assert (out / "current" / "export" / "config.json").is_file()
    assert [r["number"] for r in json.loads((out / "state.json").read_text())["rounds"]] == [1, 2]
    # The promoted head is the trained challenger, not a copy of the serving one, and carries its optimiser.
    before = Eagle3Head.from_pretrained(deployed["head"]).state_dict()
    after = Eagle3Head.from_pretrained(serving_head(out)).state_dict()
    assert any((before[k] - after[k]).abs().max() > 0 for k in before if before[k].is_floating_point())
    assert (serving_head(out) / "state" / "optimizer.bin").is_file()


def test_a_nan_round_and_another_targets_traffic_are_refused(deployed, tmp_path):
    out = tmp_path / "adapt"
    nan = Adapter(_config(deployed, out, margin=-100.0, learning_rate=1e30, replay_fraction=0.0)).run(1)[0]
    assert nan.nan and not nan.verdict["promoted"] and "NaN" in nan.verdict["reason"]
    assert serving_head(out).parent.name == "round-0000"
    other_dir = save_tiny_target(tmp_path / "other", load_tokenizer("default"), seed=5, scale=8.0, layers=3)
    other, tokenizer = load_target(str(other_dir), "float32")
    TrafficStore.for_target(tmp_path / "foreign", other, tokenizer, str(deployed["target"]), LAYERS)
    with pytest.raises(UserError, match="written for target"):
        Adapter(_config(deployed, tmp_path / "x", traffic=str(tmp_path / "foreign")))


def test_replay_keeps_the_heads_general_accuracy(deployed, tmp_path):
    """A round with replay stays near the deployed head's top-1 on its own held-out data, and a
    round that forgets more than adapt.max_forgetting is not promoted."""
    cfg = _config(deployed, tmp_path / "adapt", margin=-100.0, round_steps=8, replay_limit=8, general_held_out=4)
    adapter = Adapter(cfg)
    general = adapter.general()
    assert len(general["train"]) == 5 and len(general["held_out"]) == 1  # all the tiny recipe's data
    replayed = adapter.run(1)[0]
    assert replayed.replay_rows == 3 and replayed.verdict["promoted"]
    assert abs(replayed.general_challenger[0] - replayed.general_serving[0]) <= 0.15
    strict = Adapter(_config(deployed, tmp_path / "strict", margin=-100.0, learning_rate=0.3, max_forgetting=-1.0))
    refused = strict.run(1)[0]
    assert not refused.verdict["promoted"] and "forgets" in refused.verdict["reason"]


def test_a_kill_at_any_point_leaves_a_complete_head_serving_and_the_next_run_resumes(deployed, tmp_path):
    out = tmp_path / "adapt"
    recipe = tmp_path / "adapt.yaml"
    fields = _config(deployed, out, margin=-100.0).__dict__
    recipe.write_text(yaml.safe_dump({"adapt": fields}))
    command = [sys.executable, "-m", "draftsmith.adapt.cli", str(recipe), "--rounds", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for delay in (6.0, 9.0, 12.0):
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if (out / "current").exists():  # whatever round it was in, the link names a whole head
            head = Eagle3Head.from_pretrained(serving_head(out))
            assert head.aux_layers == LAYERS
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rounds = json.loads((out / "state.json").read_text())["rounds"]
    assert [r["number"] for r in rounds] == list(range(1, len(rounds) + 1)) and len(rounds) >= 3
    assert serving_head(out).parent.name == f"round-{len(rounds):04d}"
    assert not [p for p in (out / "rounds").iterdir() if p.name.startswith(".")]  # no stage left behind


def test_eval_run_adapt_streams_the_prompts_with_the_head_learning_between_requests(deployed, tmp_path):
    from draftsmith.eval.run import main as run

    prompts = tmp_path / "stream.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write function {i} in C."}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    argv = ["--target", str(deployed["target"]), "--dtype", "float32", "--prompts", str(prompts)]
    argv += ["--drafter", f"eagle3:{deployed['head']}?depth=2&top_k=1&budget=2", "--max-new-tokens", "8"]
    run(argv + ["--adapt", "2", "--adapt-steps", "2", "--capture", str(tmp_path / "seen"), "--out", str(out)])
    stream = json.loads((out / "stream.json").read_text())
    # Rounds after requests 2 and 4 (none after the last): requests 3-4 drafted after one round, 5 after two.
    assert [r["rounds_before"] for r in stream] == [0, 0, 1, 1, 2]
    assert [r["train_seconds"] > 0 for r in stream] == [False, True, False, True, False]
    assert len(FeatureDataset(tmp_path / "seen" / "train")) == 5  # every request captured for later rounds
    assert "| 1-2 | 0 |" in (out / "stream.md").read_text()


def test_a_gateways_request_log_is_traffic_too(deployed, tmp_path):
    log = tmp_path / "gateway.jsonl"
    records = [
        {
            "request": {"model": "smol", "messages": [{"role": "user", "content": f"Add {i} and 2 in Python."}]},
            "response": {
                "model": "smol",
                "choices": [{"message": {"role": "assistant", "content": f"def f():\n    return {i} + 2"}}],
            },
        }
        for i in range(6)
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = Adapter(_config(deployed, tmp_path / "adapt", traffic=str(log))).traffic()
    assert len(rows) == 6  # in the log's order, with the target's features at the head's layers
    assert rows[5]["aux"].shape[-1] == 3 * rows[5]["hidden"].shape[-1]
    assert 0 < int(rows[5]["loss_mask"].sum()) < len(rows[5]["input_ids"])  # the reply alone is trained on
