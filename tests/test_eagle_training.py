"""EAGLE training end to end on a tiny random-weight target that shares SmolLM2's tokenizer.

In-process runs (``draftsmith.train.eagle.main``) take seconds: the loss goes down, the final
checkpoint is self-describing and reloads to identical outputs, an interrupted run resumed from
its checkpoint ends bit-identical to an uninterrupted one, loading against the wrong target fails
clearly, recipe typos fail before anything loads, a reduced draft vocabulary is honoured, and W&B
(offline without a key) records what the trainer logged. The multi-process DDP and DeepSpeed
runs are marked ``slow``.
"""

from __future__ import annotations

import json
import os
import struct
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import assert_user_error
from safetensors.torch import load_file
from training_helpers import EOS, VOCAB, check_two_replicas, launch, run_training, save_tiny_targets, write_recipe
from transformers import LlamaForCausalLM

from draftsmith.heads.common import TargetMismatchError
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.vocab import frequent_tokens
from draftsmith.target import load_tokenizer
from draftsmith.train.eagle import main

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Tiny targets and recipes


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """Folders: ``main`` (seed 0, hidden 64), ``other_seed`` (same shape), ``narrow`` (hidden 32)."""
    variants = {"main": {}, "other_seed": {"seed": 1}, "narrow": {"hidden_size": 32}}
    return save_tiny_targets(tmp_path_factory.mktemp("targets"), **variants)


@pytest.fixture(scope="module")
def recipe(targets, tmp_path_factory) -> Path:
    return write_recipe(
        tmp_path_factory.mktemp("recipe"),
        targets["main"],
        {"num_layers": 1},
        learning_rate=1e-3,
        max_steps=8,
        log_every=2,
        save_every=4,
    )


train = partial(run_training, main)


def load_target_model(folder: Path, dtype=torch.float32) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.fixture(scope="module")
def six_steps(recipe, tmp_path_factory):
    """An uninterrupted 6-step run (two epochs of the 5 training conversations), logging every step."""
    out = tmp_path_factory.mktemp("six") / "run"
    return train(recipe, out, "--training.max_steps", "6", "--training.save_every", "3", "--training.log_every", "1")


# ---------------------------------------------------------------------------------------------
# Training works


def test_loss_decreases(recipe, tmp_path):
    trainer = train(
        recipe,
        tmp_path / "run",
        "--training.max_steps",
        "20",
        "--training.learning_rate",
        "3e-3",
        "--training.lr_schedule",
        "constant",
        "--drafter.feature_noise",
        "0",
        "--training.log_every",
        "5",
        "--training.eval_every",
        "10",
        "--training.save_every",
        "0",
    )
    train_logs = [h for h in trainer.history if "train/loss" in h]
    eval_logs = [h for h in trainer.history if "eval/loss" in h]
    assert [h["step"] for h in train_logs] == [5, 10, 15, 20]
    assert [h["step"] for h in eval_logs] == [10, 20]  # no duplicate held-out eval at the end
    losses = [h["train/loss"] for h in train_logs]
    regression = [h["train/regression_loss"] for h in train_logs]
    first, last = sum(losses[:2]) / 2, sum(losses[2:]) / 2
    assert last < first - 0.05, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert regression[-1] < 0.85 * regression[0], regression
    assert eval_logs[1]["eval/loss"] < eval_logs[0]["eval/loss"] - 0.01, eval_logs
    for h in train_logs:
        assert 0.0 <= h["train/top1"] <= h["train/top3"] <= 1.0
        assert h["train/tokens_per_second"] > 0 and h["train/lr"] == pytest.approx(3e-3)
    assert trainer.last_checkpoint == tmp_path / "run" / "checkpoint-final"


