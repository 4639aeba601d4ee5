"""Adaptation rounds on captured traffic: a loss is not promoted, a win is published atomically, a kill
leaves a complete head serving, another target's traffic and NaN rounds are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from training_helpers import save_tiny_target, write_recipe

from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.rounds import Adapter, serving_head
from draftsmith.checkpoint_files import load_torch
from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.dataset import LOSS_WEIGHT
from draftsmith.data_prep.features import FeatureDataset, hf_compute
from draftsmith.data_prep.traffic import ACCEPTED, REJECTED, SERVED_DRAFT, TrafficStore
from draftsmith.errors import UserError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.target import load_target, load_tokenizer
from draftsmith.train.checkpoints import state_dir
from draftsmith.train.eagle3 import main as train_eagle3

LAYERS = [0, 1, 2]
REQUESTS = 16
POSITIVE = "same domain"
CONTROLS = ("unrelated", "shuffled targets", "permuted targets")
# The negative controls meant to teach nothing of the judged domain's tokens (shuffled targets still do: a
# reply's tokens stay its targets). Over 50 seeds unrelated traffic was promoted twice, with real gains: the
# states of a random tiny target teach its next-token map in any domain (BENCHMARKS.md, the judge's controls).
NULLS = ("unrelated", "permuted targets")


def deploy(root: Path, seed: int = 0, requests: int = REQUESTS) -> dict:
    """A tiny EAGLE-3 head trained briefly on the target's own replies to ShareGPT prompts, and
    ``requests`` requests served and captured (``seed``: the tiny target's weights).

    Sized so that heads accept (acceptance length well above 1) and a round can beat the serving
    head: the target's weights are scaled by 5, which makes its greedy text peaked and repetitive
    (runs and recurring phrases; at 8 it is near random over the 49k tokens), and the head drafts
    over the full vocabulary (a reduced one, picked from replies, missed most served tokens: no
    head could accept them). Three draft depths trained at every position, as the judge's chain."""
    target_dir = save_tiny_target(root / "target", load_tokenizer("default"), seed=seed, scale=5.0, layers=3)
    drafter = {"aux_layers": LAYERS, "ttt_steps": 3, "draft_vocab_size": None, "down_sample_ratio": 1.0}
    data = {"regenerate": {"enabled": True, "max_new_tokens": 24}}
    recipe = write_recipe(root, target_dir, drafter, data=data, learning_rate=3e-3, max_steps=6)
    head = train_eagle3([str(recipe), "--output_dir", str(root / "head"), "--training.eval_every", "0"]).last_checkpoint
    target, tokenizer = load_target(str(target_dir), "float32")
    store = TrafficStore.for_target(root / "traffic", target, tokenizer, str(target_dir), LAYERS, shard_size=4)
    decoder = SpeculativeDecoder(target, None, eos_ids=set(), capture=store)
    for prompt in domain_prompts(tokenizer, range(requests)):
        decoder.generate(prompt, 24)
    store.flush()
    served = {"traffic": root / "traffic", "target": target_dir, "model": target, "tokenizer": tokenizer}
    return {"root": root, "head": head, "requests": requests, **served}


def domain_prompts(tokenizer, numbers) -> list[list[int]]:
    """The served domain's request prompts (token ids), one per number: :func:`deploy` serves numbers
    ``0 .. requests - 1``, and a fresh sample of the domain, never trained or judged on, takes later ones."""
    prompts = []
    for i in numbers:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    return deploy(tmp_path_factory.mktemp("adapt"))


def _config(deployed, out, **fields) -> AdaptConfig:
    base = {
        "head": str(deployed["head"]),
        "traffic": str(deployed["traffic"]),
        "out_dir": str(out),
        "replay_limit": 4,
        "held_out": 3,
        "min_held_out": 3,
        "round_steps": 4,
        "batch_size": 2,
        "judge_max_new_tokens": 16,
        "judge_drafter": "depth=3&top_k=2&budget=4",
        "export_format": "none",
    }
    return AdaptConfig(**{**base, **fields})


def test_a_round_that_loses_is_not_promoted_and_no_new_traffic_is_not_judged_again(deployed, tmp_path, capsys):
    out = tmp_path / "adapt"
    first = Adapter(_config(deployed, out, margin=100.0)).run(1)[0]
    assert not first.verdict["promoted"] and "< the margin 100.0" in first.verdict["reason"]
    assert serving_head(out).parent.name == "round-0000"  # the deployed head still serves
    assert first.trained_rows == REQUESTS - 3 and first.replay_rows == 4  # 30% replay, as much as replay_limit holds
    assert first.verdict["requests"] == 3 and first.steps == 4 and first.traffic_seen == REQUESTS
    assert first.verdict["forgetting"].startswith("general held-out top-1")  # the check ran
    # The same requests are not judged again: a second round waits for adapt.held_out new ones.
    assert Adapter(_config(deployed, out, margin=-100.0)).run(2) == []
    assert "adapt round 2 not run: 0 request(s) arrived since the last round" in capsys.readouterr().out
    assert [r["number"] for r in json.loads((out / "state.json").read_text())["rounds"]] == [1]


def test_a_round_reads_the_targets_argmax_from_its_features_not_from_served_rows(deployed, tmp_path):
    """The deployed head's recipe rewrote its replies greedily, so its own training read the target's
    next token from the data; a round trains on served traffic, whose tokens were not chosen that
    way, so its task computes the argmax."""
    from draftsmith.adapt.rounds import round_trainer

    adapter = Adapter(_config(deployed, tmp_path / "adapt"))
    head = Eagle3Head.from_pretrained(deployed["head"], adapter.target)
    trainer = round_trainer(
        adapter.kind, Path(adapter.cfg.head), adapter.cfg, adapter.target, head, [], [], tmp_path / "train"
    )
    recipe = yaml.safe_load((Path(deployed["head"]) / "recipe.yaml").read_text())
    assert recipe["data"]["regenerate"]["enabled"] and recipe["data"]["regenerate"]["temperature"] == 0
    assert trainer.task.greedy_replies is False


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


def test_a_round_judged_on_fewer_conversations_than_held_out_says_so(deployed, tmp_path, capsys):
    """Every request is new but one conversation stays to train on: 15 judged of the 16 asked, with
    adapt.min_held_out at 15 or less; by default (null: adapt.held_out) the round is not run."""
    cfg = _config(deployed, tmp_path / "adapt", held_out=REQUESTS, round_steps=1, margin=100.0, replay_fraction=0.0)
    cfg = replace(cfg, judge_max_new_tokens=4, general_held_out=0)
    assert Adapter(replace(cfg, min_held_out=None)).run(1) == []
    said = capsys.readouterr().out
    assert f"{REQUESTS - 1} held-out conversation(s)" in said and f"fewer than adapt.held_out {REQUESTS}" in said
    verdict = Adapter(cfg).run(1)[0].verdict
    assert verdict["requests"] == REQUESTS - 1 and not verdict["promoted"]
    assert f"judged on {REQUESTS - 1} held-out conversations, fewer than adapt.held_out {REQUESTS}" in verdict["reason"]


def test_replay_keeps_the_heads_general_accuracy(deployed, tmp_path):
    """A round with replay stays near the deployed head's top-1 on its own held-out data, and a
    round that forgets more than adapt.max_forgetting is not promoted."""
    out = tmp_path / "adapt"
    cfg = _config(deployed, out, margin=-100.0, round_steps=8, replay_limit=8, general_held_out=4)
    adapter = Adapter(replace(cfg, export_format="speculators"))
    general = adapter.general()
    assert len(general["train"]) == 5 and len(general["held_out"]) == 1  # all the tiny recipe's data
    replayed = adapter.run(1)[0]
    assert replayed.replay_rows == 5 and replayed.verdict["promoted"]
    assert abs(replayed.general_challenger[0] - replayed.general_serving[0]) <= 0.15
    # Promoted: published, exported as the recipe says, and `current` moved.
    assert serving_head(out) == (out / "rounds" / "round-0001" / "checkpoint").resolve()
    assert (out / "current" / "export" / "config.json").is_file()
    # The promoted head is the trained challenger, not a copy of the serving one, and carries its optimiser.
    before = Eagle3Head.from_pretrained(deployed["head"]).state_dict()
    after = Eagle3Head.from_pretrained(serving_head(out)).state_dict()
    assert any((before[k] - after[k]).abs().max() > 0 for k in before if before[k].is_floating_point())
    assert (serving_head(out) / "state" / "optimizer.bin").is_file()
    strict = Adapter(_config(deployed, tmp_path / "strict", margin=-100.0, learning_rate=0.3, max_forgetting=-1.0))
    refused = strict.run(1)[0]
    assert not refused.verdict["promoted"] and "forgets" in refused.verdict["reason"]


def test_a_kill_at_any_point_leaves_a_complete_head_serving_and_the_next_run_resumes(deployed, tmp_path):
    out = tmp_path / "adapt"
    recipe = tmp_path / "adapt.yaml"
    fields = _config(deployed, out, margin=-100.0).__dict__
    recipe.write_text(yaml.safe_dump({"adapt": fields}))
    command = [sys.executable, "-m", "draftsmith.adapt.cli", str(recipe), "--rounds", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for delay in (5.0, 8.0):
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
    assert [r["number"] for r in rounds] == [1]  # one judged round: the traffic did not grow for a second
    assert "adapt round 2 not run" in done.stdout
    assert serving_head(out).parent.name == "round-0001"
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
    # One optimiser across rounds, from the checkpoint's: round 2 continues round 1's steps and moments.
    steps = [
        {int(s["step"]) for s in load_torch(state_dir(ckpt) / "optimizer.bin")["state"].values()}
        for ckpt in (deployed["head"], *(tmp_path / "seen" / f"round-{n}" / "checkpoint-final" for n in (1, 2)))
    ]
    assert steps == [{6}, {8}, {10}]
    # Greedy by default: every captured reply is the target's own greedy one (the end of turn included).
    plain = SpeculativeDecoder(deployed["model"], None, load_tokenizer(str(deployed["target"])))
    greedy = _replies(tmp_path / "seen")
    assert [reply for _, reply in greedy] == [plain.generate(prompt, 8).tokens for prompt, _ in greedy]


def _replies(store: Path) -> list[tuple[list[int], list[int]]]:
    """``(prompt, reply)`` of every request captured in ``store``."""
    return [(ids[: mask.index(1)], ids[mask.index(1) :]) for ids, mask in FeatureDataset(store / "train").token_rows()]


def test_eval_run_adapt_samples_as_asked_reproducibly(deployed, tmp_path):
    """--temperature 1 samples the stream (not the greedy replies), and --seed makes it reproducible."""
    from draftsmith.eval.run import main as run

    prompts = tmp_path / "stream.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write function {i} in C."}) + "\n" for i in range(3)))
    argv = ["--target", str(deployed["target"]), "--dtype", "float32", "--prompts", str(prompts)]
    argv += ["--drafter", f"eagle3:{deployed['head']}?depth=2&top_k=1&budget=2", "--max-new-tokens", "8"]
    argv += ["--adapt", "2", "--adapt-steps", "0"]
    for name, extra in {"greedy": [], "a": ["--temperature", "1"], "b": ["--temperature", "1"]}.items():
        run(argv + extra + ["--seed", "3", "--capture", str(tmp_path / name), "--out", str(tmp_path / f"out-{name}")])
    assert _replies(tmp_path / "a") == _replies(tmp_path / "b") != _replies(tmp_path / "greedy")


