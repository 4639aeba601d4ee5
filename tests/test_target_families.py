"""The target-family matrix (issue 58): EAGLE-3 on tiny random-weight targets of transformers' own
classes: Llama 3 (llama3 RoPE), Qwen3, Qwen3-MoE, gpt-oss (MoE, attention sinks, sliding layers,
YaRN), Mixtral, Gemma 3 (text), Phi-3 (fused qkv) and DeepSeek-V3 (MoE, multi-head latent
attention). For each family:

- features: the store written by ``data_prep/features.py`` holds the decoder's own last hidden
  states and aux layers, and the target loads head-only (the offline trainer's path);
- training: EAGLE-3 training-time-test steps from that store lower the loss;
- engine: greedy decoding with the trained head (and with trees holding the greedy path among wrong
  siblings) gives Hugging Face ``generate``'s own tokens;
- export: ``--format speculators`` writes a folder speculators 0.9.0's ``Eagle3DraftModel`` loads
  and whose draft logits equal ours over two training-time-test passes.

The head's decoder layer: the target's own for Llama and Qwen3 (the layers speculators and vLLM
build EAGLE-3 drafts of), a dense Llama layer of the target's shape for every other family, MoE
ones included, as speculators' trainer and SpecForge's configs build them
(:func:`draftsmith.heads.eagle3.draft_layer_config`).

And the export gate (``draftsmith-serve-check``): for each family vLLM serves with EAGLE-3 drafters
(``family_targets.SERVED``), vLLM serves the target with the export and accepts its drafts as our
engine accepts the checkpoint's; an export with a permuted weight fails it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from datasets import Dataset
from family_targets import AUX, EOS, FAMILIES, MOE, SERVED, VOCAB, save_family
from gate_helpers import assert_gate_passed, needs_vllm, run_gate
from safetensors.torch import load_file, save_file
from speculators_helpers import speculators_draft_logits
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from tree_drafters import GreedyPrefixDrafter

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.features import FeatureDataset, extract_features
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.export import export_checkpoint
from draftsmith.heads.eagle import ROUTED_OR_LATENT, EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.target import is_head_only, load_target
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.unroll import unroll

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = sorted(FAMILIES)
ROWS, LENGTH, STEPS, BATCH, LR = 8, 40, 40, 4, 1e-2
NEW_TOKENS = 32
# The gate's heads: trained on the greedy replies the gate decodes (its prompts are the rows' own), as
# long as it decodes them: vLLM drafts past the end of a reply where we do not, which at 32 tokens
# moved its rates at positions 2-3 by more than the gate's margin.
GATE_STEPS, GATE_NEW_TOKENS, GATE_DEPTH = 300, 96, 3


class Family:
    """One family's target folder, model, feature store and trained head, built once per module
    (the target's config fields changed by ``more``): ``steps`` training steps on rows of
    ``length`` tokens of the target's sampled text, or of its greedy text (``greedy``: what a greedy
    decode of the same prompts gives)."""

    def __init__(self, name: str, root, steps: int = STEPS, length: int = LENGTH, greedy: bool = False, **more):
        self.name, self.root, self.length = name, root, length
        self.folder = root / "target"
        self.model = save_family(name, self.folder, **more)
        self.rows = self._sampled_rows(greedy)
        self.store = root / "features"
        self.manifest = extract_features(self.model, {"train": self.rows}, self.store, show=False, layers=AUX)
        self.losses: list[float] = []
        self.checkpoint = root / "head"
        self._train(steps)

    def _sampled_rows(self, greedy: bool) -> Dataset:
        """The target's own sampled (or greedy) text (what regeneration gives a drafter to learn),
        loss on the replies."""
        torch.manual_seed(1)
        prompts = torch.randint(3, VOCAB, (ROWS, 8))
        with torch.no_grad():
            out = self.model.generate(
                prompts,
                max_new_tokens=self.length - 8,
                min_new_tokens=self.length - 8,
                do_sample=not greedy,
                pad_token_id=0,
            )
        ids = out.tolist()
        return Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 8 + [1] * (self.length - 8) for _ in ids]})

    def _train(self, steps: int) -> None:
        """EAGLE-3 training-time test from the stored features, the target loaded head-only."""
        target, _ = load_target(str(self.folder), dtype="float32", device="cpu", head_only=True)
        self.head_only = target
        torch.manual_seed(0)
        head = Eagle3Head.for_target(target, str(self.folder), aux_layers=AUX).train()
        drafter = Eagle3DrafterConfig(aux_layers=AUX, ttt_steps=3, draft_vocab_size=None, down_sample_ratio=1.0)
        task = Eagle3Task(Eagle3Recipe(drafter=drafter), target, head)
        data = FeatureDataset(self.store / "train")
        optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=LR)
        for step in range(steps):
            rows = [data[(step * BATCH + i) % len(data)] for i in range(BATCH)]
            loss, _ = task.loss(head, pad_batch(rows), training=True)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            self.losses.append(loss.item())
        head.eval().save_pretrained(self.checkpoint)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            built[name] = Family(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_features_are_the_decoders_own_states_and_the_target_loads_head_only(families, name):
    family = families(name)
    assert family.manifest["splits"]["train"]["conversations"] == ROWS
    identity = json.loads((family.store / "identity.json").read_text())
    assert identity["layers"] == AUX
    row = FeatureDataset(family.store / "train")[3]
    with torch.no_grad():
        out = family.model.get_decoder()(input_ids=row["input_ids"][None], output_hidden_states=True)
    torch.testing.assert_close(row["hidden"], out.last_hidden_state[0])
    torch.testing.assert_close(row["aux"], torch.cat([out.hidden_states[layer][0] for layer in AUX], dim=-1))
    assert row["loss_mask"].sum() == LENGTH - 8
    head_only = family.head_only
    assert is_head_only(head_only)
    embeds = head_only.get_input_embeddings()(row["input_ids"])
    torch.testing.assert_close(embeds, family.model.get_input_embeddings()(row["input_ids"]))
    assert torch.equal(head_only.get_output_embeddings().weight, family.model.get_output_embeddings().weight)


@pytest.mark.parametrize("name", NAMES)
def test_eagle3_head_builds_the_reference_layer_and_training_lowers_its_loss(families, name):
    family = families(name)
    head = Eagle3Head.from_pretrained(family.checkpoint, family.model)
    layer = head.layers[0]
    if name.startswith(("llama", "qwen3")) and name not in MOE:
        # The target's own decoder layer (speculators' and vLLM's llama / qwen3 EAGLE-3 layers).
        assert head.config.model_type == family.model.config.model_type
        assert isinstance(layer.self_attn, type(family.model.get_decoder().layers[0].self_attn))
    else:
        # A dense Llama layer of the target's shape: no experts, no router, no latent attention.
        assert head.config.model_type == "llama" and head.config.hidden_size == family.model.config.hidden_size
        assert type(layer.mlp).__name__ == "LlamaMLP" and type(layer.self_attn).__name__ == "LlamaAttention"
        assert not any("expert" in key or "router" in key or "gate.weight" in key for key in head.state_dict())
    assert isinstance(Eagle3Head.for_target(family.model, "x", AUX).layers[0].mlp, type(layer.mlp))
    losses = family.losses
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.92 * first, losses


@torch.no_grad()
def greedy(model, prompt: list[int]) -> list[int]:
    """The target's own greedy continuation: the argmax of a full forward, token by token (no
    cache, and no end-of-turn suppression as ``generate``'s ``min_new_tokens`` would add)."""
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_with_the_trained_head_is_the_targets_own(families, name):
    family = families(name)
    model = family.model
    drafter = build_drafter(f"eagle3:{family.checkpoint}?depth=3&top_k=2&budget=6", model)
    assert drafter.feature_layers == AUX
    for seed in (2, 3):
        prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = greedy(model, prompt)
        assert len(set(reference)) > 4  # varied text: a wrong window or cache row would show
        got = SpeculativeDecoder(model, drafter, eos_ids=set()).generate(prompt, NEW_TOKENS)
        assert got.tokens == reference, f"{name}, prompt seed {seed}"
        trees = GreedyPrefixDrafter(prompt, reference, VOCAB, seed=seed)
        assert SpeculativeDecoder(model, trees, eos_ids=set()).generate(prompt, NEW_TOKENS).tokens == reference
        assert max(trees.expected) > 1  # trees were accepted beyond the root: the cache kept scattered rows


