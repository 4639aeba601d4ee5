"""EAGLE 3.1's options on EAGLE-3 heads (``fc_norm``, ``norm_output``), as speculators 0.9.0 and vLLM 0.32 build them.

- The forward changes exactly where the references' does: ``fc_norm`` norms each aux layer's chunk
  of the features on its own before ``fc`` (checked by hand, and against one norm over the whole
  concatenation); ``norm_output`` leaves the first draft's logits as they were and feeds the normed
  state to the next draft step.
- Both off by default: a checkpoint from before them (no such keys) loads bit-identically.
- Checkpoints record both and round-trip; training from a recipe works with each; greedy decoding
  in draftsmith's engine stays token-identical to plain decoding.
- The speculators export writes both fields and the ``fc_norm.{i}.weight`` tensors (permuted with
  unsorted aux layers) and speculators' own ``Eagle3DraftModel`` computes our draft logits over
  three passes; an export whose flag is dropped computes other logits there and is refused here.
  The SGLang folder carries both. vLLM 0.32 serves an EAGLE 3.1 export drafting what our engine
  drafts (slow: one vLLM start). P-EAGLE refuses the options in one line.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cli_helpers import assert_user_error
from gate_helpers import assert_gate_passed, gate_recipe, needs_vllm
from safetensors.torch import load_file, save_file
from speculators_helpers import assert_same_logits, aux_features, draft_logits_both, load_speculators
from training_helpers import save_tiny_target, tiny_training_recipe
from transformers import AutoModelForCausalLM, DynamicCache

from draftsmith.errors import CheckpointError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.export import export_checkpoint
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.target import load_tokenizer
from draftsmith.train.eagle3 import Eagle3DrafterConfig
from draftsmith.train.unroll import unroll

pytestmark = pytest.mark.usefixtures("one_thread")

BOTH = {"fc_norm": True, "norm_output": True}
IDS = [3, 917, 44, 1289, 6, 311, 2046, 30, 8, 5, 14, 22]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A 3-layer Llama (hidden 64) with the bundled tokenizer: aux layers 0-2 are decoder-layer inputs."""
    return save_tiny_target(tmp_path_factory.mktemp("e31") / "target", load_tokenizer("default"), scale=8.0, layers=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _head(target, target_dir, aux=(0, 1, 2), draft_vocab=None, **options) -> Eagle3Head:
    """A random head whose every weight (norms included) is its own, so each one changes its drafts."""
    torch.manual_seed(1)
    head = Eagle3Head.for_target(
        target, str(target_dir), aux_layers=list(aux), draft_vocab=draft_vocab, init="random", **options
    )
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name or name == "lm_head.weight":  # ones, or the target's rows, at init
                param.add_(0.5 * torch.randn_like(param))
    return head.eval()


def _assert_same_drafts(head, loaded, target, steps: int = 3, exact: bool = True) -> None:
    """``loaded`` drafts what ``head`` does over ``steps`` training-time-test passes: bit for bit,
    or (not ``exact``: fc's columns moved, so summed in another order) to float rounding."""
    ids = torch.tensor([IDS])
    mask = torch.ones(1, len(IDS), dtype=torch.long)
    with torch.no_grad():
        ours, theirs = (
            unroll(h, ids, aux_features(target, IDS, h.aux_layers)[:, :-1], mask, steps, h.feedback_input)
            for h in (head, loaded)  # an export's aux layers are sorted (and its fc with them)
        )
        for a, b in zip(ours, theirs, strict=True):
            if exact:
                assert torch.equal(head.logits(a), loaded.logits(b))
            else:
                torch.testing.assert_close(loaded.logits(b), head.logits(a), atol=2e-5, rtol=1e-5)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------
# The forward, by hand


def test_fc_norm_norms_each_aux_layers_chunk_on_its_own_before_fc(target, target_dir):
    head = _head(target, target_dir, fc_norm=True)
    assert len(head.fc_norm) == 3 and not head.norm_output
    features = aux_features(target, IDS, head.aux_layers)
    eps = head.config.rms_norm_eps
    chunks = features.split(target.config.hidden_size, dim=-1)
    by_hand = (
        torch.cat([_rms(c, n.weight, eps) for c, n in zip(chunks, head.fc_norm, strict=True)], -1) @ head.fc.weight.T
    )
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(features), by_hand, atol=1e-5, rtol=1e-5)
        # Control: one norm over the concatenation (speculators' norm_before_fc) is another function.
        whole = _rms(features, torch.cat([n.weight for n in head.fc_norm]), eps) @ head.fc.weight.T
        assert (head.fuse(features) - whole).abs().max() > 0.1
        # The aux layers' scales differ (that is what fc_norm evens out), so a plain fc differs too.
        scales = [c.pow(2).mean().sqrt().item() for c in chunks]
        assert max(scales) > 1.5 * min(scales), scales
        assert (head.fuse(features) - head.fc(features)).abs().max() > 0.1