def test_final_checkpoint_is_self_describing_and_reloads_identically(six_steps, targets):
    final = six_steps.last_checkpoint
    assert final.name == "checkpoint-final"
    config = json.loads((final / "config.json").read_text())
    assert config["draftsmith_kind"] == "eagle"
    assert config["num_layers"] == 1 and config["draft_vocab_size"] == VOCAB
    record = config["target"]
    assert record["name"] == str(targets["main"])
    assert record["hidden_size"] == 64 and record["vocab_size"] == VOCAB and record["model_type"] == "llama"
    assert "embedding_checksum" in record

    # Only the head: no embedding, no LM head, nothing of the target's [vocab, hidden] shape.
    tensors = load_file(str(final / "model.safetensors"))
    assert not [k for k in tensors if "embed" in k or "lm_head" in k]
    assert not [k for k, v in tensors.items() if tuple(v.shape) == (VOCAB, 64)]
    assert torch.equal(tensors["draft_vocab"], torch.arange(VOCAB))
    head = six_steps.task.model
    assert set(tensors) == set(head.state_dict())
    assert sum(v.numel() for k, v in tensors.items() if k != "draft_vocab") == sum(p.numel() for p in head.parameters())
    assert (final / "recipe.yaml").is_file() and (final / "state" / "trainer_state.json").is_file()

    target = six_steps.task.target
    loaded = EagleHead.from_pretrained(final, target).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    features = torch.randn(2, 9, 64, generator=gen)
    with torch.no_grad():
        expected = head.eval()(ids, features).last_hidden_state
        got = loaded(ids, features).last_hidden_state
        assert torch.equal(got, expected)
        assert torch.equal(loaded.logits(got), head.logits(expected))
    # Training moved the head away from its initialisation.
    fresh = EagleHead.for_target(
        target, "x", 1, init=yaml.safe_load((final / "recipe.yaml").read_text())["drafter"]["init"]
    )
    assert not torch.equal(fresh.fc.weight, loaded.fc.weight)


