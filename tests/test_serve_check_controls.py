"""The export gate's negative controls: EAGLE-3 exports broken on purpose (``fc`` and layers
randomised, a zeroed LM head, ``fc``'s column blocks swapped), from a weak head and from a
better-trained one (conftest's ``gate_heads``), served by the real vLLM, must fail or be
inconclusive, never pass. (A file of their own so that two test workers share the gate's vLLM starts.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
from gate_helpers import needs_vllm, run_gate
from safetensors.torch import load_file, save_file

from draftsmith.export import export_checkpoint

pytestmark = [pytest.mark.slow, needs_vllm]

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
def eagle3_exports(gate_heads, tmp_path_factory):
    """speculators exports of the weak (20 steps) and the better-gate_heads (400 steps) EAGLE-3 head."""
    root = tmp_path_factory.mktemp("e3-exports")
    for name in ("weak", "eagle3"):
        export_checkpoint(gate_heads[name], "speculators", root / name, draft_tokens=3)
    return root


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
@pytest.mark.parametrize("head", ["weak", "eagle3"])
def test_gate_never_passes_a_broken_eagle3_export(eagle3_exports, gate_heads, tmp_path, head, breakage):
    broken = tmp_path / "broken"
    shutil.copytree(eagle3_exports / head, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    changed = {name: BREAKAGES[breakage](name, t) for name, t in tensors.items()}
    assert any(not torch.equal(changed[n], tensors[n]) for n in tensors)  # the breakage found its weights
    save_file(changed, str(broken / "model.safetensors"))
    code, result = run_gate(broken, gate_heads["prompts"])
    assert result["verdict"] in ("failed", "inconclusive") and not result["passed"], result
    assert code == {"failed": 1, "inconclusive": 3}[result["verdict"]] and result["reasons"]
    assert "PASSED" not in (broken / "serve_check.md").read_text()
    if head == "eagle3" and breakage != "zeroed_lm_head":  # a gate_heads head's wrong drafts are clear
        assert result["verdict"] == "failed" and any(r.startswith("position 1:") for r in result["reasons"])