def test_a_gateways_request_log_is_traffic_too(deployed, tmp_path, capsys):
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
    other = {
        "request": {"model": "big", "messages": records[0]["request"]["messages"]},
        "response": {**records[0]["response"], "model": "big"},
    }
    log.write_text("".join(json.dumps(r) + "\n" for r in [*records[:3], other, *records[3:]]))
    rows = Adapter(_config(deployed, tmp_path / "adapt", traffic=str(log), served_model="smol")).traffic()
    assert len(rows) == 6  # in the log's order, with the target's features at the head's layers; not big's request
    assert "other_model 'big' (expected 'smol')" in capsys.readouterr().out  # counted by reason
    assert rows[5]["aux"].shape[-1] == 3 * rows[5]["hidden"].shape[-1]
    assert 0 < int(rows[5]["loss_mask"].sum()) < len(rows[5]["input_ids"])  # the reply alone is trained on


def _chat(user: str, reply: str | None = None, history: list[dict] | None = None) -> dict:
    """One gateway-log record: ``history`` then ``user``'s turn, answered by ``reply`` (default: a reply naming it)."""
    messages = [*(history or []), {"role": "user", "content": user}]
    answer = {"role": "assistant", "content": reply or f"Here is {user.lower()}"}
    return {"request": {"messages": messages}, "response": {"choices": [{"message": answer}]}}