def test_resume_is_bit_identical(six_steps, recipe, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--training.max_steps", "6", "--training.save_every", "3", "--training.log_every", "1"]
    first = train(recipe, out, *args, "--training.stop_after_steps", "4")
    # Stopped inside the second epoch (3 steps per epoch): checkpoint-4 written at the stop, no final.
    assert first.last_checkpoint == out / "checkpoint-4"
    assert not (out / "checkpoint-final").exists()
    assert json.loads((out / "checkpoint-4" / "state" / "trainer_state.json").read_text())["batches_in_epoch"] == 1
    assert [h["step"] for h in first.history if "train/loss" in h] == [1, 2, 3, 4]
    capsys.readouterr()

    resumed = train(recipe, out, *args, "--resume")
    assert "resumed from" in capsys.readouterr().out
    assert [h["step"] for h in resumed.history if "train/loss" in h] == [5, 6]
    assert resumed.last_checkpoint == out / "checkpoint-final"

    uninterrupted = load_file(str(six_steps.last_checkpoint / "model.safetensors"))
    got = load_file(str(resumed.last_checkpoint / "model.safetensors"))
    assert set(got) == set(uninterrupted)
    for key in uninterrupted:
        assert torch.equal(got[key], uninterrupted[key]), key
    # The logged losses of the resumed steps are those of the uninterrupted run.
    for step in (5, 6):
        a = next(h for h in six_steps.history if h["step"] == step and "train/loss" in h)
        b = next(h for h in resumed.history if h["step"] == step and "train/loss" in h)
        assert a["train/loss"] == b["train/loss"] and a["train/top1"] == b["train/top1"]
    assert resumed.state.tokens == six_steps.state.tokens
    # keep_checkpoints: 2 numbered checkpoints at most
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4", "checkpoint-final"]


def test_checkpoint_refuses_another_target(six_steps, targets):
    final = six_steps.last_checkpoint
    # Same weights in bf16: accepted (the check is dtype independent).
    EagleHead.from_pretrained(final, load_target_model(targets["main"], torch.bfloat16))
    with pytest.raises(TargetMismatchError, match="embedding weights differ") as err:
        EagleHead.from_pretrained(final, load_target_model(targets["other_seed"]))
    assert str(targets["main"]) in str(err.value)
    with pytest.raises(TargetMismatchError, match=r"hidden_size: checkpoint 64 vs target 32"):
        EagleHead.from_pretrained(final, load_target_model(targets["narrow"]))
    # The eval-side loader goes through the same check.
    from draftsmith.eval.engine.drafters import build_drafter

    with pytest.raises(TargetMismatchError, match="embedding"):
        build_drafter(f"eagle:{final}?depth=3", load_target_model(targets["other_seed"]))


def test_trained_head_drafts_losslessly_for_its_target(six_steps):
    """The checkpoint through the eval registry: greedy speculative output equals plain greedy."""
    from draftsmith.data_prep.chat import render_prompt
    from draftsmith.eval.engine.decode import SpeculativeDecoder
    from draftsmith.eval.engine.drafters import build_drafter

    target = six_steps.task.target
    tokenizer = load_tokenizer(str(six_steps.recipe.target.name))
    drafter = build_drafter(f"eagle:{six_steps.last_checkpoint}?depth=3&top_k=2&budget=6", target)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Name three colours."}])
    plain = SpeculativeDecoder(target, None, tokenizer).generate(prompt, 24)
    spec = SpeculativeDecoder(target, drafter, tokenizer).generate(prompt, 24)
    assert spec.tokens == plain.tokens
    assert spec.steps <= plain.steps


def test_time_budget_runs_the_schedule_to_its_end_and_saves_the_final_head(recipe, tmp_path):
    # A budget far below one step's time: the loop stops after its first optimiser step with the
    # learning rate decayed to zero, and writes checkpoint-final as a finished run does.
    trainer = train(
        recipe,
        tmp_path / "run",
        "--training.max_steps",
        "50",
        "--training.max_minutes",
        "0.0001",
        "--training.log_every",
        "1",
    )
    assert trainer.state.step == 1 and trainer.max_steps == 50
    assert trainer.last_checkpoint.name == "checkpoint-final"
    logged = [h for h in trainer.history if "train/lr" in h]
    assert logged[-1]["step"] == 1 and logged[-1]["train/lr"] == 0.0
    state = json.loads((trainer.last_checkpoint / "state" / "trainer_state.json").read_text())
    assert state["seconds"] > 0.0


# ---------------------------------------------------------------------------------------------
# Recipe errors fail before anything loads


def test_misspelled_override_names_the_key(recipe, tmp_path, capsys):
    assert_user_error(
        capsys,
        r"unknown key drafter\.num_layer \(did you mean 'drafter\.num_layers'\?\)",
        train,
        recipe,
        tmp_path / "run",
        "--drafter.num_layer",
        "2",
    )
    assert_user_error(
        capsys,
        r"drafter\.features: expected one of 'online' \| 'offline' \| 'served', got 3",
        train,
        recipe,
        tmp_path / "run",
        "--drafter.features",
        "3",
    )
    assert_user_error(
        capsys,
        r"drafter\.num_layers: expected int, got str 'two'",
        train,
        recipe,
        tmp_path / "run",
        "--drafter.num_layers",
        "two",
    )
    assert_user_error(
        capsys,
        r"drafter\.num_layers must be an integer >= 1, got 0$",
        train,
        recipe,
        tmp_path / "run",
        "--drafter.num_layers",
        "0",
    )
    assert not (tmp_path / "run").exists()


def test_yaml_typo_names_file_and_key(recipe, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("num_layers", "num_layer"))
    assert_user_error(
        capsys, r"bad\.yaml: unknown key drafter\.num_layer \(did you mean 'drafter\.num_layers'\?\)", main, [str(bad)]
    )


# ---------------------------------------------------------------------------------------------
# Reduced draft vocabulary


def test_frequent_tokens_always_keeps_special_tokens():
    rows = [{"input_ids": [9, 5, 5, 5, 6, 6, 7, 8, 3], "loss_mask": [0, 1, 1, 1, 1, 1, 1, 1, 0]}]
    assert frequent_tokens(rows, 3, set()).tolist() == [5, 6, 7]  # by count; ties and masked ids lose
    assert frequent_tokens(rows, 4, {0, 2}).tolist() == [0, 2, 5, 6]  # never-seen special ids first
    assert {0, 2, 5, 6, 7, 8} <= set(frequent_tokens(rows, 20, {0, 2}).tolist())  # fewer seen than asked


def test_reduced_draft_vocabulary(recipe, tmp_path):
    trainer = train(
        recipe,
        tmp_path / "run",
        "--drafter.draft_vocab_size",
        "500",
        "--training.max_steps",
        "2",
        "--training.save_every",
        "0",
    )
    final = trainer.last_checkpoint
    assert json.loads((final / "config.json").read_text())["draft_vocab_size"] == 500
    vocab = load_file(str(final / "model.safetensors"))["draft_vocab"]
    assert vocab.dtype == torch.long and vocab.numel() == 500
    assert torch.all(vocab[1:] > vocab[:-1])  # sorted, unique
    assert {0, 1, EOS} <= set(vocab.tolist())  # every special id (EOS included)
    assert vocab.max() < VOCAB

    head = EagleHead.from_pretrained(final, trainer.task.target)
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        logits = head.logits(hidden)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert logits.shape == (3, VOCAB)
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, vocab]).all()
    # Inside the draft vocabulary the logits are the full LM head's.
    full = hidden @ trainer.task.target.get_output_embeddings().weight.T
    assert torch.allclose(logits[:, vocab], full[:, vocab], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# W&B offline


def wandb_history(path: Path) -> list[dict]:
    """History rows of a ``.wandb`` file (LevelDB-log framing of ``Record`` protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, payload, rows = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding
            continue
        assert kind in (1, 2, 3, 4), kind
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_offline_records_the_logged_history(recipe, tmp_path, monkeypatch):
    import netrc

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "")  # recorded, so the "offline" the trainer sets is undone
    monkeypatch.delenv("WANDB_MODE")

    def no_netrc(*args, **kwargs):
        raise FileNotFoundError("no ~/.netrc")

    monkeypatch.setattr(netrc, "netrc", no_netrc)  # no stored W&B login either
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    trainer = train(
        recipe, out, "--tracking.report_to", "wandb", "--training.max_steps", "4", "--training.save_every", "0"
    )
    assert os.environ.get("WANDB_MODE") == "offline"  # chosen automatically without a key
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    # wandb-core writes the file from its own process and may still be flushing when
    # finish() returns (seen once in a fresh-machine CI run): give it a few seconds.
    deadline = time.monotonic() + 20
    while not (history := wandb_history(files[0])) and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = {row["_step"]: row for row in history}
    logged = [h for h in trainer.history if "train/loss" in h]
    assert [h["step"] for h in logged] == [2, 4] and sorted(rows) == [2, 4]
    for h in logged:
        row = rows[h["step"]]
        for key in ("train/loss", "train/top1", "train/top3", "train/lr", "train/tokens_per_second"):
            assert row[key] == pytest.approx(h[key], rel=1e-9, abs=1e-12), key
    final_eval = next(h for h in trainer.history if "eval/loss" in h)
    assert rows[4]["eval/loss"] == pytest.approx(final_eval["eval/loss"], rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Multi-process (slow)


@pytest.mark.slow
def test_deepspeed_zero2_two_processes(recipe, targets, tmp_path):
    out = tmp_path / "ds"
    proc = launch(
        "train/eagle.py",
        recipe,
        out,
        "--training.max_steps",
        "2",
        "--distributed.backend",
        "deepspeed",
        "--distributed.zero_stage",
        "2",
        cpu=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_two_replicas(out, targets["main"], 2)
    assert (out / "checkpoint-final" / "state" / "pytorch_model").is_dir()


@pytest.mark.slow
def test_deepspeed_under_accelerate_use_cpu_fails_clearly(recipe, tmp_path):
    proc = launch(
        "train/eagle.py",
        recipe,
        tmp_path / "ds-cpu",
        "--training.max_steps",
        "2",
        "--distributed.backend",
        "deepspeed",
        cpu=True,
        timeout=200,
    )
    assert proc.returncode != 0
    assert "RuntimeError: the recipe asks for DeepSpeed but Accelerate did not enable it" in proc.stderr
    assert "ACCELERATE_USE_CPU=true drops DeepSpeed silently" in proc.stderr
    assert not (tmp_path / "ds-cpu" / "checkpoint-final").exists()
