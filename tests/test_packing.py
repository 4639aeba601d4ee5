"""Packing without pads (``training.packing``, issue 33 item 9).

- Rows: every conversation of an epoch lands in exactly one row, no row exceeds its capacity, and
  the epoch's rows are a function of the seed alone.
- Every trainer scores a packed batch as it scores the same conversations padded: loss and metric
  sums agree (attention, positions and scored positions stop at each conversation's boundary),
  and a reply right after a one-token prompt is never scored from the previous conversation.
- A packed run resumed from a checkpoint ends where an uninterrupted packed run does.
- The target computes a packed row's states as it computes each conversation alone (issue 42 item 2):
  sliding-window layers (Mistral-style on every layer, Gemma-3 / gpt-oss mixed with full layers)
  keep their window, under sdpa and eager attention, for the frozen target and Medusa-2's LoRA.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import save_tiny_target, write_recipe
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.packing import epoch_rows, pack_rows, segment_positions, target_inputs
from draftsmith.errors import UserError
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.peagle import PEagleHead
from draftsmith.target import load_tokenizer
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashRecipe, DFlashTask
from draftsmith.train.eagle import EagleDrafterConfig, EagleRecipe, EagleTask
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.fused import fused_target_features
from draftsmith.train.medusa import LoraSettings, MedusaDrafterConfig, MedusaRecipe, MedusaTask
from draftsmith.train.peagle import PEagleDrafterConfig, PEagleRecipe, PEagleTask

pytestmark = pytest.mark.usefixtures("one_thread")

V = 48


def test_rows_hold_every_conversation_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(3000)] + [100, 100]
    rows = pack_rows(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 100
    assert len(rows) < 1.03 * sum(lengths) / 100 + 1  # best-fit decreasing: nearly no room left
    epoch = epoch_rows(len(lengths), lengths, 100, 8, seed=3)
    assert sorted(i for row in epoch for i in row) == list(range(len(lengths)))  # windows carry their rest over
    assert max(sum(lengths[i] for i in row) for row in epoch) <= 100
    assert epoch == epoch_rows(len(lengths), lengths, 100, 8, seed=3) != epoch_rows(len(lengths), lengths, 100, 8, 4)


def test_packed_batch_restarts_positions_at_each_conversation():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [0, 1]}]
    batch = pad_batch([rows, rows[:1]])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    real = batch["attention_mask"].bool()
    assert torch.equal(segment_positions(batch["attention_mask"])[real], batch["position_ids"][real])
    assert "position_ids" not in pad_batch(rows)  # padded batches keep their format


def _conversations() -> list[dict]:
    """Three conversations; the second's reply starts right after a one-token prompt."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for length, prompt in ((11, 4), (7, 1), (9, 3)):
        ids = torch.randint(2, V, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


@pytest.fixture(scope="module")
def target(make_tiny_llama):
    return make_tiny_llama(vocab_size=V, hidden_size=32, layers=3, seed=3, scale=10.0)


def _perturbed(head):
    torch.manual_seed(1)
    with torch.no_grad():  # move every weight off its start so the test sees the head's own
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return head.eval()


def _eagle(target):
    torch.manual_seed(1)
    head = _perturbed(EagleHead.for_target(target, "tiny", 1, None, "random"))
    drafter = EagleDrafterConfig(ttt_steps=3, top_k_loss=4, feature_noise=0.0)  # noise: drawn per batch layout
    return EagleTask(EagleRecipe(drafter=drafter), target, head)


def _eagle3(target):
    torch.manual_seed(1)
    head = _perturbed(Eagle3Head.for_target(target, "tiny", [0, 1, 2], torch.arange(0, V, 2), "random"))
    # Every position (chain sampling draws other rows in the two layouts).
    drafter = Eagle3DrafterConfig(ttt_steps=3, aux_layers=[0, 1, 2], down_sample_ratio=1.0, draft_vocab_size=24)
    return Eagle3Task(Eagle3Recipe(drafter=drafter), target, head)


def _peagle(target):
    torch.manual_seed(1)
    head = _perturbed(PEagleHead.for_target(target, "tiny", [0, 1, 2], None, "random", mask_token_id=1, num_depths=3))
    drafter = PEagleDrafterConfig(ttt_steps=3, aux_layers=[0, 1, 2], down_sample_ratio=1.0, draft_vocab_size=None)
    return PEagleTask(PEagleRecipe(drafter=drafter), target, head)


def _medusa(target):
    torch.manual_seed(1)
    heads = _perturbed(MedusaHeads.for_target(target, "tiny", 3, 1, "shared", None))
    return MedusaTask(MedusaRecipe(drafter=MedusaDrafterConfig(num_heads=3)), target, heads)


def _dflash(target):
    """Anchors at every candidate (more allowed than there are): the same blocks in both layouts."""
    torch.manual_seed(1)
    head = _perturbed(DFlashHead.for_target(target, "tiny", [0, 1, 2], 1, 4, 1, None))
    drafter = DFlashDrafterConfig(aux_layers=[0, 1, 2], block_size=4, anchors_per_sequence=64, draft_vocab_size=None)
    return DFlashTask(DFlashRecipe(drafter=drafter), target, head)


TASKS = {"eagle_hass": _eagle, "eagle3": _eagle3, "peagle": _peagle, "medusa": _medusa, "dflash": _dflash}


@pytest.mark.parametrize("kind", sorted(TASKS))
@pytest.mark.parametrize("training", [False, True])
def test_a_packed_batch_scores_what_the_padded_conversations_score(target, kind, training):
    task = TASKS[kind](target)
    rows = _conversations()
    padded = pad_batch(rows)
    packed = pad_batch([rows[:2], rows[2:]])  # two conversations in one row, one in the other
    results = []
    for batch in (padded, packed):
        task.model.zero_grad()
        loss, metrics = task.loss(task.model, batch, training=training)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in task.model.parameters() if p.grad is not None])
        results.append((loss.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert metrics_a["tokens"] == metrics_b["tokens"] > 0
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_b[key] == pytest.approx(metrics_a[key], rel=1e-4, abs=1e-4), key
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_b, grads_a, rtol=1e-4, atol=1e-5 * grads_a.abs().max().item())


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_reply_after_a_one_token_prompt_is_not_scored_from_the_previous_conversation(target, kind):
    """Packed after another, the second conversation's first reply tokens lie 2, 3, ... places after
    the first conversation's last positions: those positions must not score them."""
    task = TASKS[kind](target)
    first, second = _conversations()[:2]
    _, alone = task.loss(task.model, pad_batch([first, second]), training=False)
    _, packed = task.loss(task.model, pad_batch([[first, second]]), training=False)
    supervised = sum(sum(r["loss_mask"][2:]) for r in (first, second))
    if kind == "eagle3":  # depth d scores token t + d + 1 of position t's own conversation
        assert alone["rows@1"] == packed["rows@1"] == supervised
        assert alone["rows@3"] == packed["rows@3"]
    else:
        assert alone["head1/tokens"] == packed["head1/tokens"] == supervised
        assert alone["head3/tokens"] == packed["head3/tokens"]


WINDOWED = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4}


