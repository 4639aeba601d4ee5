"""Heads over targets whose forward scales or caps the LM head's logits, in fp32: Gemma-2 soft-caps
them, Granite divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale`` (the
tiny configs of ``test_target_layouts``).

- Training targets (``train.unroll.target_terms``, which EAGLE, EAGLE-3, P-EAGLE and DFlash training
  take) are the target's own distribution: softmax of its forward's logits.
- Draft logits carry the target's multiplicative logit scale and no soft cap (all vLLM 0.32's
  drafters apply): heads reading the target's LM head multiply by it, heads with their own LM head
  start from its rows times it; for Cohere and Granite a fresh head drafts the forward's logits.
- Exports compute what the engine drafts: vLLM's Medusa (its ``MedusaConfig``'s ``logit_scale``
  and its arithmetic) and speculators' DFlash model (loaded on CPU; vLLM's bridge reads no
  ``logit_scale`` from it, so 1.0), each also loaded back into the engine.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_target_layouts import VOCAB, scaled

from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.export import export_checkpoint
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.train.unroll import UnrollLoss, target_terms

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["gemma2", "granite", "cohere"]
SCALES = {"gemma2": 1.0, "granite": 1 / 8, "cohere": 0.5}  # what test_target_layouts.scaled configures
IDS = torch.tensor([[3, 4, 5, 6, 7, 8]])
REDUCED = torch.arange(0, VOCAB, 3)  # a reduced draft vocabulary


def last_hidden_and_logits(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last hidden states (what its LM head reads) and its forward's logits for ``IDS``."""
    with torch.no_grad():
        return target.get_decoder()(IDS).last_hidden_state[0], target(IDS).logits[0].float()


def dflash(target, kind: str) -> DFlashHead:
    return DFlashHead.for_target(target, kind, [0, 1, 2], 1, 4, 5, REDUCED)


@pytest.mark.parametrize("kind", KINDS)
def test_training_targets_are_the_targets_own_distribution(kind):
    target = scaled(kind)
    hidden, logits = last_hidden_and_logits(target)
    heads = {
        "eagle": EagleHead.for_target(target, kind),
        "eagle, reduced vocabulary": EagleHead.for_target(target, kind, draft_vocab=REDUCED),
        "medusa": MedusaHeads.for_target(target, kind, lm_head="copy"),
    }
    if kind != "cohere":  # Cohere's layers have no post-attention norm and its config no rms_norm_eps
        heads["dflash"] = dflash(target, kind)
    for name, head in heads.items():
        probs, best, _, _ = target_terms(head, hidden, UnrollLoss(), training=False)
        torch.testing.assert_close(probs, logits[:, head.draft_vocab].softmax(-1), msg=f"{kind} {name}")
        assert torch.equal(best, logits.argmax(-1)) or not head.full_vocab


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_heads_draft_the_targets_scaled_logits(kind):
    """Given the target's own last hidden states, EAGLE-1 and Medusa heads (shared or per-head LM
    heads, identity blocks) draft the target's LM head times its logit scale, and EAGLE-3's and
    DFlash's own LM heads start as those rows: for Cohere and Granite the forward's own logits,
    for Gemma-2 the same short of its soft cap."""
    target = scaled(kind)
    hidden, logits = last_hidden_and_logits(target)
    expected = hidden @ target.get_output_embeddings().weight.T * SCALES[kind]
    if kind == "gemma2":
        assert (expected - logits).abs().max() > 1e-3  # the cap is visible at these logits
    else:
        torch.testing.assert_close(expected, logits)
    with torch.no_grad():
        torch.testing.assert_close(EagleHead.for_target(target, kind).logits(hidden), expected)
        for lm_head in ("shared", "copy"):
            medusa = MedusaHeads.for_target(target, kind, num_heads=2, lm_head=lm_head)
            torch.testing.assert_close(medusa.logits(hidden), expected.expand(2, -1, -1), msg=lm_head)
        if kind != "cohere":
            for head in (Eagle3Head.for_target(target, kind, aux_layers=[0, 1, 2]), dflash(target, kind)):
                torch.testing.assert_close(head.lm_head(hidden), expected[:, head.draft_vocab])


