"""A vLLM deployment that learns (issue 56): vLLM serves head A, its requests are logged as a gateway
logs them, one watched round (the new requests' features extracted with vLLM, trained, judged) is
promoted and pushed into the same running vLLM, which then serves B: the probe finds B's weights in
the drafter it runs, and B's draft counters on fixed prompts equal those of a vLLM started with B.
One vLLM serves the whole story (a second starts with B, to compare): ~2-3 minutes on a 2-core CPU.

And without vLLM: a reload of a kind with derived buffers is refused before a weight moves, the
export vLLM started from is fingerprinted when read, and a changed one is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from training_helpers import save_tiny_target, write_recipe

from draftsmith.data_prep.chat import render_prompt
from draftsmith.errors import CheckpointError
from draftsmith.export.vllm_reload import WEIGHTS, check_probe, load_export, probe_digests, started_export
from draftsmith.target import load_tokenizer
from draftsmith.vllm_engine import run_job, why_unavailable

LAYERS = [0, 1, 2]
TOKENS = 24


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A tiny target (vLLM's CPU attention takes head size 32) made repetitive (weights x5) and an
    EAGLE-3 head trained briefly on its replies to ShareGPT prompts: the deployed head A."""
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    from draftsmith.train.eagle3 import main as train_eagle3

    root = tmp_path_factory.mktemp("watch")
    target = save_tiny_target(root / "target", load_tokenizer("default"), hidden_size=128, scale=5.0, layers=3)
    drafter = {"aux_layers": LAYERS, "ttt_steps": 3, "draft_vocab_size": None, "down_sample_ratio": 1.0}
    data = {"regenerate": {"enabled": True, "max_new_tokens": 24}}
    recipe = write_recipe(root, target, drafter, data=data, learning_rate=3e-3, max_steps=6)
    head = train_eagle3([str(recipe), "--output_dir", str(root / "head"), "--training.eval_every", "0"]).last_checkpoint
    return {"root": root, "target": target, "head": Path(head)}


@pytest.mark.slow
def test_a_watched_round_is_promoted_and_served_by_the_running_vllm(deployed):
    root = deployed["root"]
    adapt = {
        "head": str(deployed["head"]),
        "traffic": str(root / "gateway.jsonl"),
        "out_dir": str(root / "adapt"),
        "held_out": 8,
        "min_held_out": 8,
        "replay_fraction": 0.0,
        "round_steps": 40,
        "learning_rate": 3e-3,
        "batch_size": 2,
        "judge_max_new_tokens": 16,
        "max_forgetting": None,
        # The deployment loop is under test here, not the judge's power (test_adapt's controls are): any
        # challenger not worse by a whole token per pass is promoted.
        "margin": -1.0,
        "export_format": "speculators",
    }
    tokenizer = load_tokenizer(str(deployed["target"]))
    probe = [render_prompt(tokenizer, _messages(100 + i)) for i in range(3)]
    job = {
        "task": "draftsmith.adapt.watch:serve_and_watch",
        "adapt": adapt,
        "traffic": [_messages(i) for i in range(16)],
        "probe": probe,
        "max_new_tokens": TOKENS,
        "engine": {"block_size": 32},
    }
    served = run_job(job, "vLLM serving and watching")
    step = served["step"]
    assert step["features"]["new"] == 16 and not step["features"]["rebuilt"], step
    verdict = step["round"]["verdict"]
    assert verdict["promoted"], verdict
    push = step["push"]
    b = Path(push["export"])
    assert b.parent.name == "round-0001" and push["loaded"]["via"] == "native weight update", push
    assert push["probe"]["passed"] and push["probe"]["discriminating"], push["probe"]

    # A vLLM started with B drafts, on the probe prompts, exactly what the reloaded one drafted.
    from draftsmith.export.serve_check import export_metadata, served_as, speculative_config
    from draftsmith.vllm_engine import engine_args

    spec = speculative_config(served_as(export_metadata(b), b, None), b)
    fresh = run_job(
        {
            "task": "generate",
            "engine": engine_args(str(deployed["target"]), speculative_config=spec, block_size=32),
            "prompts": probe,
            "max_new_tokens": TOKENS,
            "stop_token_ids": [],
        },
        "vLLM started with B",
    )
    assert push["probe_counters"] == fresh["spec"], (push["probe_counters"], fresh["spec"])
    assert fresh["spec"]["num_drafts"] > 0 and fresh["spec"]["num_accepted_tokens"] > 0, fresh["spec"]
    print(
        json.dumps(
            {
                "vllm_start_s": served["start_seconds"],
                "features_s": step["features"]["seconds"],
                "train_s": step["round"]["train_seconds"],
                "judge_s": step["round"]["judge_seconds"],
                "round_s": step["round_seconds"],
                "reload_s": push["reload_seconds"],
                "verdict": verdict,
                "before": served["before"],
                "after": push["probe_counters"],
            }
        )
    )


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Linear(2, 2)


def test_a_reload_of_a_kind_with_derived_buffers_is_refused_before_a_weight_moves(tmp_path):
    inner = _Linear()
    inner._build_fused_kv_buffers = lambda: None  # vLLM 0.32's DFlash/DSpark models have it
    drafter = SimpleNamespace(model=inner)
    before = inner.norm.weight.clone()
    with pytest.raises(
        CheckpointError, match="derived from its weights at load .*_build_fused_kv_buffers.*restart vLLM"
    ):
        load_export(None, drafter, None, tmp_path, {"shapes": {}})
    assert torch.equal(inner.norm.weight, before)


def test_the_started_export_is_fingerprinted_and_a_changed_one_refused(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "export"
    folder.mkdir()
    save_file({"norm.weight": torch.ones(2)}, str(folder / WEIGHTS))
    config = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(model=str(folder))))
    started = started_export(config)
    assert started["shapes"] == {"norm.weight": (2,)} and len(started["sha256"]) == 64
    # Read later than the worker started (the collective_rpc path's first reload): a file written since is refused.
    with pytest.raises(CheckpointError, match="changed after this vLLM started"):
        started_export(config, since=os.path.getmtime(folder / WEIGHTS) - 10)
    # The probe: a module holding the export's values passes, one holding others is named.
    module = torch.nn.Module()
    module.model = torch.nn.Module()
    module.model.norm = torch.nn.Module()
    module.model.norm.weight = torch.nn.Parameter(torch.ones(2))
    assert check_probe(probe_digests(module, ["norm.weight"]), folder)["passed"]
    module.model.norm.weight.data.fill_(2.0)
    assert check_probe(probe_digests(module, ["norm.weight"]), folder)["mismatched"] == ["norm.weight"]
