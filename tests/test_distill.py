"""DistillSpec: on-policy generation, derived students,
and training on a tiny target (loss goes down, checkpoints are plain HF models, resume is exact)."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import launch, resumable_recipe, run_training, save_tiny_target
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from draftsmith.heads.draft_lm import derive_draft_lm, save_draft_lm, student_for
from draftsmith.target import load_tokenizer
from draftsmith.train.distill import DistillRecipe, DistillTask, main, prompt_response_pairs

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------------------------
# Students


def test_derived_student_with_every_layer_reproduces_the_target(make_tiny_llama):
    target = make_tiny_llama(vocab_size=64, hidden_size=32, layers=3, seed=4, scale=5.0)
    student = derive_draft_lm(target, num_layers=3)
    ids = torch.tensor([[3, 9, 27, 5, 60, 1]])
    with torch.no_grad():
        assert torch.equal(student(ids).logits, target(ids).logits)
    fewer = derive_draft_lm(target, layers=[0, 2])
    assert len(fewer.model.layers) == 2 and fewer.config.num_hidden_layers == 2
    with torch.no_grad():
        assert not torch.allclose(fewer(ids).logits, target(ids).logits)


def test_draft_lm_spec_cuts_the_same_student_as_the_recipe(make_tiny_llama):
    from draftsmith.eval.engine.drafters import build_drafter

    target = make_tiny_llama(vocab_size=64, hidden_size=32, layers=4, seed=5, scale=5.0)
    ids = torch.tensor([[3, 9, 27, 5, 60, 1]])
    with torch.no_grad():
        for spec, layers in (
            ("draft_lm?layers=0,3", [0, 3]),
            ("draft_lm?layers=1,2", [1, 2]),
            ("draft_lm?layers=3", [0, 2, 3]),
        ):
            drafted = build_drafter(spec, target).runner.model
            assert torch.equal(drafted(ids).logits, derive_draft_lm(target, layers=layers)(ids).logits), spec
    with pytest.raises(ValueError, match="layers='0,x'"):
        build_drafter("draft_lm?layers=0,x", target)


def test_loaded_student_must_share_the_vocabulary(make_tiny_llama, tmp_path):
    target = make_tiny_llama(vocab_size=64, hidden_size=32, seed=0)
    make_tiny_llama(vocab_size=80, hidden_size=32, seed=0).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 80 tokens but the target has 64"):
        student_for(target, str(tmp_path / "other"))


def test_student_trains_in_fp32_and_exports_in_the_targets_dtype(make_tiny_llama, tmp_path):
    target = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=1).to(torch.bfloat16)
    student = student_for(target, num_layers=1)
    assert {p.dtype for p in student.parameters()} == {torch.float32}
    with torch.no_grad():  # an update far below bf16's resolution of the weight must survive
        student.model.norm.weight.add_(1e-4)
    save_draft_lm(student, tmp_path / "s", dtype=torch.bfloat16)
    saved = load_file(tmp_path / "s" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert torch.equal(saved["model.norm.weight"], student.model.norm.weight.to(torch.bfloat16))
    assert student.model.norm.weight.dtype == torch.float32  # the trained model itself is left as it is
    assert torch.allclose(student.model.norm.weight, target.model.norm.weight.float() + 1e-4)


def test_prompt_response_pairs_take_the_first_assistant_span():
    rows = [
        {"id": "a", "input_ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 0, 1, 1, 0, 1, 1]},
        {"id": "b", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 0, 1]},
    ]
    pairs, too_long = prompt_response_pairs(rows, max_prompt_tokens=3)
    assert pairs == [{"id": "a", "prompt": [1, 2], "response": [3, 4]}] and too_long == 1


# ---------------------------------------------------------------------------------------------
# Training on a tiny target


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("target") / "t", load_tokenizer("default"))


@pytest.fixture(scope="module")
def recipe(target_folder, tmp_path_factory) -> Path:
    drafter = {"num_layers": 1, "max_new_tokens": 8, "max_prompt_tokens": 80, "mixture": {"fixed": 0.5, "student": 0.5}}
    data = {"limit": 10, "max_length": 96, "held_out_fraction": 0.2}
    return resumable_recipe(tmp_path_factory.mktemp("recipe"), target_folder, drafter, data, learning_rate=3e-3)


train = partial(run_training, main)


@pytest.fixture(scope="module")
def six_steps(recipe, tmp_path_factory):
    return train(recipe, tmp_path_factory.mktemp("six") / "run")


def test_on_policy_generation_follows_the_students_current_weights(target_folder):
    tokenizer = load_tokenizer(str(target_folder))
    target = LlamaForCausalLM.from_pretrained(target_folder).eval().requires_grad_(False)
    recipe = DistillRecipe()
    recipe.drafter.max_new_tokens = 12
    task = DistillTask(recipe, target, student_for(target, num_layers=1), tokenizer)
    prompts = [[1, 2, 3, 4], [5, 6]]

    def sample():
        torch.manual_seed(0)
        return task.generate(task.model, prompts)

    before = sample()
    assert before == sample()  # seeded: the same weights give the same responses
    assert all(0 < len(r) <= 12 for r in before)
    with torch.no_grad():  # what an optimiser step does: new weights in the same module
        task.model.get_output_embeddings().weight.add_(torch.randn_like(task.model.get_output_embeddings().weight))
    assert sample() != before


def test_loss_scores_each_response_token_as_the_unpadded_target_does(target_folder):
    """Left-padded prompts of different lengths, right-padded responses: a student equal to the
    target gives objective 0, acceptance 1 and the target's own NLL of every response token."""
    tokenizer = load_tokenizer(str(target_folder))
    target = LlamaForCausalLM.from_pretrained(target_folder).eval().requires_grad_(False)
    recipe = DistillRecipe()
    recipe.drafter.mixture.fixed, recipe.drafter.mixture.student = 1.0, 0.0
    task = DistillTask(recipe, target, student_for(target, num_layers=2), tokenizer)
    batch = {"ids": ["a", "b"], "prompts": [[1, 20, 300, 4000, 5], [6, 70]], "responses": [[8, 9, 10], [11, 12]]}
    _, metrics = task.loss(task.model, batch, training=True)
    nll = 0.0
    for prompt, response in zip(batch["prompts"], batch["responses"]):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(response), reduction="sum"))
    assert metrics["tokens"] == 5 and metrics["fixed/tokens"] == 5
    assert metrics["objective"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["acceptance_rate"] == pytest.approx(5.0, abs=1e-4)
    assert metrics["top1_agreement"] == 5.0
    assert metrics["nll"] == pytest.approx(nll, rel=1e-4)


def test_loss_decreases(recipe, tmp_path):
    trainer = train(
        recipe,
        tmp_path / "run",
        "--training.max_steps",
        "32",
        "--training.log_every",
        "8",
        "--training.lr_schedule",
        "constant",
        "--training.save_every",
        "0",
    )
    logs = [h for h in trainer.history if "train/loss" in h]
    losses = [h["train/loss"] for h in logs]
    assert losses[-1] < 0.7 * losses[0], losses
    for h in logs:
        assert 0.0 < h["train/acceptance_rate"] <= 1.0
        assert h["train/perplexity"] == pytest.approx(math.exp(h["train/nll"]), rel=1e-6)
        assert h["train/objective"] == pytest.approx(h["train/loss"], rel=1e-4)  # kl_div averaged over tokens
        assert 0.0 <= h["train/top1_agreement"] <= 1.0
        per_source = [
            h[f"train/{s}/acceptance_rate"] for s in ("fixed", "student") if f"train/{s}/acceptance_rate" in h
        ]
        assert per_source and all(0.0 < a <= 1.0 for a in per_source)
    evals = [h for h in trainer.history if "eval/acceptance_rate" in h]
    assert evals and 0.0 < evals[-1]["eval/acceptance_rate"] <= 1.0


def test_checkpoint_is_a_plain_hf_causal_lm(six_steps, target_folder):
    final = six_steps.last_checkpoint
    config = json.loads((final / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["model_type"] == "llama"
    assert json.loads((final / "draftsmith_target.json").read_text())["name"] == str(target_folder)
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, six_steps.task.model.eval()(ids).logits)
    assert (final / "tokenizer_config.json").is_file()
    # HF assisted generation takes it as it is.
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=loaded)
    assert torch.equal(plain, assisted)


def test_checkpoint_counts_response_tokens_for_a_reduced_draft_vocabulary(six_steps, target_folder):
    from draftsmith.eval.engine.drafters import build_drafter
    from draftsmith.heads.draft_lm import TOKEN_COUNTS

    final = six_steps.last_checkpoint
    counts = torch.tensor(json.loads((final / TOKEN_COUNTS).read_text())["counts"])
    # Nothing but the weights is a top-level *.safetensors: vLLM loads every one of them as weights.
    assert [p.name for p in final.glob("*.safetensors")] == ["model.safetensors"]
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    assert counts.numel() == target.config.vocab_size and counts.sum() > 0
    drafter = build_drafter(f"draft_lm:{final}?vocab=8&depth=2", target)
    kept = drafter.runner.lm_head.token_ids
    eos = (
        {target.config.eos_token_id} if isinstance(target.config.eos_token_id, int) else set(target.config.eos_token_id)
    )
    assert len(kept) == 8 and eos <= set(kept.tolist())
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[kept] = False
    frequent = torch.tensor([t for t in kept.tolist() if t not in eos])
    assert counts[frequent].min() >= counts[outside].max()  # the rest are the most frequent tokens
    hidden = torch.randn(3, target.config.hidden_size)
    logits = drafter.runner.logits(hidden)
    full = drafter.runner.model.get_output_embeddings()(hidden).float()
    assert torch.isneginf(logits[:, outside]).all()
    assert torch.allclose(logits[:, kept], full[:, kept], atol=1e-5)
    with pytest.raises(ValueError, match="needs a trained draft LM"):
        build_drafter("draft_lm?layers=1&vocab=8", target)


def test_resume_matches_uninterrupted(six_steps, recipe, tmp_path):
    out = tmp_path / "run"
    first = train(recipe, out, "--training.stop_after_steps", "4")
    assert first.last_checkpoint == out / "checkpoint-4"
    resumed = train(recipe, out, "--resume")
    expected = six_steps.task.model.state_dict()
    got = AutoModelForCausalLM.from_pretrained(resumed.last_checkpoint).state_dict()
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    for step in (5, 6):
        a = next(h for h in six_steps.history if h["step"] == step and "train/loss" in h)
        b = next(h for h in resumed.history if h["step"] == step and "train/loss" in h)
        assert a["train/loss"] == b["train/loss"]


def test_lora_student_exports_merged_weights(recipe, tmp_path):
    trainer = train(
        recipe, tmp_path / "run", "--drafter.finetune", "lora", "--drafter.lora_r", "4", "--training.max_steps", "2"
    )
    final = trainer.last_checkpoint
    assert not (final / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.tensor([[4, 8, 15, 16]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, trainer.task.model.eval()(ids).logits, atol=1e-5)


@pytest.mark.slow
def test_on_policy_sampling_under_zero3_when_one_process_draws_no_student_row(recipe, tmp_path):
    """ZeRO-3 shards the student: its forwards gather parameters, collectives every process must
    join, also the one that drew no student row; the sampled responses are the full student's."""
    proc = launch(
        "tests/zero3_on_policy.py",
        recipe,
        tmp_path / "out",
        "--distributed.backend",
        "deepspeed",
        "--distributed.zero_stage",
        "3",
        "--drafter.sample_temperature",
        "0",
        cpu=False,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The two ranks print concurrently: their RESULT records may share a line.
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]]
    results = {r["rank"]: r for r in records}
    assert results[0]["sources"] == ["fixed", "fixed"] and results[0]["responses"] == [[7], [8]]
    assert results[1]["sources"] == ["student", "student"]
    assert results[1]["responses"] == results[1]["expected"] and all(results[1]["expected"])
