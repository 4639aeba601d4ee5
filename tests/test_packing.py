"""Packing without pads (``training.packing``, issue 33 item 9).

- Rows: every conversation of an epoch lands in exactly one row, no row exceeds its capacity, and
  the epoch's rows are a function of the seed alone.
- Every trainer scores a packed batch as it scores the same conversations padded: loss and metric
  sums agree (attention, positions and scored positions stop at each conversation's boundary),
  and a reply right after a one-token prompt is never scored from the previous conversation.
- A packed run resumed from a checkpoint ends where an uninterrupted packed run does.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import save_tiny_target, write_recipe

from draftsmith.data_prep.dataset import pad_batch
from draftsmith.data_prep.packing import epoch_rows, pack_rows, segment_positions
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.peagle import PEagleHead
from draftsmith.target import load_tokenizer
from draftsmith.train.dflash import DFlashDrafterConfig, DFlashRecipe, DFlashTask
from draftsmith.train.eagle import EagleDrafterConfig, EagleRecipe, EagleTask
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.medusa import MedusaDrafterConfig, MedusaRecipe, MedusaTask
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
