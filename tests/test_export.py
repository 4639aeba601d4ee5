"""draftsmith-export: parity with the loaders that serve the exports, and re-import.

- speculators (pinned 0.9.0, vLLM's loader) loads an exported EAGLE-3 folder with its own
  ``Eagle3DraftModel`` and, given the same target hidden states and tokens, computes the same
  draft logits as draftsmith's head (fp32), for both of its training-time-test passes.
- SGLang 0.5.23 and vLLM 0.32.0/0.33.0 need GPUs: the exported names, shapes and config fields are
  checked against what their loaders read (listed below from their source), and the Medusa
  layouts' weights are run through the loaders' arithmetic.
- ``eval/run.py`` loads every exported folder back (``eagle3:``, ``eagle:``, ``medusa:``) and gives
  the same acceptance table as the original checkpoint; the model card records the measured tau.
- Heads a format cannot hold, and checkpoints without their target's name, are one-line errors.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_user_error
from safetensors.torch import load_file, save_file
from speculators_helpers import assert_same_logits, load_speculators
from training_helpers import save_tiny_target
from transformers import AutoModelForCausalLM

from draftsmith.config import dump_recipe
from draftsmith.export import export_checkpoint
from draftsmith.export import sglang as sglang_format
from draftsmith.export import vllm_medusa as vllm_medusa_format
from draftsmith.export.cli import main as export_main
from draftsmith.heads.draft_lm import derive_draft_lm, save_draft_lm
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.recipe import Recipe
from draftsmith.target import DEFAULT_TARGET_HUB_ID, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SPECULATORS_VERSION = "0.9.0"
SGLANG_VERSION = "0.5.23"  # srt/models/llama_eagle.py, llama_eagle3.py
VLLM_MEDUSA_VERSION = "0.32.0"  # model_executor/models/medusa.py (vLLM 0.33.0 has no Medusa)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A 3-layer Llama (hidden 64) with the bundled SmolLM2 tokenizer, saved as a folder (aux layers
    0, 1 and 2 are then inputs of decoder layers, as vLLM captures them; layer 3 is the output)."""
    return save_tiny_target(
        tmp_path_factory.mktemp("export") / "target", load_tokenizer("default"), scale=8.0, layers=3
    )


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _draft_vocab(target, size: int = 500) -> torch.Tensor:
    torch.manual_seed(4)
    ids = torch.randperm(target.config.vocab_size)[:size].tolist()
    return torch.tensor(sorted(set(ids) | {0, 1, 2}))


def _eagle3(
    target, target_dir, folder, aux=(0, 1, 2), draft_vocab=None, noise: float | None = None, num_layers: int = 1
) -> Eagle3Head:
    """A random EAGLE-3 head, or (``noise``) an early exit of the target at its highest aux layer
    with every weight moved by ``noise``: it drafts well, and every weight changes what it drafts."""
    torch.manual_seed(1)
    head = Eagle3Head.for_target(
        target,
        str(target_dir),
        aux_layers=list(aux),
        draft_vocab=draft_vocab,
        init="random" if noise is None else "identity",
        num_layers=num_layers,
    )
    if noise is None:
        with torch.no_grad():  # the LM head starts as the target's rows: make it the head's own
            head.lm_head.weight.add_(torch.randn_like(head.lm_head.weight))
    else:
        _perturb(head, noise)
    head.save_pretrained(folder)
    return head.eval()


def _perturb(module, scale: float = 0.3, seed: int = 2) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" not in name:
                param.add_(scale * torch.randn_like(param))


def _eagle(target, target_dir, folder, draft_vocab=None, noise: float = 0.3) -> EagleHead:
    head = EagleHead.for_target(target, str(target_dir), draft_vocab=draft_vocab)  # f_{i+1} = f_i, then noise
    _perturb(head, noise)
    head.save_pretrained(folder)
    return head.eval()


def _medusa(
    target, target_dir, folder, lm_head="shared", draft_vocab=None, num_layers=1, noise: float = 0.05
) -> MedusaHeads:
    heads = MedusaHeads.for_target(
        target, str(target_dir), num_heads=3, num_layers=num_layers, lm_head=lm_head, draft_vocab=draft_vocab
    )
    _perturb(heads, noise)
    heads.head_accuracy = [[0.6 - 0.1 * k + 0.03 * r for r in range(10)] for k in range(3)]
    heads.save_pretrained(folder)
    return heads.eval()


# ---------------------------------------------------------------------------------------------
# speculators: its own model class computes our logits