@pytest.mark.parametrize("name", NAMES)
def test_eagle1_head_over_routed_or_latent_targets_is_a_dense_llama_layer_and_decodes_losslessly(
    families, name, tmp_path
):
    """EAGLE-1 keeps the target's own layer over dense targets and builds the reference's dense Llama
    layer over MoE and latent-attention ones (no experts, router or latent projections in the head);
    the checkpoint reloads against the target into the same layers, and greedy decoding with it is
    the target's own."""
    family = families(name)
    model = family.model
    torch.manual_seed(0)
    head = EagleHead.for_target(model, str(family.folder), init="random").eval()
    layer = head.layers[0]
    if any(getattr(model.config, field, None) for field in ROUTED_OR_LATENT):
        assert name in MOE
        assert type(layer).__name__ == "LlamaDecoderLayer" and type(layer.mlp).__name__ == "LlamaMLP"
        assert not any("expert" in key or "router" in key or "lora" in key for key in head.state_dict())
    else:
        assert name not in MOE and isinstance(layer, type(model.get_decoder().layers[0]))
    head.save_pretrained(tmp_path / "eagle")
    drafter = build_drafter(f"eagle:{tmp_path / 'eagle'}?depth=3&top_k=2&budget=6", model)
    reloaded = drafter.head.state_dict()
    assert reloaded.keys() == head.state_dict().keys()
    assert all(torch.equal(reloaded[key], value) for key, value in head.state_dict().items())
    prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    got = SpeculativeDecoder(model, drafter, eos_ids=set()).generate(prompt, NEW_TOKENS)
    assert got.tokens == greedy(model, prompt), name