def _windowed_target(kind: str, attention: str):
    """A random-weight target whose sliding window (4) is shorter than every conversation, its
    weights scaled up so that attention past the window changes the states."""
    size = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, **WINDOWED}
    if kind == "mistral":  # one window on every layer (one mask)
        model, config = MistralForCausalLM, MistralConfig(num_hidden_layers=2, **size)
    elif kind == "gemma3":  # sliding and full layers (a mask per layer type)
        layers = ["sliding_attention", "sliding_attention", "full_attention"]
        model, config = Gemma3ForCausalLM, Gemma3TextConfig(num_hidden_layers=3, layer_types=layers, **size)
    else:  # gpt-oss: attention sinks, mixture of experts, eager attention only
        layers = ["sliding_attention", "full_attention"]
        experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
        model, config = GptOssForCausalLM, GptOssConfig(num_hidden_layers=2, layer_types=layers, **experts, **size)
    config._attn_implementation = attention
    torch.manual_seed(5)
    target = model(config).eval()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    return target


@pytest.mark.parametrize(
    "kind, attention",
    [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"), ("mistral", "eager")]
    + [("gemma3", "sdpa"), ("gemma3", "eager"), ("gpt_oss", "eager")],
)
def test_a_packed_row_gives_each_conversation_the_target_states_it_has_alone(make_tiny_llama, kind, attention):
    """Every layer's states (what any head reads) of each conversation in a packed row equal those
    of that conversation run alone, with sliding windows shorter than the conversations."""
    if kind == "llama":
        target = make_tiny_llama(vocab_size=V, hidden_size=32, layers=3, seed=3, scale=10.0)
        target.config._attn_implementation = attention
    else:
        target = _windowed_target(kind, attention)
    layers = list(range(target.config.num_hidden_layers + 1))
    rows = _conversations()
    aux, last = fused_target_features(target, layers, pad_batch([rows[:2], rows[2:]]))
    at = [(0, 0), (0, len(rows[0]["input_ids"])), (1, 0)]  # (row, start) of each conversation
    for conversation, (row, start) in zip(rows, at):
        alone_aux, alone_last = fused_target_features(target, layers, pad_batch([conversation]))
        end = start + len(conversation["input_ids"])
        torch.testing.assert_close(aux[row, start:end], alone_aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last[row, start:end], alone_last[0], rtol=1e-5, atol=1e-5)


def test_packing_refuses_a_target_whose_layers_it_cannot_cut_at_conversation_boundaries():
    """Qwen3-Next's linear-attention layers carry a recurrent state no mask stops: a user error."""
    size = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, **WINDOWED}
    linear = {"linear_num_key_heads": 2, "linear_num_value_heads": 2}
    linear |= {"linear_key_head_dim": 8, "linear_value_head_dim": 8}
    config = Qwen3NextConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=2, **linear, **size
    )
    decoder = Qwen3NextForCausalLM(config).get_decoder()
    rows = _conversations()
    assert target_inputs(pad_batch(rows), decoder)["attention_mask"] is not None  # padded batches still train
    with pytest.raises(UserError, match="training.packing: the target's linear_attention layers"):
        target_inputs(pad_batch([rows[:2], rows[2:]]), decoder)


