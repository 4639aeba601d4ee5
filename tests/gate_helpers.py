"""What the vLLM tests share: the skip where vLLM cannot run (with the reason), and one export-gate run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
