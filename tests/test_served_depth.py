"""The draft length vLLM serves is the one trained and measured (issue 33, item 3).

``--draft-tokens`` above what a checkpoint drafts (P-EAGLE's trained depths, DFlash's block - 1,
Medusa's heads) is refused by ``draftsmith-export`` and by the gate, in one line naming the most
it drafts, instead of serving untrained mask slots or being capped silently. (A DFlash K below
block_size - 1 is served as vLLM runs it, a ``[anchor, MASK x K]`` block, and our drafter runs the
same block: ``tests/test_dflash.py``.)
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_user_error

from draftsmith.errors import UsageError
from draftsmith.export.cli import main as export_main
from draftsmith.export.serve_check import served_as
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.peagle import PEagleHead

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(make_tiny_llama, tmp_path_factory):
    """A tiny target's folder and a P-EAGLE (4 depths) and a DFlash (block 4) checkpoint for it."""
    root = tmp_path_factory.mktemp("served_depth")
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    PEagleHead.for_target(target, "tiny", [0, 1, 2], mask_token_id=47, num_depths=4).save_pretrained(root / "peagle")
    DFlashHead.for_target(target, "tiny", [0, 1, 2], 1, 4, 47).save_pretrained(root / "dflash")
    return root


@pytest.mark.parametrize(("kind", "most"), [("peagle", 4), ("dflash", 3)])
def test_export_refuses_more_draft_tokens_than_the_checkpoint_drafts(saved, tmp_path, capsys, kind, most):
    argv = [str(saved / kind), "--format", "speculators", "--target", str(saved / "target")]
    assert_user_error(
        capsys,
        rf"--draft-tokens {most + 1}: this {kind} drafter drafts at most {most} tokens per step",
        export_main,
        [*argv, "--out", str(tmp_path / "over"), "--draft-tokens", str(most + 1)],
    )
    assert not (tmp_path / "over").exists()


@pytest.mark.parametrize(
    ("kind", "config", "most"), [("peagle", {"num_depths": 4}, 4), ("medusa", {"num_heads": 3}, 3)]
)
def test_the_gate_refuses_more_draft_tokens_than_the_checkpoint_drafts(tmp_path, kind, config, most):
    meta = {"format": "speculators" if kind == "peagle" else "vllm-medusa", "kind": kind, "config": config}
    with pytest.raises(UsageError, match=rf"--draft-tokens {most + 1}: this {kind} drafter drafts at most {most}"):
        served_as(meta, tmp_path, most + 1)
    assert served_as(meta, tmp_path, most).num_speculative_tokens == most
    assert served_as(meta, tmp_path, None).num_speculative_tokens == min(3, most)  # the export's own, else 3