def test_norm_output_keeps_the_first_draft_and_feeds_the_normed_state_forward(target, target_dir):
    """A draft chain by hand, the head's KV cache kept: the EAGLE 3.1 head equals the plain head of
    the same weights whose output is normed, at the first draft and at the next, fed that normed state."""
    plain = _head(target, target_dir)
    normed = _head(target, target_dir, norm_output=True)
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), normed.state_dict().values(), strict=True)
    )
    context = torch.tensor([IDS[1:8]])
    features = aux_features(target, IDS[:7], plain.aux_layers)
    caches = DynamicCache(), DynamicCache()
    with torch.no_grad():
        first = [
            head(context, features, past_key_values=cache, use_cache=True).last_hidden_state[:, -1:]
            for head, cache in zip((plain, normed), caches, strict=True)
        ]
        # The first draft: the same logits (the LM head reads norm(h) either way); the output is norm(h).
        torch.testing.assert_close(normed.draft_logits(first[1]), plain.draft_logits(first[0]), atol=1e-5, rtol=0)
        torch.testing.assert_close(first[1], plain.norm(first[0]), atol=1e-6, rtol=0)
        # The next draft reads the normed state back: the plain head fed norm(h) by hand gives it.
        token = torch.tensor([[IDS[8]]])
        after = normed(token, hidden_states=first[1], past_key_values=caches[1], use_cache=True).last_hidden_state
        fork = copy.deepcopy(caches[0])
        by_hand = plain(token, hidden_states=plain.norm(first[0]), past_key_values=caches[0]).last_hidden_state
        torch.testing.assert_close(after, plain.norm(by_hand), atol=1e-5, rtol=0)
        torch.testing.assert_close(normed.draft_logits(after), plain.draft_logits(by_hand), atol=1e-5, rtol=0)
        # Control: the plain head's next draft (fed the pre-norm state) is another one.
        pre_norm = plain(token, hidden_states=first[0], past_key_values=fork).last_hidden_state
        assert (plain.draft_logits(pre_norm) - normed.draft_logits(after)).abs().max() > 0.1


# ---------------------------------------------------------------------------------------------
# Off by default; checkpoints


def test_both_are_off_by_default_and_a_checkpoint_from_before_them_loads_bit_identically(target, target_dir, tmp_path):
    assert (Eagle3DrafterConfig().fc_norm, Eagle3DrafterConfig().norm_output) == (False, False)
    head = _head(target, target_dir)
    assert head.fc_norm is None and not head.norm_output
    assert not any(name.startswith("fc_norm") for name in head.state_dict())
    head.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (False, False)
    for key in ("fc_norm", "norm_output"):  # as every checkpoint written before the options wrote it
        del config[key]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = Eagle3Head.from_pretrained(tmp_path / "old", target).eval()
    assert loaded.fc_norm is None and not loaded.norm_output
    _assert_same_drafts(head, loaded, target)


