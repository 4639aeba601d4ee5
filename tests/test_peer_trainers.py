"""bench/peer_trainers.py: speculators' own trainer against draftsmith's.

- Fast: the settings it hands speculators' trainer parse in speculators' own schema and carry the
  recipe's values (learning rate, optimiser, warm-up, vocabulary, layers, TTT steps, P-EAGLE's depths and
  chain sampling, block size, DSpark's Markov and confidence heads, anchors per step, loss weighting,
  bidirectional block attention, mask token).
- Slow: a tiny end-to-end run (EAGLE-3, P-EAGLE and DSpark on a tiny target, a few seconds of training
  each): both trainers' heads load in speculators' model class, are scored on the same held-out rows and
  served on the same prompts (by vLLM; DSpark, which vLLM's CPU build does not serve, by draftsmith's
  engine, speculators' own folder given our record), and the paired interval brackets the difference.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_helpers import save_tiny_target

from draftsmith.target import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("peer_trainers", ROOT / "bench" / "peer_trainers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "dspark"])
def test_speculators_settings_carry_the_recipes_values(kind, tmp_path):
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (the speculators extra)")
    from speculators.train.config import TrainConfig

    bench = _bench()
    recipe = bench.recipe_for(kind, ["--target.dtype", "float32"])
    recipe.drafter.aux_layers = [2, 15, 27]
    if kind != "eagle3":
        recipe.drafter.mask_token_id = 16
    data = {"train": [{"input_ids": list(range(100))}, {"input_ids": list(range(300))}]}
    vocab = (tmp_path / "d2t.npy", tmp_path / "t2d.npy", 8192)
    args = bench.speculators_args(kind, recipe, "/target", tmp_path, tmp_path / "save", vocab, 0.9, data)
    cfg = TrainConfig.resolve(args)
    flat = cfg.flatten()
    t = recipe.training
    assert flat["speculator_type"] == kind
    assert (flat["lr"], flat["optimizer"], flat["weight_decay"]) == (t.learning_rate, "adamw", t.weight_decay)
    assert flat["scheduler_warmup_steps"] == t.warmup_steps and flat["seed"] == t.seed
    assert flat["target_layer_ids"] == [2, 15, 27] and flat["draft_vocab_size"] == 8192
    assert flat["draft_attn_impl"] == "sdpa" and flat["num_workers"] == 0 and flat["hidden_states_dtype"] == "float32"
    assert flat["total_seq_len"] == max(300, t.batch_size * 200)  # batch_size rows of the mean length
    assert flat["num_layers"] == recipe.drafter.num_layers
    if kind == "eagle3":
        assert (flat["ttt_steps"], flat["ttt_step_loss_decay"]) == (7, 0.8)
    if kind in ("eagle3", "peagle"):
        assert flat["norm_before_residual"] is recipe.drafter.norm_before_residual
    if kind == "peagle":
        d = recipe.drafter
        assert flat["num_depths"] == d.ttt_steps == 7  # speculators' depth 0 is our first pass
        assert (flat["down_sample_ratio"], flat["down_sample_ratio_min"]) == (0.7, 0.2)
        assert flat["max_anchors"] == flat["total_seq_len"]  # every supervised position seeds a chain, as ours
        assert flat["mask_token_id"] == 16 and flat["embed_requires_grad"] is True
        assert flat["loss_fn"] == "kl_div"
    if kind in ("dflash", "dspark"):
        d = recipe.drafter
        assert (flat["block_size"], flat["max_anchors"]) == (d.block_size, d.anchors_per_sequence * t.batch_size)
        assert (flat["loss_fn"], flat["per_position_loss_weight"]) == ("kl_div", "fixed-exp-decay")
        assert flat["dflash_decay_gamma"] == d.decay_gamma and flat["mask_token_id"] == 16
        assert flat["full_attention_indices"] == list(range(d.num_layers)) and flat["sliding_window_non_causal"]
    if kind == "dspark":
        assert flat["block_size"] == 7 and flat["sample_from_anchor"] is True  # the recipe's, not speculators' 8
        assert (flat["markov_rank"], flat["markov_head_type"]) == (d.markov_rank, d.markov_head_type)
        assert flat["enable_confidence_head"] is d.confidence_head is True
        assert flat["confidence_head_with_markov"] is d.confidence_head_with_markov
        assert flat["confidence_head_alpha"] == d.confidence_alpha


@pytest.mark.slow
def test_both_heads_are_trained_loaded_and_scored_on_the_same_prompts(tmp_path):
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (the speculators extra)")
    from draftsmith.vllm_engine import why_unavailable

    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    # A tiny target (head size 32, which vLLM's CPU attention takes; 7 layers, the fewest that fit
    # EAGLE-3's default layers [2, 3, 4]) with the bundled tokenizer: the comparison's plumbing is
    # what is tested, not SmolLM2's acceptance.
    target = save_tiny_target(tmp_path / "target", load_tokenizer("default"), hidden_size=128, layers=7, scale=8.0)
    out = tmp_path / "peer"
    command = [sys.executable, str(ROOT / "bench" / "peer_trainers.py"), "--minutes", "0.1", "--out", str(out)]
    command += ["--target.name", str(target)]
    command += ["--kinds", "eagle3", "peagle", "dspark", "--limit", "2", "--max-new-tokens", "8", "--data.limit", "16"]
    command += ["--data.regenerate.enabled", "false", "--data.held_out_fraction", "0.25", "--data.max_length", "128"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "peer_trainers.json").read_text())
    report = (out / "peer_trainers.md").read_text()
    for kind in ("eagle3", "peagle", "dspark"):
        entry = results["kinds"][kind]
        # --eagle3-depth (P-EAGLE drafts its chain of 3 in one pass); DSpark's block of 7, anchor slot included
        assert entry["depth"] == (7 if kind == "dspark" else 3)
        engine = kind == "dspark" and not torch.cuda.is_available()  # vLLM serves DSpark on GPUs only
        assert entry["judge"] == ("draftsmith engine" if engine else f"vLLM {results['vllm']}")
        for run in (entry["draftsmith"], entry["speculators"]):
            assert run["train"]["steps"] >= 1
            assert len(run["held_out"]["accuracy"]) == 7  # ttt_steps depths or block slots, by one evaluator
            assert run["held_out"]["conversations"] == results["held_out_conversations"]
            assert len(run["served"]["per_prompt"]) == results["prompts"] == 2
            assert len(run["served"]["per_position"]) == entry["depth"]
        paired = entry["paired"]
        assert paired["low"] <= paired["difference"] <= paired["high"]
        assert report.count(f"| {kind} |") == 2
    # speculators' own DSpark folder, given our drafter record, loads in draftsmith's engine with its own weights
    graft = out / "dspark" / "speculators-engine"
    assert json.loads((graft / "config.json").read_text())["draftsmith_export"]["source"] == str(
        out / "dspark" / "speculators" / "final"
    )
    assert (graft / "model.safetensors").samefile(out / "dspark" / "speculators" / "final" / "model.safetensors")


def test_speculators_folder_gets_our_record_only_when_every_shape_field_agrees(tmp_path):
    """DSpark's judge in draftsmith's engine: speculators' own folder is given our drafter record (files
    hard-linked, its config.json rewritten, theirs untouched) only when the configs agree on every field
    both hold but versions, dtypes, the verifier and the class name; another block size is refused."""
    bench = _bench()
    layer = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100, "num_attention_heads": 4}
    ours = {"draftsmith_export": {"kind": "dspark", "format": "speculators", "config": {"block_size": 7}}}
    ours |= {
        "architectures": ["DSparkSpeculator"],
        "block_size": 7,
        "markov_rank": 256,
        "transformer_layer_config": layer,
    }
    theirs = {key: value for key, value in ours.items() if key != "draftsmith_export"}
    theirs |= {"architectures": ["DSparkDraftModel"], "transformers_version": "5.0", "speculators_version": "0.9.0"}
    for name, config in (("ours", ours), ("theirs", theirs)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "theirs" / "model.safetensors").write_bytes(b"weights")
    graft = bench.graft_record(tmp_path / "theirs", tmp_path / "ours", tmp_path / "graft")
    config = json.loads((graft / "config.json").read_text())
    assert config["draftsmith_export"]["config"] == {"block_size": 7}
    assert config["draftsmith_export"]["source"] == str(tmp_path / "theirs")
    assert config["architectures"] == ["DSparkDraftModel"]  # theirs, with our record added
    assert (graft / "model.safetensors").samefile(tmp_path / "theirs" / "model.safetensors")
    assert "draftsmith_export" not in json.loads((tmp_path / "theirs" / "config.json").read_text())
    for field, value in (("block_size", 8), ("transformer_layer_config", {**layer, "num_hidden_layers": 3})):
        (tmp_path / "theirs" / "config.json").write_text(json.dumps({**theirs, field: value}))
        with pytest.raises(SystemExit, match="not trained alike"):
            bench.graft_record(tmp_path / "theirs", tmp_path / "ours", tmp_path / f"refused-{field}")
        assert not (tmp_path / f"refused-{field}").exists()