@pytest.mark.parametrize("num_layers", [1, 4], ids=["one_layer", "four_layers"])
def test_peagle_exports_as_speculators_peagle_and_loads_in_speculators_and_back(
    target, target_dir, tmp_path, num_layers
):
    """A P-EAGLE head exports as speculators' ``peagle`` (its config class validates it, its model
    loads every weight): EAGLE-3's layout with the mask token id, ``mask_hidden`` permuted with
    ``fc``'s column blocks into ascending aux order, the head's own trained ``embed_tokens`` (the
    mask token's row included); vLLM is told to draft in parallel; the export loads back into
    draftsmith's engine as the same head. Four layers (upstream's P-EAGLE size) export as
    ``num_hidden_layers: 4``, from which speculators builds its first layer and three plain ones
    that take every one of our weights by name."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    from draftsmith.eval.engine.drafters import build_drafter
    from draftsmith.heads.peagle import PEagleHead

    torch.manual_seed(1)
    head = PEagleHead.for_target(
        target,
        str(target_dir),
        [2, 0, 1],
        _draft_vocab(target),
        "random",
        mask_token_id=16,
        num_depths=5,
        num_layers=num_layers,
    )
    _perturb(head)
    head.save_pretrained(tmp_path / "ckpt")
    serve = export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    assert '"num_speculative_tokens": 5, "parallel_drafting": true}' in serve[0]
    config = PEagleSpeculatorConfig.from_pretrained(tmp_path / "out")
    assert (config.speculators_model_type, config.mask_token_id) == ("peagle", 16)
    assert config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 5
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(target_dir)
    assert config.transformer_layer_config.num_hidden_layers == num_layers
    theirs = PEagleDraftModel.from_pretrained(tmp_path / "out", config=config).eval()
    assert len(theirs.layers) == num_layers
    their_state = theirs.state_dict()
    for name, value in head.layers.state_dict().items():  # every layer's weights, under their names
        assert torch.equal(their_state[f"layers.{name}"], value), name
    assert not any(k.startswith("layers.") and k[len("layers.") :] not in head.layers.state_dict() for k in their_state)
    blocks = [head.mask_hidden.chunk(3, dim=-1)[i] for i in (1, 2, 0)]  # ours: layers 2, 0, 1
    assert torch.equal(theirs.mask_hidden, torch.cat(blocks, dim=-1))
    trained = head.embed_tokens.weight.detach().to(target.dtype)  # the head's own table, trained (mask row 16)
    assert torch.equal(theirs.embed_tokens.weight.to(target.dtype), trained)
    assert not torch.equal(trained[15], target.get_input_embeddings().weight[15])  # not the target's
    assert torch.equal(theirs.fc.weight, torch.cat([head.fc.weight.chunk(3, dim=1)[i] for i in (1, 2, 0)], dim=1))
    back = build_drafter(f"peagle:{tmp_path / 'out'}", target)
    assert back.depth == 5 and back.head.mask_token_id == 16 and back.head.aux_layers == [0, 1, 2]
    assert len(back.head.layers) == num_layers
    features = torch.randn(1, 4, 3 * target.config.hidden_size)
    ids = torch.tensor([[3, 16, 16, 16]])
    with torch.no_grad():
        ours = head.draft_logits(head(ids, features).last_hidden_state)
        permuted = torch.cat([features.chunk(3, dim=-1)[i] for i in (1, 2, 0)], dim=-1)
        again = back.head.draft_logits(back.head(ids, permuted).last_hidden_state)
        # The permuted fc columns sum in another order: fp32 rounding, grown through four layers, differs
        # by ~2e-5 on some CPUs' kernels (a wrong permutation differs by whole units).
        torch.testing.assert_close(again, ours, atol=1e-4, rtol=1e-4)
        masked = head.draft_logits(head(ids).last_hidden_state)  # every position reads the mask feature
        torch.testing.assert_close(
            back.head.draft_logits(back.head(ids).last_hidden_state), masked, atol=1e-4, rtol=1e-4
        )


def test_dflash_exports_as_speculators_dflash_and_loads_in_speculators_and_back(target, target_dir, tmp_path):
    """A DFlash drafter exports as speculators' ``dflash``: its config class validates it (Qwen3
    layers of the target's sizes and RoPE, every layer full attention and served non-causally,
    the mask token, sorted aux layers with fc's column blocks permuted), its model loads every
    weight; vLLM is told method dflash; the export loads back into the engine as the same drafter."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    from draftsmith.eval.engine.drafters import build_drafter
    from draftsmith.heads.dflash import DFlashHead

    torch.manual_seed(1)
    head = DFlashHead.for_target(target, str(target_dir), [2, 0, 1], 2, 6, 16, _draft_vocab(target))
    _perturb(head)
    head.save_pretrained(tmp_path / "ckpt")
    serve = export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    assert '{"method": "dflash", "model": "' in serve[0] and '"num_speculative_tokens": 5}' in serve[0]
    config = DFlashSpeculatorConfig.from_pretrained(tmp_path / "out")
    assert (config.mask_token_id, config.block_size, config.sliding_window_non_causal) == (16, 6, True)
    assert config.aux_hidden_state_layer_ids == [0, 1, 2] and not config.sample_from_anchor
    layer = config.transformer_layer_config
    assert (layer.model_type, layer.num_hidden_layers, layer.head_dim, layer.layer_types) == (
        "qwen3",
        2,
        target.config.hidden_size // target.config.num_attention_heads,
        ["full_attention"] * 2,
    )
    assert layer.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    layer._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(target_dir)
    theirs = DFlashDraftModel.from_pretrained(tmp_path / "out", config=config).eval()
    ours = head.state_dict()
    assert torch.equal(theirs.fc.weight, torch.cat([head.fc.weight.chunk(3, dim=1)[i] for i in (1, 2, 0)], dim=1))
    for name, value in theirs.state_dict().items():
        if name in ours and name != "fc.weight":
            assert torch.equal(value, ours[name]), name
    assert {n for n in ours if n not in theirs.state_dict()} == set()  # every weight of ours is one of theirs
    back = build_drafter(f"dflash:{tmp_path / 'out'}", target)
    assert back.depth == 5 and back.head.mask_token_id == 16 and back.head.aux_layers == [0, 1, 2]
    for name, value in back.head.state_dict().items():
        expected = theirs.state_dict()[name] if name == "fc.weight" else ours[name]
        assert torch.equal(value, expected), name