def saved(kind: str, folder) -> torch.nn.Module:
    """``scaled(kind)`` saved into ``folder`` (what an export reads its target from)."""
    target = scaled(kind)
    target.save_pretrained(folder)
    return target


def perturb(module, seed: int = 2) -> None:
    """Move every weight but the norms and the LM heads: a trained head's blocks and layers."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" not in name and "lm_" not in name:
                param.add_(0.3 * torch.randn_like(param))


@pytest.mark.parametrize("lm_head", ["shared", "copy"])
@pytest.mark.parametrize("kind", KINDS)
def test_vllm_medusa_export_drafts_what_the_engine_drafts(kind, lm_head, tmp_path):
    vllm_medusa = pytest.importorskip("vllm.transformers_utils.configs.medusa", reason="vllm is not installed")
    target = saved(kind, tmp_path / "target")
    heads = MedusaHeads.for_target(target, kind, num_heads=2, lm_head=lm_head)
    perturb(heads)
    heads.head_accuracy = [[0.5] * 10] * 2  # what the engine's default tree is built from
    heads.save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "vllm-medusa", tmp_path / "out", target=str(tmp_path / "target"))
    # As vLLM 0.32's Medusa reads it: MedusaConfig, then LogitsProcessor(..., config.logit_scale).
    scale = getattr(vllm_medusa.MedusaConfig.from_pretrained(tmp_path / "out"), "logit_scale", 1.0)
    assert scale == (SCALES[kind] if lm_head == "shared" else 1.0)  # per-head LM heads hold it in their weights
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    hidden = torch.randn(5, target.config.hidden_size)
    theirs = []
    for k in range(2):  # vLLM's ResidualBlock (x + SiLU(W x + b)), then the head's LM head
        x = hidden + torch.nn.functional.silu(
            hidden @ tensors[f"blocks.{k}.layers.0.weight"].T + tensors[f"blocks.{k}.layers.0.bias"]
        )
        theirs.append(x @ tensors["lm_head.weight" if lm_head == "shared" else f"lm_heads.{k}.weight"].T * scale)
    with torch.no_grad():
        ours = heads.logits(hidden)
        torch.testing.assert_close(torch.stack(theirs), ours)
        back = build_drafter(f"medusa:{tmp_path / 'out'}", target)
        torch.testing.assert_close(back.heads.logits(hidden), ours)


@pytest.mark.parametrize("kind", ["gemma2", "granite"])  # a DFlash head cannot be built for Cohere (see above)
def test_dflash_export_drafts_what_the_engine_drafts(kind, tmp_path):
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    bridge = pytest.importorskip("vllm.transformers_utils.configs.speculators.base", reason="vllm is not installed")
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    target = saved(kind, tmp_path / "target")
    head = dflash(target, kind)
    perturb(head)
    head.save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out", target=str(tmp_path / "target"))
    # vLLM's DFlash drafter: LogitsProcessor(draft_vocab_size, scale=getattr(config, "logit_scale", 1.0)).
    scale = getattr(bridge.SpeculatorsConfig.from_pretrained(tmp_path / "out"), "logit_scale", 1.0)
    assert scale == 1.0
    config = DFlashSpeculatorConfig.from_pretrained(tmp_path / "out")
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(tmp_path / "target")
    theirs = DFlashDraftModel.from_pretrained(tmp_path / "out", config=config).eval()
    rows = target.get_output_embeddings().weight[REDUCED] * SCALES[kind]
    torch.testing.assert_close(theirs.lm_head.weight, rows)  # the scale travels in the weights
    hidden = torch.randn(5, target.config.hidden_size)
    with torch.no_grad():
        ours = head.draft_logits(hidden)
        torch.testing.assert_close(theirs.lm_head(theirs.norm(hidden)) * scale, ours)
        back = build_drafter(f"dflash:{tmp_path / 'out'}", target)
        torch.testing.assert_close(back.head.draft_logits(hidden), ours)
