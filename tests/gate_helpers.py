"""What the vLLM tests share: the skip where vLLM cannot run (with the reason), and one export-gate run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_helpers import write_recipe

from draftsmith.export.serve_check import main as check_main
from draftsmith.vllm_engine import why_unavailable

WHY_NO_VLLM = why_unavailable()
needs_vllm = pytest.mark.skipif(WHY_NO_VLLM is not None, reason=WHY_NO_VLLM or "")
CHECK = ["--limit", "4", "--max-new-tokens", "32"]


def run_gate(folder: Path, prompts: Path, *extra: str) -> tuple[int, dict]:
    """The gate's exit code and ``serve_check.json`` for the export in ``folder`` on 4 of ``prompts``."""
    try:
        check_main([str(folder), "--prompts", str(prompts), *CHECK, *extra])
        code = 0
    except SystemExit as exit:
        code = exit.code
    return code, json.loads((folder / "serve_check.json").read_text())


def assert_gate_passed(code: int, result: dict, depth: int, first: float = 0.1) -> None:
    """The gate passed an export drafting ``depth`` tokens: per position, on counts, and a real
    drafter (both engines accept more than ``first`` of position 1)."""
    assert code == 0 and result["passed"] and result["verdict"] == "passed", result
    assert result["engine"] == "vllm" and result["version"].startswith("0.")
    assert result["num_speculative_tokens"] == depth and len(result["positions"]) == depth
    assert result["same_output"] is True and result["same_as_ours"] == 1.0
    # A real drafter, not one that never drafts right: both engines accept a share of position 1.
    assert result["positions"][0]["ours"] > first, result["positions"]
    for position in result["positions"]:
        assert position["verdict"] == "passed" and abs(position["vllm"] - position["ours"]) <= position["margin"]
        # Counts, not just rates: both engines count the steps vLLM runs (its last ones draft past
        # max_new_tokens, and so do ours in the gate).
        assert position["vllm_drafts"] > 0 and position["ours_drafts"] > 0
        assert position["vllm"] == round(position["vllm_accepted"] / position["vllm_drafts"], 4)
        assert position["ours"] == round(position["ours_accepted"] / position["ours_drafts"], 4)
    assert result["vllm_acceptance_length"] > 1.1 and result["ours_acceptance_length"] > 1.1
    assert min(result["vllm_tok_s"], result["vllm_plain_tok_s"], result["ours_tok_s"], result["ours_plain_tok_s"]) > 0


def gate_recipe(root: Path, gate: dict, drafter: dict, **training) -> Path:
    """A recipe for a head of its own (``drafter``) trained on the gate's tiny target and data
    (``gate``: its ``target`` and ``data``, as the ``gate_eagle3`` and ``gate_heads`` fixtures hold
    them) at a constant learning rate: 250 steps unless ``training`` says otherwise, enough for the
    gate's verdict."""
    schedule = {"max_steps": 250, "log_every": 50, "eval_every": 1000, "save_every": 1000, **training}
    return write_recipe(
        root, gate["target"], drafter, data=gate["data"], learning_rate=3e-3, lr_schedule="constant", **schedule
    )
