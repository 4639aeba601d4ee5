"""What the export gate's tests share: the skip where vLLM cannot run, and one gate run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.export.serve_check import main as check_main
from draftsmith.vllm_engine import why_unavailable

needs_vllm = pytest.mark.skipif(why_unavailable() is not None, reason=why_unavailable() or "")
CHECK = ["--limit", "4", "--max-new-tokens", "32"]


def run_gate(folder: Path, prompts: Path, *extra: str) -> tuple[int, dict]:
    """The gate's exit code and ``serve_check.json`` for the export in ``folder`` on 4 of ``prompts``."""
    try:
        check_main([str(folder), "--prompts", str(prompts), *CHECK, *extra])
        code = 0
    except SystemExit as exit:
        code = exit.code
    return code, json.loads((folder / "serve_check.json").read_text())