@pytest.mark.parametrize("name", NAMES)
def test_speculators_export_loads_in_speculators_and_drafts_our_logits(families, name, tmp_path):
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    family = families(name)
    model = family.model
    export_checkpoint(family.checkpoint, "speculators", tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = raw["transformer_layer_config"]
    assert layer["model_type"] in ("llama", "qwen3") and layer["num_aux_hidden_states"] == len(AUX)
    assert raw["speculators_config"]["verifier"]["architectures"] == model.config.architectures
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "out")
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(family.folder)
    theirs = Eagle3DraftModel.from_pretrained(tmp_path / "out", config=config).eval()
    assert isinstance(theirs.layers[0], LlamaDecoderLayer) == (layer["model_type"] == "llama")

    head = Eagle3Head.from_pretrained(family.checkpoint, model).eval()
    ids = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    n, steps = len(ids) - 1, 2
    with torch.no_grad():
        states = model.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        features = torch.cat([states[layer] for layer in AUX], dim=-1)
        ones = torch.ones(1, len(ids), dtype=torch.long)
        ours = unroll(head, torch.tensor([ids]), features[:, :-1], ones, steps, head.feedback_input)
    logits = speculators_draft_logits(theirs, features, ids, steps)
    assert len(logits) == steps
    for step in range(steps):
        valid = n - step
        torch.testing.assert_close(
            logits[step][0, :valid], head.draft_logits(ours[step])[0, :valid], atol=1e-4, rtol=1e-4
        )


def test_every_family_stops_on_its_eos():
    """The configs' end of turn is what the matrix's targets stop on (a sanity check of the configs)."""
    assert all(FAMILIES[name]().eos_token_id == EOS for name in NAMES)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A served family's gate-shaped target (``SERVED``), a head trained on its greedy replies, its
    speculators export, and the replies' prompts as the gate's prompt file; built once per module."""
    built: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in built:
            root = tmp_path_factory.mktemp(f"served-{name}")
            length = 8 + GATE_NEW_TOKENS
            family = Family(name, root, steps=GATE_STEPS, length=length, greedy=True, **SERVED[name])
            export_checkpoint(family.checkpoint, "speculators", root / "export", draft_tokens=GATE_DEPTH)
            prompts = root / "prompts.jsonl"
            lines = [json.dumps({"prompt": " ".join(f"t{i}" for i in ids[:8])}) for ids in family.rows["input_ids"]]
            prompts.write_text("\n".join(lines) + "\n")
            built[name] = family, root / "export", prompts
        return built[name]

    return get


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("name", sorted(SERVED))
def test_vllm_serves_the_export_and_accepts_its_drafts_as_our_engine_does(served, name):
    _, export, prompts = served(name)
    code, result = run_gate(export, prompts, "--max-new-tokens", str(GATE_NEW_TOKENS))
    assert_gate_passed(code, result, GATE_DEPTH, first=0.5)


@pytest.mark.slow
@needs_vllm
def test_vllm_gate_fails_an_export_with_a_permuted_weight(served, tmp_path):
    """fc's blocks of columns rotated by one aux layer (a converter that orders the aux layers
    wrongly), on a Qwen3 target: vLLM builds its own qwen3 draft layer, not the Llama one that
    ``tests/test_serve_check_controls.py``'s broken exports run in."""
    _, export, prompts = served("qwen3")
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    fc = tensors["fc.weight"]
    tensors["fc.weight"] = fc.roll(fc.shape[1] // len(AUX), dims=1).contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    code, result = run_gate(broken, prompts, "--max-new-tokens", str(GATE_NEW_TOKENS))
    assert code == 1 and result["verdict"] == "failed" and not result["passed"], result
    assert result["reasons"][0].startswith("position 1:")
    first = result["positions"][0]
    assert first["vllm"] < first["ours"] - first["margin"]