def test_a_checkpoint_records_both_and_round_trips_and_a_dropped_flag_is_refused(target, target_dir, tmp_path):
    head = _head(target, target_dir, **BOTH)
    head.save_pretrained(tmp_path / "e31")
    config = json.loads((tmp_path / "e31" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    state = load_file(str(tmp_path / "e31" / "model.safetensors"))
    assert [name for name in state if name.startswith("fc_norm")] == [f"fc_norm.{i}.weight" for i in range(3)]
    loaded = Eagle3Head.from_pretrained(tmp_path / "e31", target).eval()
    assert len(loaded.fc_norm) == 3 and loaded.norm_output
    _assert_same_drafts(head, loaded, target)
    config["fc_norm"] = False  # the weights stay: they would be left unread
    (tmp_path / "e31" / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=r"Unexpected key.*fc_norm\.0\.weight"):
        Eagle3Head.from_pretrained(tmp_path / "e31", target)


# ---------------------------------------------------------------------------------------------
# Training and drafting


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    drafter = {"aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 512}
    return tiny_training_recipe(tmp_path_factory.mktemp("e31-train"), drafter, max_steps=12, eval_every=12)


@pytest.mark.parametrize("option", ["fc_norm", "norm_output"])
def test_training_with_each_option_lowers_the_loss_and_its_checkpoint_drafts_losslessly(recipe, tmp_path, option):
    from draftsmith.train.eagle3 import main

    trainer = main([str(recipe), "--output_dir", str(tmp_path / "run"), f"--drafter.{option}", "true"])
    losses = [h["train/loss"] for h in trainer.history if "train/loss" in h]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses
    head = Eagle3Head.from_pretrained(trainer.last_checkpoint)
    assert (head.fc_norm is not None, head.norm_output) == (option == "fc_norm", option == "norm_output")
    if option == "fc_norm":  # trained: the norms moved off their ones
        assert all((norm.weight - 1).abs().max() > 1e-4 for norm in head.fc_norm)
    target = AutoModelForCausalLM.from_pretrained(head.target_info["name"], dtype=torch.float32).eval()
    plain = SpeculativeDecoder(target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(
        target, build_drafter(f"eagle3:{trainer.last_checkpoint}?depth=4&top_k=2&budget=6", target), None, eos_ids=set()
    )
    for prompt in ([1, 17, 402, 9, 77], [5, 5, 5]):
        assert spec.generate(prompt, 24).tokens == plain.generate(prompt, 24).tokens


# ---------------------------------------------------------------------------------------------
# Exports


def test_speculators_export_has_both_fields_and_norms_and_speculators_computes_our_drafts(target, target_dir, tmp_path):
    """Unsorted aux layers [2, 0, 1] export sorted, with fc's column blocks and the norms moved with them."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    head = _head(target, target_dir, aux=(2, 0, 1), draft_vocab=torch.arange(0, 4000, 3), **BOTH)
    head.save_pretrained(tmp_path / "ckpt")
    head.bind(target)
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (raw["fc_norm"], raw["norm_output"], raw["norm_before_fc"]) == (True, True, False)
    assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    for exported, ours in enumerate((1, 2, 0)):  # ours: layers 2, 0, 1
        assert torch.equal(weights[f"fc_norm.{exported}.weight"], head.fc_norm[ours].weight)
    theirs = load_speculators(tmp_path / "out")
    assert theirs.config.fc_norm and theirs.config.norm_output and len(theirs.fc_norm) == 3
    assert_same_logits(head, theirs, target, IDS, steps=3)
    # The engine loads the export back and drafts what the checkpoint does.
    _assert_same_drafts(head, Eagle3Head.from_pretrained(tmp_path / "out", target).eval(), target, exact=False)

    # Negative controls: each flag dropped from the fields engines read (weights and record kept).
    for key in ("fc_norm", "norm_output"):
        broken = tmp_path / f"no-{key}"
        broken.mkdir()
        save_file(weights, str(broken / "model.safetensors"))
        (broken / "config.json").write_text(json.dumps({**raw, key: False}))
        passes = draft_logits_both(head, load_speculators(broken), target, IDS, steps=3)
        gaps = [(theirs_logits - ours).abs().max().item() for theirs_logits, ours in passes]
        # fc_norm changes every draft; norm_output only what a later pass reads back.
        assert gaps[0] > 0.1 if key == "fc_norm" else gaps[0] < 1e-4, gaps
        assert min(gaps[1:]) > 0.1, gaps
        with pytest.raises(CheckpointError, match=rf"no-{key}: config\.json says {key}: false .* record says true"):
            build_drafter(f"eagle3:{broken}", target)


def test_sglang_folder_carries_both_fields_and_the_norms(target, target_dir, tmp_path):
    head = _head(target, target_dir, **BOTH)
    head.save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "sglang", tmp_path / "sgl")
    config = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    weights = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    assert all(torch.equal(weights[f"fc_norm.{i}.weight"], head.fc_norm[i].weight) for i in range(3))
    # A plain EAGLE-3 head's folder says both are off and has no norms.
    _head(target, target_dir).save_pretrained(tmp_path / "plain")
    export_checkpoint(tmp_path / "plain", "sglang", tmp_path / "sgl-plain")
    config = json.loads((tmp_path / "sgl-plain" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (False, False)
    assert not any(k.startswith("fc_norm") for k in load_file(str(tmp_path / "sgl-plain" / "model.safetensors")))


def test_peagle_refuses_the_options_in_one_line(recipe, tmp_path, capsys):
    from draftsmith.train.peagle import main

    assert_user_error(
        capsys,
        r"drafter\.fc_norm and drafter\.norm_output .*EAGLE-3 options: vLLM 0\.32 serves P-EAGLE drafters without them",
        main,
        [
            str(recipe),
            "--output_dir",
            str(tmp_path / "run"),
            "--drafter.kind",
            "peagle",
            "--drafter.norm_output",
            "true",
        ],
    )


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_an_eagle31_export_drafting_what_our_engine_drafts(gate_eagle3, tmp_path, capsys):
    """A head trained with both options on the gate's tiny target (hidden 128, which vLLM's CPU
    attention takes): vLLM 0.32 builds its fc_norm and norm_output from the export and accepts, per
    draft position, what draftsmith's engine accepts from the same folder (the export gate)."""
    from draftsmith.export.cli import main as export_main
    from draftsmith.train.eagle3 import main as train_eagle3

    root = tmp_path / "e31"
    root.mkdir()
    drafter = {"aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 2048, **BOTH}
    recipe = gate_recipe(root, gate_eagle3, drafter)
    checkpoint = train_eagle3([str(recipe), "--output_dir", str(root / "run")]).last_checkpoint
    out = tmp_path / "e31-export"
    # 8 prompts x 48 tokens: 4 x 32 left the third position inconclusive (23 / 34 against 27 / 38).
    check = ["--check", "vllm", "--check-prompts", str(gate_eagle3["prompts"]), "--check-limit", "8"]
    check += ["--check-max-new-tokens", "48"]
    export_main([str(checkpoint), "--format", "speculators", "--out", str(out), "--draft-tokens", "3", *check])
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(out / "model.safetensors")))
    assert_gate_passed(0, json.loads((out / "serve_check.json").read_text()), 3)
    assert "PASSED" in capsys.readouterr().out
