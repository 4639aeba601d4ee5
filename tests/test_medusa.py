"""Medusa heads: zero-initialised blocks, Medusa-1 and Medusa-2 training on a tiny target, the
calibrated tree against brute force, static trees in the engine, and lossless sampling.

Greedy losslessness on the bundled SmolLM2 is in ``test_greedy_lossless.py``.
"""

from __future__ import annotations

import itertools
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stats_helpers import SAMPLES, chi_square, exact_joint
from training_helpers import VOCAB, launch, resumable_recipe, run_training, save_tiny_targets
from transformers import LlamaForCausalLM

from draftsmith.data_prep.chat import render_prompt
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.base import DraftContext
from draftsmith.eval.engine.drafters.medusa import (
    MedusaDrafter,
    expected_acceptance,
    load_choices,
    optimal_choices,
    static_tree,
)
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.tree import ROOT
from draftsmith.heads.common import TargetMismatchError
from draftsmith.heads.medusa import MedusaHeads, head_positions, rank_accuracy
from draftsmith.target import load_tokenizer
from draftsmith.train.medusa import main

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# The heads


@pytest.mark.parametrize("lm_head", ["shared", "copy"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
def test_fresh_heads_equal_the_target_lm_head(make_tiny_llama, lm_head, reduced):
    target = make_tiny_llama(vocab_size=64, hidden_size=32, seed=3, scale=5.0)
    vocab = torch.tensor([0, 1, 5, 9, 17, 40, 63]) if reduced else None
    heads = MedusaHeads.for_target(target, "tiny", num_heads=3, num_layers=2, lm_head=lm_head, draft_vocab=vocab)
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    expected = target.lm_head(hidden)
    got = heads.logits(hidden)
    assert got.shape == (3, 2, 5, 64)
    for k in range(3):
        if reduced:
            assert torch.allclose(got[k][..., vocab], expected[..., vocab], atol=1e-5)
            outside = torch.ones(64, dtype=torch.bool)
            outside[vocab] = False
            assert torch.isinf(got[k][..., outside]).all()
        else:
            assert torch.allclose(got[k], expected, atol=1e-5)
    # Selected positions give the same rows, one list entry per head.
    positions = [torch.tensor([0, 7]), torch.tensor([3]), torch.tensor([9, 1, 2])]
    picked = heads(hidden, positions)
    for k, index in enumerate(positions):
        assert torch.allclose(picked[k], heads(hidden)[k].reshape(10, -1)[index], atol=1e-6)


def test_head_positions_shift_by_k_plus_two():
    batch = {
        "input_ids": torch.tensor([[10, 11, 12, 13, 14, 15]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool),
    }
    positions, labels = head_positions(batch, 3)
    # head 0 at position i predicts token i+2: positions 0..2 carry assistant labels 12, 13, 14.
    assert positions[0].tolist() == [0, 1, 2] and labels[0].tolist() == [12, 13, 14]
    assert positions[1].tolist() == [0, 1] and labels[1].tolist() == [13, 14]
    assert positions[2].tolist() == [0] and labels[2].tolist() == [14]


# ---------------------------------------------------------------------------------------------
# Trees


def brute_force_best(rank_acc, budget):
    nodes = [c for d in range(1, len(rank_acc) + 1) for c in itertools.product(range(len(rank_acc[0])), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(nodes, budget):
        chosen = set(subset)
        if all(len(c) == 1 or c[:-1] in chosen for c in chosen):
            best = max(best, expected_acceptance(list(chosen), rank_acc))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 3, 5])
def test_calibrated_tree_is_the_brute_force_optimum(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    # Three heads, three ranks, accuracies falling with depth and rank (not strictly: seeds vary).
    top_k = (torch.rand(3, 3, generator=gen) * 0.5).cumsum(-1).clamp_max(0.95).tolist()
    rank_acc = rank_accuracy(top_k)
    choices = optimal_choices(rank_acc, budget)
    assert len(choices) == budget and load_choices([list(c) for c in choices]) == choices  # closed under parents
    assert expected_acceptance(choices, rank_acc) == pytest.approx(brute_force_best(rank_acc, budget))


def test_rank_accuracy_from_cumulative_top_k():
    assert rank_accuracy([[0.5, 0.7, 0.75]])[0] == pytest.approx([0.5, 0.2, 0.05])


def test_static_tree_shares_each_heads_ranked_guesses():
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = static_tree(choices, [[7, 8], [20, 21], [30]])
    assert tree.tokens == [7, 8, 20, 21, 20, 30]
    assert tree.parents == [ROOT, ROOT, 0, 0, 1, 2]
    assert tree.depths == [1, 1, 2, 2, 2, 3]
    assert tree.proposals[ROOT].tokens == [7, 8] and tree.proposals[1].tokens == [20]
    # Ranks beyond the candidates drawn, and levels beyond the heads given, are dropped.
    small = static_tree(choices, [[7], [20, 21]])
    assert small.tokens == [7, 20, 21]


# ---------------------------------------------------------------------------------------------
# Training on a tiny target


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    return save_tiny_targets(tmp_path_factory.mktemp("targets"), main={}, other={"seed": 1})


@pytest.fixture(scope="module")
def recipe(targets, tmp_path_factory) -> Path:
    drafter = {"num_heads": 3, "num_layers": 1}
    return resumable_recipe(tmp_path_factory.mktemp("recipe"), targets["main"], drafter, learning_rate=1e-2)


train = partial(run_training, main)


@pytest.fixture(scope="module")
def six_steps(recipe, tmp_path_factory):
    return train(recipe, tmp_path_factory.mktemp("six") / "run")


def test_medusa1_loss_decreases_and_logs_per_head_accuracy(recipe, tmp_path):
    trainer = train(
        recipe,
        tmp_path / "run",
        "--training.max_steps",
        "16",
        "--training.lr_schedule",
        "constant",
        "--training.log_every",
        "4",
        "--training.save_every",
        "0",
        "--drafter.lm_head",
        "copy",
    )
    logs = [h for h in trainer.history if "train/loss" in h]
    losses = [h["train/loss"] for h in logs]
    assert losses[-1] < 0.8 * losses[0], losses
    for h in logs:
        for k in (1, 2, 3):
            assert 0.0 <= h[f"train/head{k}/top1"] <= h[f"train/head{k}/top5"] <= 1.0
        assert "train/head1/tokens" not in h
    final = [h for h in trainer.history if "eval/loss" in h][-1]
    assert final["eval/head1/top1"] <= final["eval/head1/top10"]


def test_checkpoint_reloads_identically_and_records_accuracy(six_steps, targets):
    final = six_steps.last_checkpoint
    config = json.loads((final / "config.json").read_text())
    assert config["draftsmith_kind"] == "medusa" and config["num_heads"] == 3 and config["lm_head"] == "shared"
    assert config["target"]["name"] == str(targets["main"])
    accuracy = config["head_accuracy"]
    assert len(accuracy) == 3 and all(len(row) == 10 and row == sorted(row) for row in accuracy)
    evaluated = [h for h in six_steps.history if "eval/loss" in h][-1]
    assert accuracy[1][4] == pytest.approx(evaluated["eval/head2/top5"])
    tensors = load_file(str(final / "model.safetensors"))
    assert not [k for k, v in tensors.items() if v.shape[0] == VOCAB and v.dim() == 2]  # LM head not saved when shared

    target = six_steps.task.target
    loaded = MedusaHeads.from_pretrained(final, target)
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.logits(hidden), six_steps.task.heads.logits(hidden))
    fresh = MedusaHeads.for_target(target, "x", 3, 1)
    assert not torch.equal(fresh.blocks[0][0].linear.weight, loaded.blocks[0][0].linear.weight)
    with pytest.raises(TargetMismatchError, match="embedding weights differ"):
        MedusaHeads.from_pretrained(final, LlamaForCausalLM.from_pretrained(targets["other"]))


def test_resume_matches_uninterrupted(six_steps, recipe, tmp_path):
    out = tmp_path / "run"
    first = train(recipe, out, "--training.stop_after_steps", "4")
    assert first.last_checkpoint == out / "checkpoint-4"
    resumed = train(recipe, out, "--resume")
    assert resumed.last_checkpoint == out / "checkpoint-final"
    expected = load_file(str(six_steps.last_checkpoint / "model.safetensors"))
    got = load_file(str(resumed.last_checkpoint / "model.safetensors"))
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_trained_heads_draft_losslessly(six_steps):
    target = six_steps.task.target
    tokenizer = load_tokenizer(str(six_steps.recipe.target.name))
    drafter = build_drafter(f"medusa:{six_steps.last_checkpoint}?budget=6", target)
    assert len(drafter.choices) == 6
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Name three colours."}])
    plain = SpeculativeDecoder(target, None, tokenizer).generate(prompt, 24)
    spec = SpeculativeDecoder(target, drafter, tokenizer).generate(prompt, 24)
    assert spec.tokens == plain.tokens


def test_medusa2_trains_lora_after_the_heads_warm_up(recipe, tmp_path):
    trainer = train(
        recipe,
        tmp_path / "run",
        "--drafter.lora.enabled",
        "true",
        "--drafter.lora.start_step",
        "3",
        "--drafter.lora.r",
        "4",
        "--drafter.lora.learning_rate",
        "1e-2",
        "--training.warmup_steps",
        "0",
        "--training.lr_schedule",
        "constant",
        "--drafter.lora.dropout",
        "0",
    )
    logs = [h for h in trainer.history if "train/loss" in h]
    # The logged rate is the next step's: steps 1-3 ran at 0, later ones at the LoRA rate.
    assert [h["train/lr_lora"] for h in logs[:2]] == [0.0, 0.0]
    assert all(h["train/lr_lora"] == pytest.approx(1e-2) for h in logs[2:])
    assert all(h["train/lr"] == pytest.approx(1e-2) for h in logs)
    # The adapters stay put while the heads warm up (the tuned target equals the frozen one),
    # then move it: its KL from the frozen target becomes positive.
    assert [h["train/target/loss"] for h in logs[:3]] == [0.0, 0.0, 0.0]
    assert [h["train/target/argmax_agreement"] for h in logs[:3]] == [1.0, 1.0, 1.0]
    assert logs[-1]["train/target/loss"] > 1e-4
    assert 0.0 <= logs[-1]["train/target/argmax_agreement"] <= 1.0

    final = trainer.last_checkpoint
    assert (final / "adapter" / "adapter_config.json").is_file()
    base = LlamaForCausalLM.from_pretrained(trainer.recipe.target.name).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        original = base(input_ids=ids).logits
        weights = {name: param.data_ptr() for name, param in base.named_parameters()}
        drafter = build_drafter(f"medusa:{final}?budget=4", base)
        verifier = drafter.verifier
        # No copy of the target: the adapter is attached to its own layers and is off outside
        # the drafter's decoding, so the base target still gives the plain baseline.
        assert verifier.get_base_model() is base
        attached = {name.replace("base_layer.", ""): param.data_ptr() for name, param in base.named_parameters()}
        assert all(attached[name] == ptr for name, ptr in weights.items())
        assert torch.equal(base(input_ids=ids).logits, original)
        tuned = trainer.task.target.eval()(input_ids=ids).logits
        with drafter.verifying():  # the tuned target: same outputs as the trained LoRA model
            assert torch.allclose(verifier(input_ids=ids).logits, tuned, atol=1e-4)
        assert not torch.allclose(tuned, original, atol=1e-4)
        assert torch.equal(base(input_ids=ids).logits, original)
        # Decoding with the drafter verifies with the tuned target: its greedy output is the tuned one's.
        plain_tuned = trainer.task.target.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[
            0, 4:
        ].tolist()
        spec = SpeculativeDecoder(verifier, drafter, eos_ids=set()).generate(ids[0].tolist(), 12)
        assert spec.tokens == plain_tuned
        assert (
            SpeculativeDecoder(base, None, eos_ids=set()).generate(ids[0].tolist(), 12).tokens
            == base.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 4:].tolist()
        )


# ---------------------------------------------------------------------------------------------
# Lossless sampling through static trees (exact joint distribution vs chi-square, tiny vocab)


SAMPLING_CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def perturbed_heads(target) -> MedusaHeads:
    """Two heads whose guesses differ from ``target``'s own prediction."""
    heads = MedusaHeads.for_target(target, "tiny", num_heads=2, num_layers=1)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return heads


def test_medusa_sampling_is_lossless(make_tiny_llama):
    V, prompt, n = 8, [3, 5, 2, 7, 4], SAMPLES
    target = make_tiny_llama(vocab_size=V, hidden_size=32, layers=1, seed=0, scale=15.0)
    drafter = MedusaDrafter(perturbed_heads(target), SAMPLING_CHOICES)
    sampling = SamplingConfig(temperature=1.0)
    decoder = SpeculativeDecoder(target, drafter, None, sampling, eos_ids=set())
    counts, accepted = {}, {}
    for i in range(n):
        gen = decoder.generate(prompt, 4, seed=i)
        counts[tuple(gen.tokens)] = counts.get(tuple(gen.tokens), 0) + 1
        accepted[tuple(gen.accepted)] = accepted.get(tuple(gen.accepted), 0) + 1
    statistic, threshold, _ = chi_square(counts, exact_joint(target, prompt, 4, sampling), n)
    assert statistic < threshold
    assert accepted.get((3,), 0) > 20  # depth-2 paths were accepted, not only rejections
    tree = drafter.propose(DraftContext(prompt, sampling, torch.Generator().manual_seed(0), 4))
    assert tree.proposals[ROOT].probs is not None and len(tree.proposals[ROOT].tokens) == 2


# ---------------------------------------------------------------------------------------------
# Calibration to the device


def test_calibration_writes_the_best_tree_for_the_measured_curve(six_steps, tmp_path):
    from draftsmith.eval.calibrate_tree import main as calibrate_main

    checkpoint = six_steps.last_checkpoint
    result = calibrate_main(
        [str(checkpoint), "--dtype", "float32", "--device", "cpu", "--max-budget", "6", "--sizes", "1,2,4,8"]
    )
    curve = result["curve"]
    assert [row["budget"] for row in curve] == [1, 2, 3, 4, 5, 6]
    assert result["budget"] == max(curve, key=lambda r: r["estimated_speedup"])["budget"]
    # Expected acceptance grows with the budget; the chosen tree is the optimum for its size.
    taus = [row["expected_acceptance"] for row in curve]
    assert taus == sorted(taus) and taus[0] >= 1.0
    rank_acc = rank_accuracy(result["head_accuracy"])
    assert [list(c) for c in optimal_choices(rank_acc, result["budget"])] == result["choices"]
    assert set(result["pass_cost_ms"]) == {1, 2, 4, 8}
    # The drafter now uses the calibrated tree unless told otherwise.
    drafter = build_drafter(f"medusa:{checkpoint}", six_steps.task.target)
    assert [list(c) for c in drafter.choices] == result["choices"]
    assert len(build_drafter(f"medusa:{checkpoint}?budget=5", six_steps.task.target).choices) == 5
    (checkpoint / "tree.yaml").unlink()


# ---------------------------------------------------------------------------------------------
# Self-distillation data


def test_regeneration_is_batched_and_resumes_to_the_same_file(targets, tmp_path):
    from draftsmith.data_prep.regenerate import hf_generator, regenerate
    from draftsmith.data_prep.sharegpt import load_conversations
    from draftsmith.recipe import RegenerateConfig

    target = LlamaForCausalLM.from_pretrained(targets["main"]).eval()
    with torch.no_grad():  # at its init scale the tiny target only says newlines: make it talk
        for name, param in target.named_parameters():
            if "norm" not in name:
                param.mul_(8)
    tokenizer = load_tokenizer(str(targets["main"]))
    conversations, _ = load_conversations("sharegpt", limit=7, verbose=False)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=6, max_turns=2, batch_size=3, max_prompt_tokens=100)
    whole = tmp_path / "whole.jsonl"
    generate = hf_generator(target, tokenizer, cfg)
    stats = regenerate(generate, tokenizer, conversations, whole, cfg, show=False)
    assert stats["written"] == 5 and stats["prompt_too_long"] == 2  # prompts of 145 and 373 tokens
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert len(rows) == stats["written"]
    by_id = {c["id"]: c for c in conversations}
    # A reply that decodes to nothing (a random model may say only special tokens) ends its
    # conversation before that turn; one ended at its first turn is written empty (and counted).
    complete = [r for r in rows if r["messages"]]
    assert len(complete) >= 4 and len(rows) - len(complete) <= stats["empty"]
    for row in complete:
        original = by_id[row["id"]]["messages"]
        users = [m for m in row["messages"] if m["role"] == "user"]
        assert users == [m for m in original if m["role"] == "user"][: len(users)] and 1 <= len(users) <= 2
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert replies and not set(replies) & {m["content"] for m in original if m["role"] == "assistant"}
    assert stats["turns"] == sum(len([m for m in r["messages"] if m["role"] == "assistant"]) for r in rows)

    # Interrupted after the first batch, in the middle of writing the second: resume completes it.
    part = tmp_path / "part.jsonl"
    lines = whole.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:3]) + lines[3][:10])
    resumed = regenerate(generate, tokenizer, conversations, part, cfg, show=False)
    assert resumed["skipped"] == 3 and resumed["written"] == len(rows) - 3
    assert part.read_text() == whole.read_text()


@pytest.mark.slow
def test_medusa2_ddp_two_processes_agree(recipe, tmp_path):
    out = tmp_path / "ddp"
    proc = launch(
        "train/medusa.py",
        recipe,
        out,
        "--training.max_steps",
        "2",
        "--drafter.lora.enabled",
        "true",
        "--drafter.lora.r",
        "4",
        cpu=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = out / "checkpoint-final"
    checksums = json.loads((final / "state" / "trainer_state.json").read_text())["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    assert (final / "adapter" / "adapter_config.json").is_file()