def test_export_serves_the_tree_planned_for_the_head_and_records_what_it_was_planned_for(target, target_dir, tmp_path):
    """A head with recorded held-out accuracy per depth is exported with the planned depth in
    vLLM's proposal method and serve command, SGLang's steps / top-k / draft tokens, draftsmith's
    record (with the device it was planned on) and the card; --draft-tokens overrides the depth."""
    head = _eagle3(target, target_dir, tmp_path / "ckpt")
    head.depth_accuracy = [0.0, 0.0]  # never right: one draft token a step pays best on any device
    head.save_pretrained(tmp_path / "ckpt")
    serve = export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 1
    assert '"num_speculative_tokens": 1}' in serve[0]
    record = raw["draftsmith_export"]
    assert record["num_speculative_tokens"] == 1 and record["draft_tree"]["depth"] == 1
    planned = record["draft_tree"]["planned"]
    assert "planned for held-out top-1 0.00 / 0.00 at depths 1-2 on " in planned and "threads" in planned
    assert f"- **Draft tree** (the serve command's): {planned}." in (tmp_path / "out" / "README.md").read_text()
    sglang = export_checkpoint(tmp_path / "ckpt", "sglang", tmp_path / "sgl")
    tree = json.loads((tmp_path / "sgl" / "config.json").read_text())["draftsmith_export"]["draft_tree"]
    assert (
        f"--speculative-num-steps 1 --speculative-eagle-topk {tree['top_k']} "
        f"--speculative-num-draft-tokens {tree['budget']}"
    ) in sglang[0]
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "given", draft_tokens=4)
    raw = json.loads((tmp_path / "given" / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


@pytest.mark.parametrize("reduced", [True, False], ids=["draft-vocab", "full-vocab"])
def test_speculators_eagle3_draft_logits_equal_ours(target, target_dir, tmp_path, reduced):
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    assert version("speculators") == SPECULATORS_VERSION
    head = _eagle3(target, target_dir, tmp_path / "ckpt", draft_vocab=_draft_vocab(target) if reduced else None)
    head.bind(target)
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")

    # What vLLM 0.33.0's bridge reads (transformers_utils/configs/speculators/{base,algos}.py) and
    # llama_eagle3.py sizes fc from (num_aux_hidden_states, else 3).
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["norm_before_residual"] is False
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    layer = raw["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["num_aux_hidden_states"]) == ("llama", 1, 3)
    assert layer["tie_word_embeddings"] is False and layer["vocab_size"] == target.config.vocab_size
    theirs = load_speculators(tmp_path / "out")
    # Resolved offline to the target folder (no hub): its layer ids, embedding and vocabulary maps.
    assert theirs.config.speculators_config.verifier.name_or_path == str(target_dir.resolve())
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert torch.equal(theirs.embed_tokens.weight, target.get_input_embeddings().weight)
    if reduced:
        assert theirs.d2t.dtype == torch.long and theirs.t2d.dtype == torch.bool
        assert torch.equal(theirs.d2t, head.d2t) and torch.equal(theirs.t2d, head.t2d)
        assert torch.equal(torch.arange(head.d2t.numel()) + theirs.d2t, head.draft_vocab)
    else:
        assert theirs.d2t is None and theirs.t2d is None

    assert_same_logits(head, theirs, target, [3, 917, 44, 1289, 6, 311, 2046, 30, 8, 5, 14, 22])


def test_a_head_of_three_layers_exports_in_the_layout_speculators_and_vllm_build(target, target_dir, tmp_path, capsys):
    """``num_hidden_layers: 3``; layer 0 as before, layers 1 and 2 the target's plain layers (q/k/v
    over hidden, no ``hidden_norm``: vLLM's ``llama_eagle3.py`` sizes qkv_proj ``2 * hidden`` for
    layer 0 only); speculators' own model, built from the exported config, computes our draft logits
    over two training-time-test passes. SGLang's EAGLE-3 model names its later layers otherwise, so
    that format refuses the head."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    head = _eagle3(target, target_dir, tmp_path / "ckpt", draft_vocab=_draft_vocab(target), num_layers=3)
    head.bind(target)
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 3
    h = target.config.hidden_size
    shapes = _weights(tmp_path / "out")
    assert shapes["layers.0.self_attn.q_proj.weight"][0][1] == 2 * h and "layers.0.hidden_norm.weight" in shapes
    for i in (1, 2):
        assert shapes[f"layers.{i}.self_attn.q_proj.weight"][0][1] == h
        assert shapes[f"layers.{i}.self_attn.v_proj.weight"][0][1] == h
        assert f"layers.{i}.input_layernorm.weight" in shapes and f"layers.{i}.hidden_norm.weight" not in shapes
    theirs = load_speculators(tmp_path / "out", verifier=target_dir)
    assert len(theirs.layers) == 3
    assert_same_logits(head, theirs, target, [3, 917, 44, 1289, 6, 311, 2046, 30, 8, 5, 14, 22])
    assert_user_error(
        capsys,
        r"3 decoder layers.*SGLang.*--format speculators",
        export_main,
        [str(tmp_path / "ckpt"), "--format", "sglang", "--out", str(tmp_path / "sgl")],
    )


def test_unsorted_aux_layers_export_sorted_with_fc_permuted(target, target_dir, tmp_path):
    """vLLM and SGLang capture aux states in ascending layer order: a head trained on [2, 0, 1] is
    exported as [0, 1, 2] with fc's column blocks moved to match, and computes the same drafts."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    head = _eagle3(target, target_dir, tmp_path / "ckpt", aux=(2, 0, 1))
    head.bind(target)
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out", target_hub_id="org/tiny")
    theirs = load_speculators(tmp_path / "out", verifier=target_dir)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    width = target.config.hidden_size
    blocks = head.fc.weight.split(width, dim=1)  # ours: layers 2, 0, 1
    assert torch.equal(theirs.fc.weight, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    assert_same_logits(head, theirs, target, [3, 917, 44, 1289, 6, 311, 2046, 30, 8, 5, 14, 22])
    # draftsmith's record in the export agrees with the sorted layers (eval/run.py loads it back).
    record = json.loads((tmp_path / "out" / "config.json").read_text())["draftsmith_export"]
    assert record["config"]["aux_layers"] == [0, 1, 2]
    export_checkpoint(tmp_path / "ckpt", "sglang", tmp_path / "sgl")
    config = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
    assert torch.equal(load_file(str(tmp_path / "sgl" / "model.safetensors"))["fc.weight"], theirs.fc.weight)


def test_engines_are_told_the_hub_id_and_the_targets_own_dtype(tmp_path):
    """``verifier.name_or_path`` is a hub id (``--target-hub-id``, or read off a hub-cache folder), the
    local folder only in draftsmith's record; the layer config and the embedding copy are in the
    target's saved dtype, not the fp32 the head was trained against."""
    tokenizer = load_tokenizer("default")
    cached = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / "0123abc"
    save_tiny_target(cached, tokenizer, scale=8.0, layers=3)
    bf16 = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.bfloat16)
    bf16.save_pretrained(cached)  # the target as published: bf16
    target = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    _eagle3(target, cached, tmp_path / "ckpt", aux=(0, 1))
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "derived")
    config = json.loads((tmp_path / "derived" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert config["draftsmith_export"]["target_folder"] == str(cached.resolve())
    assert config["transformer_layer_config"]["dtype"] == "bfloat16"
    weights = load_file(str(tmp_path / "derived" / "model.safetensors"))
    assert weights["embed_tokens.weight"].dtype == torch.bfloat16 and weights["fc.weight"].dtype == torch.float32
    export_checkpoint(tmp_path / "ckpt", "sglang", tmp_path / "sgl", target_hub_id="other/name")
    assert json.loads((tmp_path / "sgl" / "config.json").read_text())["dtype"] == "bfloat16"
    _medusa(target, cached, tmp_path / "m")
    export_checkpoint(tmp_path / "m", "medusa", tmp_path / "m-official", target_hub_id="other/name")
    assert json.loads((tmp_path / "m-official" / "config.json").read_text())["base_model_name_or_path"] == "other/name"


def test_official_medusa_head_count_is_checked(target, target_dir, tmp_path, capsys):
    heads = MedusaHeads.for_target(target, str(target_dir), num_heads=6, num_layers=1, lm_head="copy")
    heads.save_pretrained(tmp_path / "six")
    assert_user_error(
        capsys,
        r"it has 6 heads; the official Medusa code is built around 5 .*strict=False",
        export_main,
        [str(tmp_path / "six"), "--format", "medusa", "--out", str(tmp_path / "x")],
    )
    _medusa(target, target_dir, tmp_path / "three", lm_head="copy")
    export_main([str(tmp_path / "three"), "--format", "medusa", "--out", str(tmp_path / "y")])
    assert "warning: 3 Medusa heads: the official default tree (mc_sim_7b_63) is 4 deep" in capsys.readouterr().err


@pytest.mark.slow
def test_speculators_on_the_bundled_smollm2(smollm2, tmp_path):
    """The real target: ``default`` resolves to its cached local folder, and the logits agree."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from draftsmith.target import resolve_target

    model, tokenizer = smollm2
    torch.manual_seed(0)
    head = Eagle3Head.for_target(model, "default", draft_vocab=torch.arange(8192), init="random").eval()
    head.save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    # Engines are told the hub id the bundled GGUF was quantised from; draftsmith keeps the local folder.
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == DEFAULT_TARGET_HUB_ID
    local = Path(resolve_target("default")).resolve()
    assert config["draftsmith_export"]["target_folder"] == str(local)
    theirs = load_speculators(tmp_path / "out", verifier=local)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert theirs.config.transformer_layer_config.dtype == torch.float32  # the bundled folder's own dtype
    ids = tokenizer("The quick brown fox jumps over the lazy dog and keeps running")["input_ids"]
    assert_same_logits(head, theirs, model, ids)


# ---------------------------------------------------------------------------------------------
# SGLang and vLLM: the names, shapes and fields their loaders read


def _weights(folder) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype) for k, v in load_file(str(folder / "model.safetensors")).items()}


def test_sglang_eagle3_folder_has_what_llama_eagle3_reads(target, target_dir, tmp_path, capsys):
    vocab = _draft_vocab(target)
    _eagle3(target, target_dir, tmp_path / "ckpt", aux=(0, 1), draft_vocab=vocab)
    # What the trainer writes beside the head (train/loop.py): the recipe and the trainer state.
    recipe = Recipe()
    recipe.data.limit, recipe.data.max_length = 1500, 1024
    dump_recipe(recipe, tmp_path / "ckpt" / "recipe.yaml")
    (tmp_path / "ckpt" / "state").mkdir()
    (tmp_path / "ckpt" / "state" / "trainer_state.json").write_text(json.dumps({"step": 120, "tokens": 45678}))
    export_main([str(tmp_path / "ckpt"), "--format", "sglang", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert sglang_format.VERSION == SGLANG_VERSION  # the source the expectations below were read from
    h, n, cfg = 64, vocab.numel(), target.config
    # LlamaForCausalLMEagle3 (SGLang 0.5.23): architecture, own LM head of draft_vocab_size rows,
    # fc over num_aux x hidden (num_aux from eagle_config), aux ids captured at layer id + 1.
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == n and config["vocab_size"] == cfg.vocab_size
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 0], "use_aux_hidden_state": True}
    assert "norm_before_residual" not in config and not config.get("attention_bias")
    head_dim = h // cfg.num_attention_heads
    assert _weights(tmp_path / "out") == {
        "fc.weight": ((h, 2 * h), torch.float32),
        "layers.0.hidden_norm.weight": ((h,), torch.float32),
        "layers.0.input_layernorm.weight": ((h,), torch.float32),
        "layers.0.self_attn.q_proj.weight": ((cfg.num_attention_heads * head_dim, 2 * h), torch.float32),
        "layers.0.self_attn.k_proj.weight": ((cfg.num_key_value_heads * head_dim, 2 * h), torch.float32),
        "layers.0.self_attn.v_proj.weight": ((cfg.num_key_value_heads * head_dim, 2 * h), torch.float32),
        "layers.0.self_attn.o_proj.weight": ((h, cfg.num_attention_heads * head_dim), torch.float32),
        "layers.0.post_attention_layernorm.weight": ((h,), torch.float32),
        "layers.0.mlp.gate_proj.weight": ((cfg.intermediate_size, h), torch.float32),
        "layers.0.mlp.up_proj.weight": ((cfg.intermediate_size, h), torch.float32),
        "layers.0.mlp.down_proj.weight": ((h, cfg.intermediate_size), torch.float32),
        "norm.weight": ((h,), torch.float32),
        "lm_head.weight": ((n, h), torch.float32),
        "d2t": ((n,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }
    # SGLang's hot tokens: d2t + arange (llama_eagle3.load_weights).
    d2t = load_file(str(tmp_path / "out" / "model.safetensors"))["d2t"]
    assert torch.equal(d2t + torch.arange(n), vocab)
    assert (
        f"python -m sglang.launch_server --model-path {target_dir.resolve()} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {tmp_path / 'out'} --speculative-num-steps 6 --speculative-eagle-topk 3 "
        "--speculative-num-draft-tokens 12"
    ) in printed
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"# EAGLE-3 head for {target_dir}" in card
    assert "- **Training data**: `sharegpt`, first 1500 conversations, up to 1024 tokens per conversation" in card
    assert "- **Training**: 120 optimiser steps, 45,678 loss tokens" in card
    assert f"--drafter eagle3:{tmp_path / 'out'}`" in card and "not recorded with the checkpoint" in card
    assert not (tmp_path / "out" / "state").exists() and not list(tmp_path.glob(".out-*"))


def test_sglang_eagle_folder_has_what_llama_eagle_reads(target, target_dir, tmp_path, capsys):
    vocab = _draft_vocab(target)
    _eagle(target, target_dir, tmp_path / "ckpt", draft_vocab=vocab)
    export_main([str(tmp_path / "ckpt"), "--format", "sglang", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # else SGLang's lm_head would be its embedding
    weights = _weights(tmp_path / "out")
    # LlamaForCausalLMEagle: fc = nn.Linear(2h, h) with a bias; layer 0 has no input_layernorm;
    # the embedding and LM head are the target's (set_embed_and_head), so not in the folder.
    assert weights["fc.weight"] == ((64, 128), torch.float32) and weights["fc.bias"] == ((64,), torch.float32)
    assert not any(k.startswith(("embed_tokens", "lm_head", "layers.0.input_layernorm")) for k in weights)
    assert "draft_vocab" not in weights
    # The reduced vocabulary is SGLang's --speculative-token-map (load_token_map: torch.load, then ids).
    hot = tmp_path / "out" / "hot_token_map.pt"
    assert torch.equal(torch.tensor(torch.load(hot, weights_only=True)), vocab)
    assert f"--speculative-algorithm EAGLE --speculative-draft-model-path {tmp_path / 'out'}" in printed
    assert f"--speculative-token-map {hot}" in printed


def _medusa_logits(blocks: list[list[tuple]], lm_heads: list[torch.Tensor], hidden, token_map=None, vocab=None):
    """The loaders' arithmetic: x + SiLU(W x + b) per block, then each head's LM head (vLLM: scattered
    to the full vocabulary at token_map, -inf elsewhere)."""
    out = []
    for head_blocks, lm in zip(blocks, lm_heads):
        x = hidden
        for weight, bias in head_blocks:
            x = x + torch.nn.functional.silu(x @ weight.T + bias)
        logits = x @ lm.T
        if token_map is not None:
            logits = torch.full((*logits.shape[:-1], vocab), float("-inf")).index_copy_(-1, token_map, logits)
        out.append(logits)
    return torch.stack(out)


def test_vllm_medusa_layout(target, target_dir, tmp_path):
    heads = _medusa(target, target_dir, tmp_path / "ckpt", num_layers=2).bind(target)
    export_checkpoint(tmp_path / "ckpt", "vllm-medusa", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert vllm_medusa_format.VERSION == VLLM_MEDUSA_VERSION
    # MedusaConfig (vLLM 0.32.0): model_type medusa; Medusa(): blocks and one original lm_head.
    vocab = target.config.vocab_size
    assert {
        k: config[k]
        for k in (
            "model_type",
            "architectures",
            "hidden_size",
            "vocab_size",
            "num_heads",
            "num_hidden_layers",
            "truncated_vocab_size",
            "medusa_fc_bias",
            "original_lm_head",
        )
    } == {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": 64,
        "vocab_size": vocab,
        "num_heads": 3,
        "num_hidden_layers": 2,
        "truncated_vocab_size": vocab,
        "medusa_fc_bias": True,
        "original_lm_head": True,
    }
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads"/"layers": none but ours.
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = {f"blocks.{k}.layers.{j}.{p}" for k in range(3) for j in range(2) for p in ("weight", "bias")}
    assert set(tensors) == expected | {"lm_head.weight"}  # no token_map: vLLM 0.32 cannot load one
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight)
    hidden = torch.randn(5, 64)
    blocks = [
        [(tensors[f"blocks.{k}.layers.{j}.weight"], tensors[f"blocks.{k}.layers.{j}.bias"]) for j in range(2)]
        for k in range(3)
    ]
    with torch.no_grad():
        torch.testing.assert_close(
            _medusa_logits(blocks, [tensors["lm_head.weight"]] * 3, hidden), heads.logits(hidden), atol=1e-5, rtol=1e-5
        )


def test_official_medusa_layout(target, target_dir, tmp_path):
    heads = _medusa(target, target_dir, tmp_path / "ckpt", lm_head="copy").bind(target)
    export_checkpoint(tmp_path / "ckpt", "medusa", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # FasterDecoding/Medusa MedusaConfig and medusa_lm_head.pt: medusa_head[K] = Sequential(ResBlock, Linear).
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    assert config["base_model_name_or_path"] == str(target_dir.resolve())
    tensors = torch.load(tmp_path / "out" / "medusa_lm_head.pt", weights_only=True)
    assert set(tensors) == {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")} | {
        f"{k}.1.weight" for k in range(3)
    }
    assert tensors["0.1.weight"].shape == (target.config.vocab_size, 64)
    hidden = torch.randn(4, 64)
    with torch.no_grad():
        blocks = [[(tensors[f"{k}.0.linear.weight"], tensors[f"{k}.0.linear.bias"])] for k in range(3)]
        torch.testing.assert_close(
            _medusa_logits(blocks, [tensors[f"{k}.1.weight"] for k in range(3)], hidden),
            heads.logits(hidden),
            atol=1e-5,
            rtol=1e-5,
        )


def test_hf_export_is_the_draft_lm_with_its_tokenizer_and_card(target, target_dir, tmp_path):
    from draftsmith.target import target_record

    draft = derive_draft_lm(target, num_layers=1)
    save_draft_lm(draft, tmp_path / "ckpt", load_tokenizer(str(target_dir)), target_record(target, str(target_dir)))
    serve = export_checkpoint(tmp_path / "ckpt", "hf", tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 77, 1200, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, draft(ids).logits)
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert f"# draft LM for {target_dir}" in (tmp_path / "out" / "README.md").read_text()
    assert '"method": "draft_model"' in serve[0]
    # A draft LM saved without its tokenizer gets the target's.
    save_draft_lm(draft, tmp_path / "bare", None, target_record(target, str(target_dir)))
    export_checkpoint(tmp_path / "bare", "hf", tmp_path / "bare-out")
    assert (
        load_tokenizer(str(tmp_path / "bare-out"))("hello there")["input_ids"]
        == load_tokenizer(str(target_dir))("hello there")["input_ids"]
    )


# ---------------------------------------------------------------------------------------------
# Re-import: identical acceptance tables


def test_exported_folders_give_the_original_acceptance_table(tmp_path, capsys):
    from draftsmith.eval.run import main as run_main

    # A near-uniform, context-blind target repeats one token under greedy decoding: heads close to
    # the identity draft it, so the table is not all ones, and a drift in any exported weight moves
    # their near-tied logits and with them the table.
    tokenizer = load_tokenizer("default")
    target_dir = save_tiny_target(tmp_path / "target", tokenizer, scale=1.0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = [("a", "Count from one to twenty."), ("b", "Write a haiku about the sea.")]
    repeated = set()
    for _, text in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        repeated |= set(target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist())
    vocab = torch.tensor(sorted(set(_draft_vocab(target, 2000).tolist()) | repeated))
    _eagle3(target, target_dir, tmp_path / "e3", aux=(0, 1), draft_vocab=vocab, noise=0.01)
    _eagle3(target, target_dir, tmp_path / "e3s", aux=(0, 1), draft_vocab=vocab, noise=0.01)
    _eagle(target, target_dir, tmp_path / "e1", draft_vocab=vocab, noise=0.01)
    _medusa(target, target_dir, tmp_path / "m", num_layers=2, noise=0.01)
    _medusa(target, target_dir, tmp_path / "mc", lm_head="copy", noise=0.01)
    _medusa(target, target_dir, tmp_path / "mcv", lm_head="copy", noise=0.02)
    pairs = {
        "e3": ("eagle3", "speculators"),
        "e3s": ("eagle3", "sglang"),
        "e1": ("eagle", "sglang"),
        "m": ("medusa", "vllm-medusa"),
        "mc": ("medusa", "medusa"),
        "mcv": ("medusa", "vllm-medusa"),
    }
    specs = []
    for name, (kind, fmt) in pairs.items():
        export_checkpoint(tmp_path / name, fmt, tmp_path / f"{name}-{fmt}")
        option = "?budget=6" if kind == "medusa" else "?depth=3&top_k=2&budget=5"
        specs += [
            f"{kind}:{tmp_path / name}{option}&name={name}",
            f"{kind}:{tmp_path / f'{name}-{fmt}'}{option}&name={name}-x",
        ]
    # Negative control: the speculators export with a vocabulary map off by one must not pass.
    shutil.copytree(tmp_path / "e3-speculators", tmp_path / "broken")
    tensors = load_file(str(tmp_path / "broken" / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 1
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"))
    specs.append(f"eagle3:{tmp_path / 'broken'}?depth=3&top_k=2&budget=5&name=broken")
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(
        "\n".join(json.dumps({"id": str(i), "category": c, "prompt": p}) for i, (c, p) in enumerate(prompts)) + "\n"
    )
    argv = [
        "--target",
        str(target_dir),
        "--dtype",
        "float32",
        "--prompts",
        str(prompt_file),
        "--max-new-tokens",
        "24",
        "--out",
        str(tmp_path / "results"),
    ]
    for spec in specs:
        argv += ["--drafter", spec]
    summary = run_main(argv)
    capsys.readouterr()
    methods = summary["methods"]
    runs = json.loads((tmp_path / "results" / "results.json").read_text())["runs"]
    accepted = {}
    for r in runs:  # tokens accepted at every step of every prompt
        accepted.setdefault(r["method"], []).append(r["accepted"])
    for name in pairs:
        original, exported = methods[name], methods[f"{name}-x"]
        for key in (
            "acceptance_length",
            "new_tokens",
            "target_passes",
            "same_output",
            "per_position_acceptance",
            "accepted_per_step_histogram",
        ):
            assert exported[key] == original[key], (name, key)
        assert {c: e["acceptance_length"] for c, e in exported["per_category"].items()} == {
            c: e["acceptance_length"] for c, e in original["per_category"].items()
        }, name
        assert accepted[f"{name}-x"] == accepted[name], name
    assert all(methods[name]["acceptance_length"] > 2.0 for name in pairs), methods
    assert methods["broken"]["acceptance_length"] < methods["e3"]["acceptance_length"] - 0.5
    # The model card records this checkpoint's measured tau from eval/run.py's results.json.
    export_checkpoint(tmp_path / "e3", "speculators", tmp_path / "card", results=tmp_path / "results" / "results.json")
    card = (tmp_path / "card" / "README.md").read_text()
    assert f"acceptance length {methods['e3']['acceptance_length']:.3f}" in card and "e3-x" not in card


# ---------------------------------------------------------------------------------------------
# Bad input


def test_heads_a_format_cannot_hold_are_one_line_errors(target, target_dir, tmp_path, capsys):
    _medusa(target, target_dir, tmp_path / "m")
    _eagle(target, target_dir, tmp_path / "e1")
    _eagle3(target, target_dir, tmp_path / "e3", aux=(0, 1, 3))  # aux layer 3: the 3-layer target's last output
    _medusa(target, target_dir, tmp_path / "mc", lm_head="copy", draft_vocab=_draft_vocab(target))
    _medusa(target, target_dir, tmp_path / "ms", draft_vocab=_draft_vocab(target))
    cases = [
        (
            "m",
            "speculators",
            r"cannot hold medusa drafters: speculators 0\.9\.0 has models for dflash, dspark, eagle3, peagle only",
        ),
        ("e1", "speculators", r"cannot hold eagle drafters: speculators 0\.9\.0 has no EAGLE-1 model.*--format sglang"),
        ("e1", "vllm-medusa", r"cannot hold eagle drafters"),
        ("m", "hf", r"cannot hold medusa drafters: it is not a standalone language model"),
        ("e3", "sglang", r"last layer output \(aux layer 3\).*--format speculators"),
        ("e3", "speculators", r"reads aux layer 3, the target's last layer output after its final norm.*below 3"),
        ("mc", "vllm-medusa", r"per-head LM heads cover a reduced draft vocabulary"),
        (
            "ms",
            "vllm-medusa",
            r"reduced vocabulary, which vLLM 0\.32\.0 cannot load .*token_map.*draft_vocab_size: null",
        ),
        ("mc", "medusa", r"reduced vocabulary and the official layout has none"),
    ]
    for ckpt, fmt, pattern in cases:
        assert_user_error(
            capsys,
            pattern,
            export_main,
            [str(tmp_path / ckpt), "--format", fmt, "--out", str(tmp_path / f"x-{ckpt}-{fmt}")],
        )
        assert not (tmp_path / f"x-{ckpt}-{fmt}").exists()  # nothing half-written


def test_checkpoint_without_target_name_and_other_bad_input(target, target_dir, tmp_path, capsys):
    _eagle3(target, target_dir, tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    del config["target"]["name"]
    (tmp_path / "e3" / "config.json").write_text(json.dumps(config))
    out = str(tmp_path / "out")
    assert_user_error(
        capsys,
        r"does not record its target's name.*--target DIR",
        export_main,
        [str(tmp_path / "e3"), "--format", "speculators", "--out", out],
    )
    assert_user_error(
        capsys, r"--format: invalid choice", export_main, [str(tmp_path / "e3"), "--format", "onnx", "--out", out]
    )
    assert_user_error(
        capsys, r"no config\.json", export_main, [str(tmp_path / "nothing"), "--format", "speculators", "--out", out]
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert_user_error(
        capsys,
        r"--out .*full: exists and is not an empty folder",
        export_main,
        [str(tmp_path / "e3"), "--format", "speculators", "--out", str(tmp_path / "full"), "--target", str(target_dir)],
    )
    # With --target the export names that folder; exporting an export is refused.
    export_main([str(tmp_path / "e3"), "--format", "speculators", "--out", out, "--target", str(target_dir)])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"
    ] == str(target_dir.resolve())
    assert_user_error(
        capsys,
        r"already an export \(speculators\)",
        export_main,
        [out, "--format", "sglang", "--out", str(tmp_path / "again")],
    )


def test_console_script_exits_0_on_success_and_2_on_bad_input(target, target_dir, tmp_path):
    import subprocess
    import sys

    script = Path(sys.executable).with_name("draftsmith-export")  # installed by pyproject's [project.scripts]
    _eagle(target, target_dir, tmp_path / "e1")
    ok = subprocess.run(
        [script, tmp_path / "e1", "--format", "sglang", "--out", tmp_path / "out"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"--speculative-draft-model-path {tmp_path / 'out'}" in ok.stdout
    bad = subprocess.run(
        [script, tmp_path / "e1", "--format", "speculators", "--out", tmp_path / "bad"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in bad.stderr.splitlines() if "error" in line]
    assert bad.returncode == 2 and len(errors) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert errors[0].startswith("draftsmith-export: error: --format speculators cannot hold eagle drafters")


def test_cpu_medusa_recipe_trains_heads_every_medusa_format_takes():
    """recipes/smollm2-medusa.yaml: full-vocabulary heads of one block, at most 5 (vLLM and official)."""
    from draftsmith.config import load_recipe
    from draftsmith.export import medusa as official
    from draftsmith.train.medusa import MedusaRecipe

    recipe = load_recipe(MedusaRecipe, Path(__file__).resolve().parents[1] / "recipes" / "smollm2-medusa.yaml")
    drafter = recipe.drafter
    assert vllm_medusa_format.unservable(drafter.lm_head, drafter.draft_vocab_size is not None) is None
    assert drafter.draft_vocab_size is None and drafter.num_layers == 1
    assert official.MIN_HEADS <= drafter.num_heads <= official.MAX_HEADS