def test_held_out_conversations_share_nothing_with_trained_rows_and_are_judged_on_their_last_turn(deployed, tmp_path):
    """A multi-turn log: every turn of a held-out conversation leaves training (its turn-3 request
    supervises turns 1 and 2 too), the judge prompt stops before the last reply, and two users'
    identical prompts are one conversation."""
    turns = [{"role": "user", "content": "Sort a list in Go."}, {"role": "assistant", "content": "Use sort.Ints."}]
    turns += [
        {"role": "user", "content": "And in reverse?"},
        {"role": "assistant", "content": "sort.Sort(sort.Reverse)."},
    ]
    records = [
        _chat("Write hello world in C."),  # 0
        _chat(turns[0]["content"], turns[1]["content"]),  # 1: conversation A, turn 1
        _chat("Hi there."),  # 2: the same prompt as 6
        _chat("Parse JSON in Rust."),  # 3
        _chat(turns[2]["content"], turns[3]["content"], turns[:2]),  # 4: A, turn 2
        _chat("Explain a Python decorator."),  # 5
        _chat("Hi there.", "Hello! How can I help?"),  # 6
        _chat("Reverse a string in Java."),  # 7
        _chat("Now in Python?", None, turns),  # 8: A, turn 3
    ]
    log = tmp_path / "chats.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    adapter = Adapter(_config(deployed, tmp_path / "adapt", traffic=str(log), held_out=3, replay_fraction=0.0))
    data = adapter.split(1, since=0)
    assert data.split.conversations == 6 and data.split.judged == [8, 7, 6]  # A, the Java request, "Hi there."
    assert data.split.train == [0, 3, 5] and data.served == 3  # no turn of A, neither copy of "Hi there."
    rows = adapter.traffic().token_rows()
    assert data.prompts[0] == render_prompt(adapter.tokenizer, [*turns, {"role": "user", "content": "Now in Python?"}])
    assert rows[8][1].index(1) < len(data.prompts[0])  # the row supervises turn 1: a prompt cut there leaked it
    for i in data.split.train:  # no trained row starts with a held-out conversation's first prompt
        assert all(rows[i][0][: len(p)] != p for p in (rows[1][0][: rows[1][1].index(1)], data.prompts[2]))
    # A conversation begun before `since` is never judged (a serving head may have trained on its turns),
    # though its turn 3 arrived after: only the Java request is.
    later = adapter.split(2, since=7)
    assert later.split.judged == [7] and later.split.fresh == 1 and later.prompts == data.prompts[1:2]