def test_medusa2_scores_a_packed_batch_as_the_padded_conversations_with_a_sliding_window():
    """Medusa-2's LoRA target (and its frozen reference for the distillation term) keeps the window
    on a packed batch: loss, metrics and gradients equal the padded conversations'."""
    target = _windowed_target("mistral", "sdpa")
    torch.manual_seed(1)
    heads = _perturbed(MedusaHeads.for_target(target, "tiny", 3, 1, "shared", None))
    drafter = MedusaDrafterConfig(num_heads=3, lora=LoraSettings(enabled=True, dropout=0.0, target_modules=["q_proj"]))
    task = MedusaTask(MedusaRecipe(drafter=drafter), target, heads)
    with torch.no_grad():  # adapters start as a no-op (B = 0): move them so the tuned target differs
        for name, param in task.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.3)
    rows = _conversations()
    results = []
    for batch in (pad_batch(rows), pad_batch([rows[:2], rows[2:]])):
        task.model.zero_grad()
        loss, metrics = task.loss(task.model, batch, training=True)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in task.model.parameters() if p.grad is not None])
        results.append((loss.detach(), metrics, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert metrics_a["target/tokens"] == metrics_b["target/tokens"] > 0
    for key in metrics_a:
        assert metrics_b[key] == pytest.approx(metrics_a[key], rel=1e-4, abs=1e-4), key
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_b, grads_a, rtol=1e-4, atol=1e-5 * grads_a.abs().max().item())


def test_packed_resume_equals_uninterrupted(tmp_path):
    """A packed EAGLE-3 run stopped after 2 steps and resumed ends with the uninterrupted run's weights."""
    from draftsmith.train import eagle3

    tokenizer = load_tokenizer("default")
    folder = save_tiny_target(tmp_path / "target", tokenizer, scale=8.0)
    words = random.Random(0).choices(["alpha", "beta", "gamma", "delta", "the", "of", "and"], k=2000)
    records = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": " ".join(words[i : i + 2 + i % 5])},
                {"from": "gpt", "value": " ".join(words[100 + i : 100 + i + 3 + 3 * (i % 7)])},
            ],
        }
        for i in range(40)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    drafter = {"ttt_steps": 2, "aux_layers": [0, 1, 2], "draft_vocab_size": 64}
    recipe = write_recipe(
        tmp_path,
        folder,
        drafter,
        data={"path": str(data), "limit": 40, "max_length": 128, "regenerate": {"enabled": False}},
        packing=True,
        batch_size=2,
        max_steps=4,
        save_every=2,
    )
    whole = eagle3.main([str(recipe), "--output_dir", str(tmp_path / "whole")])
    assert whole.max_steps == 4
    assert whole.state.tokens > 4 * 2 * 20  # several replies a row
    cut = ["--output_dir", str(tmp_path / "cut")]
    assert eagle3.main([str(recipe), *cut, "--training.stop_after_steps", "2"]).state.step == 2
    resumed = eagle3.main([str(recipe), *cut, "--resume"])
    assert resumed.state.step == 4
    assert resumed.state.tokens == whole.state.tokens > 0
    a = load_file(str(tmp_path / "whole" / "checkpoint-final" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint-final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