def control_round(deployed, folder: Path, control: str, seed: int = 0):
    """One round of :func:`control_adapter`'s adapter."""
    return control_adapter(deployed, folder, control, seed).run(1)[0]


def control_adapter(deployed, folder: Path, control: str, seed: int = 0) -> Adapter:
    """The adapter of a round at the default margin and confidence, judged on the newest half of the
    requests :func:`deploy` served, whose challenger trained on the older half: as served (:data:`POSITIVE`: more of the
    judged domain, it should win), or made to teach nothing of it (:data:`CONTROLS`): ``unrelated``
    traffic (random replies, with the target's states for them), or the served requests with their
    targets (the target's last states) shuffled along each reply (``shuffled targets``) or moved to
    other tokens by a permutation of the vocabulary drawn from ``seed`` (``permuted targets``)."""
    target = deployed["model"]
    served = FeatureDataset(deployed["traffic"] / "train")
    tokenizer = load_tokenizer(str(deployed["target"]))
    store = TrafficStore.for_target(folder / "traffic", target, tokenizer, str(deployed["target"]), LAYERS)
    generator = torch.Generator().manual_seed(seed)
    compute = hf_compute(target, LAYERS)
    lm_head = target.get_output_embeddings().weight.detach()
    # Drawn for its control alone: the other controls' draws stay those of earlier runs.
    permutation = torch.randperm(lm_head.shape[0], generator=generator) if control == "permuted targets" else None
    requests = deployed["requests"]
    for i in range(requests):
        row = served[i]
        ids, start, hidden, aux = (
            row["input_ids"].tolist(),
            int(row["loss_mask"].int().argmax()),
            row["hidden"],
            row["aux"],
        )
        if i >= requests // 2 or control == "same domain":
            pass
        elif control == "unrelated":
            ids = (
                ids[:start] + torch.randint(target.config.vocab_size, (len(ids) - start,), generator=generator).tolist()
            )
            ((hidden, aux),) = compute([ids])
        elif control == "shuffled targets":
            # The last row stays last: no target reads it (a captured request's is zeros).
            reply = start + torch.randperm(len(ids) - start - 1, generator=generator)
            hidden = hidden[torch.cat([torch.arange(start), reply, torch.tensor([len(ids) - 1])])]
        else:
            # A null: the EAGLE-3 loss distils the target's distribution from its last states (through
            # the target's LM head) and reads the tokens and the fused layers as inputs only. Each
            # state becomes one along the LM-head row of the permuted token of the target's choice,
            # its top logit as far above the mean as the target's own (about as peaked), so every
            # target is a token the target did not choose, by a fixed map: the traffic's inputs and
            # structure (repeats, recurring phrases) stay, and nothing says which tokens the domain uses.
            logits = hidden[:-1] @ lm_head.T
            moved = lm_head[permutation[logits.argmax(-1)]]
            gap = logits.amax(-1, keepdim=True) - logits.mean(-1, keepdim=True)
            hidden = torch.cat([moved * gap / moved.norm(dim=-1, keepdim=True) ** 2, hidden[-1:]])
        store.add(ids, start, hidden, aux)
    store.flush()
    cfg = _config(deployed, folder / "adapt", traffic=str(folder / "traffic"), held_out=requests // 2, seed=seed)
    cfg = replace(cfg, min_held_out=requests // 2, replay_fraction=0.0, round_steps=40, learning_rate=3e-3)
    # The judge's verdict alone: the forgetting check (test_replay_keeps_the_heads_general_accuracy) would
    # otherwise veto a challenger trained without replay on its one held-out conversation of 24 tokens.
    cfg = replace(cfg, judge_drafter=AdaptConfig.judge_drafter, margin=AdaptConfig.margin, max_forgetting=None)
    return Adapter(cfg)


def test_a_challenger_trained_on_more_of_the_judged_domain_is_promoted(deployed, tmp_path):
    """The positive control (:func:`control_round`): without it, a judge that never promotes would
    pass the negative ones. Both heads accept (a judge of heads that accept nothing proves nothing)."""
    result = control_round(deployed, tmp_path, POSITIVE)
    verdict = result.verdict
    assert result.trained_rows == REQUESTS // 2 and verdict["requests"] == REQUESTS // 2 and result.steps == 40
    assert verdict["tau_serving"] > 1.3, verdict
    assert verdict["gain"] > 0.15 and verdict["low"] >= AdaptConfig.margin and verdict["promoted"], verdict
    assert serving_head(tmp_path / "adapt").parent.name == "round-0001"


def test_a_fresh_sample_of_the_domain_shares_no_request_with_a_control_rounds_trained_or_judged_ones(
    deployed, tmp_path
):
    """``bench/adapt_false_promotion.py --fresh`` checks a promotion on requests of the judged domain
    that the round neither trained nor judged on: none of them begins a trained row or a judged prompt."""
    adapter = control_adapter(deployed, tmp_path, POSITIVE)
    data = adapter.split(1, since=0)
    trained = [data.train[i]["input_ids"].tolist() for i in range(len(data.train))]
    assert len(trained) == len(data.prompts) == REQUESTS // 2
    fresh = domain_prompts(deployed["tokenizer"], range(REQUESTS, REQUESTS + 64))
    assert len({tuple(prompt) for prompt in fresh}) == 64
    for prompt in fresh:
        for seen in trained + data.prompts:
            assert seen[: len(prompt)] != prompt and prompt[: len(seen)] != seen


@pytest.mark.parametrize("control", CONTROLS)
def test_a_challenger_that_learnt_nothing_of_the_judged_traffic_is_not_promoted(deployed, tmp_path, control):
    """Negative controls (:func:`control_round`): the serving head accepts, the challenger gains
    nothing (its acceptance length falls), and the judge keeps it out."""
    result = control_round(deployed, tmp_path, control)
    verdict = result.verdict
    assert result.trained_rows == REQUESTS // 2 and verdict["requests"] == REQUESTS // 2 and result.steps == 40
    assert verdict["tau_serving"] > 1.3 and verdict["gain"] <= 0.0, verdict
    assert not verdict["promoted"] and verdict["low"] < AdaptConfig.margin, verdict
    assert serving_head(tmp_path / "adapt").parent.name == "round-0000"


def test_stores_and_round_folders_are_private_and_have_one_writer(deployed, tmp_path):
    target, tokenizer = load_target(str(deployed["target"]), "float32")
    store = TrafficStore.for_target(tmp_path / "traffic", target, tokenizer, str(deployed["target"]), LAYERS)
    assert (tmp_path / "traffic").stat().st_mode & 0o777 == 0o700
    with pytest.raises(UserError, match="traffic store .* is in use by another process"):
        TrafficStore.for_target(tmp_path / "traffic", target, tokenizer, str(deployed["target"]), LAYERS)
    store.close()  # released while the object lives: the next writer may open it
    with TrafficStore.for_target(tmp_path / "traffic", target, tokenizer, str(deployed["target"]), LAYERS):
        pass
    out = tmp_path / "adapt"
    first = Adapter(_config(deployed, out))
    first.run(0)
    assert out.stat().st_mode & 0o777 == 0o700
    with pytest.raises(UserError, match="adapt.out_dir .* is in use by another process"):
        Adapter(_config(deployed, out)).run(0)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file: give a folder"):
        Adapter(_config(deployed, tmp_path / "file")).run(0)


def test_bad_capture_and_adapt_flags_end_in_one_line(deployed, tmp_path, capsys):
    """eval/run.py refuses, in one line with exit code 2: a bound that would delete every captured
    request, a capture store at a file, and --adapt with a drafter that has no head to train."""
    from draftsmith.eval.run import main as run

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n")
    (tmp_path / "file").write_text("")
    argv = ["--target", str(deployed["target"]), "--dtype", "float32", "--prompts", str(prompts)]
    argv += ["--drafter", "prompt_lookup", "--max-new-tokens", "2", "--out", str(tmp_path / "out")]
    cases = {
        "--capture-max-gb must be > 0, got -1.0": ["--capture", str(tmp_path / "c"), "--capture-max-gb", "-1"],
        "--capture-max-days bounds the --capture store": ["--capture-max-days", "3"],
        "is a file: give a folder": ["--capture", str(tmp_path / "file")],
        "--drafter prompt_lookup has no trained head to adapt": ["--adapt", "1"],
    }
    for message, extra in cases.items():
        with pytest.raises(SystemExit) as done:
            run(argv + extra)
        err = capsys.readouterr().err.strip()
        assert done.value.code == 2 and message in err and "\n" not in err, err
    assert not (tmp_path / "c").exists()  # refused before anything was written


def test_a_store_drops_requests_older_than_its_age_bound(deployed, tmp_path, capsys):
    """Past max_age a request goes when the store writes or is opened, and a round never reads it
    even while the store sits idle (its writer open, writing nothing)."""
    target, tokenizer = load_target(str(deployed["target"]), "float32")
    store = TrafficStore.for_target(tmp_path / "t", target, tokenizer, str(deployed["target"]), LAYERS, max_age=3600)
    row = FeatureDataset(deployed["traffic"] / "train")[0]
    start = int(row["loss_mask"].int().argmax())
    for _ in range(3):
        store.add(row["input_ids"].tolist(), start, row["hidden"], row["aux"])
        store.flush()
    old = store.shards()[0]
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # written two hours ago
    store.add(row["input_ids"].tolist(), start, row["hidden"], row["aux"])
    store.flush()
    assert old not in store.shards() and len(store.shards()) == 3 and store.dropped == 1
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["dropped_conversations"] == 1
    idle = store.shards()[0]
    os.utime(idle, (time.time() - 7200, time.time() - 7200))
    adapter = Adapter(_config(deployed, tmp_path / "adapt", traffic=str(tmp_path / "t")))
    assert len(adapter.traffic()) == 2 and idle.is_file()  # not read; left for the writer to delete
    assert "1 request(s) past the store's age bound not used" in capsys.readouterr().out
    assert adapter.split(1, since=0).seen == 4  # request numbers stay those of arrival
    del store
    reopened = TrafficStore.for_target(tmp_path / "t", target, tokenizer, str(deployed["target"]), LAYERS, max_age=3600)
    assert not idle.exists() and len(reopened.shards()) == 2 and reopened.dropped == 2


def test_rejected_weights_reach_a_rounds_loss(deployed, tmp_path):
    """Issue 56 item 4 on the tiny deployed head: requests served by it are captured with where its drafts
    were rejected; a round with adapt.rejected_weight w trains its traffic rows with weight w there and 1
    elsewhere, which changes the loss and the trained head; weights of 1 are the uniform loss exactly."""
    target, tokenizer = deployed["model"], load_tokenizer(str(deployed["target"]))
    store = TrafficStore.for_target(tmp_path / "traffic", target, tokenizer, str(deployed["target"]), LAYERS)
    drafter = build_drafter(f"eagle3:{deployed['head']}?{AdaptConfig.judge_drafter}", target)
    decoder = SpeculativeDecoder(target, drafter, eos_ids=set(), capture=store)
    for i in range(8):
        decoder.generate(render_prompt(tokenizer, [{"role": "user", "content": f"Sum {i} numbers in Go."}]), 16)
    store.flush()
    served = FeatureDataset(tmp_path / "traffic" / "train").per_token(SERVED_DRAFT)
    assert sum(row.count(REJECTED) for row in served) and sum(row.count(ACCEPTED) for row in served)
    fields = {"traffic": str(tmp_path / "traffic"), "replay_fraction": 0.0, "margin": -100.0, "round_steps": 2}
    adapter = Adapter(_config(deployed, tmp_path / "w8", rejected_weight=8.0, **fields))
    data = adapter.split(1, since=0)
    rows = [data.train[i] for i in range(len(data.train))]
    for row, index in zip(rows, data.split.train):
        expected = [8.0 if outcome == REJECTED else 1.0 for outcome in served[index]]
        assert row[LOSS_WEIGHT].tolist() == expected and SERVED_DRAFT not in row
    head = adapter.kind.training.task.head_class.from_pretrained(deployed["head"], adapter.target)
    task = adapter.kind.training.task(adapter.recipe, adapter.target, head)
    batch = task.collate(rows)
    uniform_batch = {key: value for key, value in batch.items() if key != LOSS_WEIGHT}
    with torch.no_grad():
        weighted_loss = task.loss(head, batch, training=False)[0]
        uniform = task.loss(head, uniform_batch, training=False)[0]
        ones = task.loss(head, {**batch, LOSS_WEIGHT: torch.ones_like(batch[LOSS_WEIGHT])}, training=False)[0]
    assert torch.equal(ones, uniform) and not torch.allclose(weighted_loss, uniform)
    # The same round (traffic, seed, steps) trains another head under w = 8 than under w = 1.
    trained = {}
    for weight in (1.0, 8.0):
        out = tmp_path / f"round-w{weight:g}"
        assert Adapter(_config(deployed, out, rejected_weight=weight, **fields)).run(1)[0].verdict["promoted"]
        trained[weight] = Eagle3Head.from_pretrained(serving_head(out)).state_dict()
    assert any(not torch.equal(trained[1.0][k], trained[8.0][k]) for k in trained[1.0])


def test_eval_run_capture_records_the_served_heads_generations_and_drafts(deployed, tmp_path):
    """eval/run.py --capture keeps the generations of the first --drafter that reads the store's layers
    (the served head), with its draft outcomes; greedy, they are plain decoding's tokens."""
    from draftsmith.eval.run import main as run

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write function {i} in C."}) + "\n" for i in range(3)))
    argv = ["--target", str(deployed["target"]), "--dtype", "float32", "--prompts", str(prompts), "--max-new-tokens"]
    argv += ["12", "--drafter", "prompt_lookup", "--drafter", f"eagle3:{deployed['head']}?{AdaptConfig.judge_drafter}"]
    run(argv + ["--capture", str(tmp_path / "c"), "--out", str(tmp_path / "out")])
    store = FeatureDataset(tmp_path / "c" / "train")
    outcomes = store.per_token(SERVED_DRAFT)
    assert len(store) == 3 and REJECTED in outcomes[0] + outcomes[1] + outcomes[2]
    # The head's outcomes, not prompt lookup's: the same requests served by the head alone record the same.
    target, tokenizer = deployed["model"], load_tokenizer(str(deployed["target"]))
    alone = TrafficStore.for_target(tmp_path / "alone", target, tokenizer, str(deployed["target"]), LAYERS)
    head = build_drafter(f"eagle3:{deployed['head']}?{AdaptConfig.judge_drafter}", target)
    served = SpeculativeDecoder(target, head, tokenizer, capture=alone)
    for prompt, _ in _replies(tmp_path / "c"):
        served.generate(prompt, 12)
    alone.flush()
    assert FeatureDataset(tmp_path / "alone" / "train").per_token(SERVED_DRAFT) == outcomes
    plain = SpeculativeDecoder(target, None, tokenizer)  # greedy: the plain replies
    assert [reply for _, reply in _replies(tmp_path / "c")] == [
        plain.generate(p, 12).tokens for p, _ in _replies(tmp_path / "c")
    ]
