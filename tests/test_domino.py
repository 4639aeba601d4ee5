"""Domino: the drafter's sequential chain is what the teacher-forced training pass scores (and the
correction head is really in it), drafting is lossless (greedy identical, sampling distributed as
the target), the head round-trips through its checkpoint and another kind's checkpoint is refused
in one line, training lowers the loss on a fixed batch with the references' base-loss schedule and
a frozen LM head, the export holds the reference's names and fields and loads in ModelOpt's own
``DominoModule`` with the same forward, and vLLM's gate declines it with its reason.

Tiny random-weight Llama targets (built from a config) keep these fast.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import user_error
from safetensors.torch import load_file
from stats_helpers import SAMPLES, assert_distributed_as_target
from training_helpers import greedy_rows, save_tiny_target, write_recipe
from transformers import AutoModelForCausalLM, DynamicCache

from draftsmith.errors import CheckpointError, UsageError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.base import DraftContext
from draftsmith.eval.engine.drafters.domino import DominoDrafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.heads.domino import DominoHead
from draftsmith.target import load_tokenizer
from draftsmith.train.domino import DominoDrafterConfig, DominoRecipe, DominoTask, base_loss_weight

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 7, 4]


@pytest.fixture(scope="module")
def tiny_target(make_tiny_llama):
    """8 tokens, peaked (weights x 15), 3 layers for the 3 aux layers; token 7 is also the mask."""
    return make_tiny_llama(vocab_size=8, hidden_size=32, layers=3, seed=0, scale=15.0)


def _head(target, mask: int, block: int = 4, seed: int = 1, **options) -> DominoHead:
    torch.manual_seed(seed)
    options.setdefault("gru_hidden_dim", 16)
    options.setdefault("emb_dim", 8)
    head = DominoHead.for_target(target, "tiny", [1, 2, 3], 2, block, mask, None, **options)
    with torch.no_grad():  # norms start at 1: move every weight so the test sees them all
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.3)
        head.lm_head.weight.copy_(target.lm_head.weight)  # the target's, as training keeps it
        head.embed_proj[2].weight.mul_(20.0)  # a correction as large as the logits, so that it changes choices
    return head.eval()


def _features(target, ids: list[int]) -> torch.Tensor:
    out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[layer] for layer in (1, 2, 3)], dim=-1)


def _training_logits(head: DominoHead, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The corrected logits :meth:`DominoTask.token_terms` scores, for one block's every drafting slot."""
    task = DominoTask(DominoRecipe(drafter=DominoDrafterConfig(block_size=head.block_size)), None, head)
    supervised = torch.ones(1, 1, len(previous), dtype=torch.bool)
    vocab = head.lm_head.out_features
    probs = torch.full((len(previous), vocab), 1.0 / vocab)
    _, _, logits, _ = task.token_terms(head, hidden[None, None], previous[None, None], supervised, probs, probs, 1.0)
    return logits


@pytest.mark.parametrize("shift_label", [True, False], ids=["shift-label", "dflash-layout"])
def test_the_drafted_chain_is_the_argmax_of_the_teacher_forced_block(make_tiny_llama, shift_label):
    """Through the engine's protocol the drafter's greedy chain is, at every depth, the argmax of the
    corrected logits the training pass computes for the whole block at once (its GRU teacher-forced
    with that chain): the sequential loop and the training pass are one model. Negative controls:
    the backbone's logits alone draft another chain, and so does the drafter with its correction
    zeroed; depth 1 (pure_draft_prefix_len 1) is the backbone's choice either way."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, block=5, shift_label=shift_label)
    ids = [3, 9, 4, 17, 6, 11, 2, 30]
    a = 6
    depth = head.draft_slots
    assert depth == (5 if shift_label else 4)
    with torch.no_grad():
        features = _features(target, ids)
        drafter = DominoDrafter(head)
        drafter.begin(ids[: a + 1], features[0, :a])
        chain = drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10)).tokens
        assert len(chain) == depth
        cache = DynamicCache()
        head.add_context(cache, features[:, :a], torch.arange(a)[None])
        slots = depth + 1 - head.shift
        block = torch.tensor([[ids[a]] + [47] * (slots - 1)])
        everything = torch.ones(1, 1, slots, a + slots, dtype=torch.bool)
        hidden = head(block, a + torch.arange(slots)[None], cache, everything)[0]
        previous = torch.tensor([ids[a], *chain[:-1]])
        logits = _training_logits(head, hidden, previous)
        assert logits.argmax(-1).tolist() == chain
        base = head.lm_head(head.norm(hidden[1 - head.shift :])).argmax(-1).tolist()
        assert base[0] == chain[0] and base != chain
        ablated = DominoDrafter(head, correction=0)  # correction=0: the backbone's chain
        ablated.begin(ids[: a + 1], features[0, :a])
        assert ablated.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10)).tokens == base
        head.embed_proj[2].weight.zero_()
        drafter.begin(ids[: a + 1], features[0, :a])
        assert drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10)).tokens != chain


def test_greedy_domino_is_lossless(tiny_target, tmp_path):
    """Greedy output equals plain decoding, every step drafting the block's tokens in one pass of the
    layers, with the correction and without it (``correction=0``); a depth beyond the block and a
    correction other than 0 or 1 are refused before any drafting."""
    head = _head(tiny_target, mask=7, block=4)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = build_drafter(f"domino:{tmp_path / 'ckpt'}", tiny_target)
    assert isinstance(drafter, DominoDrafter) and drafter.depth == 4
    calls = []
    drafter.head.register_forward_hook(lambda *args: calls.append(1))
    plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
    sizes, accepted = [], 0
    for prompt in (PROMPT, [1, 1, 6], list(range(8)) * 3):
        want = plain.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == want.tokens
        sizes += got.drafted
        accepted += sum(got.accepted)
    assert len(calls) == sum(1 for n in sizes if n) and max(sizes) == 4
    assert accepted > 0
    backbone = build_drafter(f"domino:{tmp_path / 'ckpt'}?correction=0", tiny_target)
    ablated = SpeculativeDecoder(tiny_target, backbone, None, eos_ids=set())
    assert ablated.generate(PROMPT, 40).tokens == plain.generate(PROMPT, 40).tokens
    with pytest.raises(UsageError, match="correction"):
        build_drafter(f"domino:{tmp_path / 'ckpt'}?correction=2", tiny_target)
    with pytest.raises(UsageError, match="depth"):
        build_drafter(f"domino:{tmp_path / 'ckpt'}?depth=5", tiny_target)


def test_sampling_matches_the_exact_distribution(tiny_target):
    """The correction depends on the drafted tokens alone, never on the target: recursive rejection
    sampling over the chain stays exact."""
    head = _head(tiny_target, mask=7, block=3, seed=2)
    accepted = assert_distributed_as_target(tiny_target, DominoDrafter(head), PROMPT, 4, SAMPLES)
    assert sum(n for a, n in accepted.items() if max(a) > 1) > 100, accepted


def test_the_checkpoint_round_trips_and_another_kinds_is_refused(tiny_target, tmp_path):
    """Saved and loaded, the head has the same weights and settings; a DFlash checkpoint given as
    ``domino:`` is refused with one line naming both kinds."""
    from draftsmith.heads.dflash import DFlashHead

    head = _head(tiny_target, mask=7, block=4, shift_label=False, pure_draft_prefix_len=2)
    head.save_pretrained(tmp_path / "ckpt")
    back = DominoHead.from_pretrained(tmp_path / "ckpt", tiny_target)
    assert (back.shift_label, back.pure_draft_prefix_len, back.draft_slots) == (False, 2, 3)
    assert (back.prefix_gru.hidden_size, back.embed_proj[0].out_features) == (16, 8)
    want = head.state_dict()
    assert set(back.state_dict()) == set(want)
    for name, value in back.state_dict().items():
        assert torch.equal(value, want[name]), name
    DFlashHead.for_target(tiny_target, "tiny", [1, 2, 3], 1, 4, 7).save_pretrained(tmp_path / "dflash")
    with pytest.raises(CheckpointError) as refused:
        build_drafter(f"domino:{tmp_path / 'dflash'}", tiny_target)
    line = str(refused.value)
    assert "dflash" in line and "domino" in line and "\n" not in line, line


def test_the_base_loss_weight_falls_linearly_to_zero():
    """lambda: ``start`` at the run's start, 0 from ``decay`` of it on (the references' schedule)."""
    assert [base_loss_weight(p, 1.0, 1.0) for p in (0.0, 0.25, 1.0)] == [1.0, 0.75, 0.0]
    assert [base_loss_weight(p, 0.8, 0.5) for p in (0.0, 0.25, 0.5, 0.9)] == pytest.approx([0.8, 0.4, 0.0, 0.0])


def test_the_backbone_warmup_holds_lambda_at_one_then_runs_the_schedule_over_the_rest():
    """With a warm-up, lambda is 1 through it and the references' schedule over the rest of the run."""
    weights = [base_loss_weight(p, 1.0, 1.0, 0.5) for p in (0.0, 0.49, 0.5, 0.75, 1.0)]
    assert weights == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0])
    assert base_loss_weight(0.6, 0.8, 0.5, 0.2) == pytest.approx(0.0)  # decay ends at 0.2 + 0.5 * 0.8


def test_the_backbone_warmup_is_the_backbones_cross_entropy_over_its_tokens(make_tiny_llama):
    """A warm-up step scores the backbone alone over the warm-up's tokens with the target's frozen
    rows for them: over every token (in another order) it equals the full-vocabulary step at lambda
    1, gradients included, and the GRU and correction get none; over fewer, each slot's loss is the
    hand-computed cross-entropy over those columns and labels outside them score nothing."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=4, seed=3, scale=10.0)
    head = _head(target, mask=47, block=4).train()
    ids = greedy_rows(target, [[3, 9, 4, 17], [6, 11, 2, 30]], 36)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": (torch.arange(36) >= 4).long().expand(2, -1),
    }

    def step(warmup: float, vocab: torch.Tensor | None):
        drafter = DominoDrafterConfig(
            aux_layers=[1, 2, 3], block_size=4, anchors_per_sequence=8, labels="data", backbone_warmup=warmup
        )
        if vocab is not None:
            head.register_buffer("warmup_vocab", vocab, persistent=False)
        task = DominoTask(DominoRecipe(drafter=drafter), target, head)
        task.on_progress(0.0)
        head.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # the same anchors every call
        loss, metrics = task.loss(head, batch, training=True)
        loss.backward()
        return (
            task,
            loss.detach(),
            metrics,
            {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None},
        )

    every = torch.randperm(48, generator=torch.Generator().manual_seed(2))
    task, loss, metrics, grads = step(0.5, every)
    assert task.warming and task.base_weight == 1.0
    _, want, want_metrics, want_grads = step(0.0, None)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    assert metrics["top1@1"] == want_metrics["top1@1"] and metrics["tokens"] == want_metrics["tokens"] > 20
    assert not any(name.startswith(("prefix_gru", "embed_proj")) for name in grads), sorted(grads)
    assert float(want_grads["embed_proj.2.weight"].abs().sum()) == 0  # lambda 1: the correction learns nothing either
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-4, msg=name)

    few = torch.tensor([0, 4, 9, 17, 30, 11, 2, 6, 3, 25])
    task, loss, _, _ = step(0.5, few)
    with torch.no_grad():  # held out: the full vocabulary, warm-up or not
        held_out = task.loss(head, batch, training=False)
        want_held_out = DominoTask(DominoRecipe(drafter=replace(task.cfg, backbone_warmup=0.0)), target, head).loss(
            head, batch, training=False
        )
    torch.testing.assert_close(held_out[0], want_held_out[0])
    assert held_out[1]["top1@1"] == want_held_out[1]["top1@1"]
    assert abs(float(loss - want)) > 1e-3
    task.warm_step = True  # as in a training step of the warm-up
    to_columns, columns = task.scored_vocab()
    assert torch.equal(columns, few) and to_columns(torch.tensor([17, 5])).tolist() == [3, -1]
    hidden = torch.randn(1, 1, 4, 32)
    labels = torch.tensor([9, 5, 30, 47])
    coeff = to_columns(labels)
    supervised = torch.ones(1, 1, 4, dtype=torch.bool)
    ce, _, logits, _ = task.token_terms(head, hidden, labels[None, None], supervised, coeff, None, coeff >= 0)
    with torch.no_grad():
        want_logits = head.norm(hidden[0, 0]) @ target.lm_head.weight[few].T
    torch.testing.assert_close(logits, want_logits)
    kept = coeff >= 0
    assert kept.tolist() == [True, False, True, False]
    want_ce = F.cross_entropy(want_logits[kept], coeff[kept], reduction="none")
    torch.testing.assert_close(ce[kept], want_ce, atol=1e-5, rtol=1e-5)
    assert float(ce[~kept].detach().abs().sum()) == 0


def test_training_steps_lower_the_loss_on_a_fixed_batch(tmp_path):
    """A few optimiser steps on one batch lower DominoTask's loss; while lambda is 1 the loss is the
    backbone's alone (the correction's gradient is 0), once it reaches 0 the correction's is the
    loss; the LM head stays the target's (frozen)."""
    folder = save_tiny_target(tmp_path / "target", load_tokenizer("default"), scale=8.0, layers=3)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    head = DominoHead.for_target(target, str(folder), [1, 2, 3], 1, 4, 16, None, gru_hidden_dim=16, emb_dim=8)
    head.lm_head.weight.requires_grad_(False)
    drafter = DominoDrafterConfig(block_size=4, anchors_per_sequence=8)
    task = DominoTask(DominoRecipe(drafter=drafter), target, head)
    ids = torch.randint(100, 400, (2, 40), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": (torch.arange(40) >= 4)[None]}
    batch["loss_mask"] = batch["loss_mask"].expand(2, -1).long()

    def loss(progress: float) -> torch.Tensor:
        task.on_progress(progress)
        torch.manual_seed(7)  # the same anchors every call: one fixed batch
        return task.loss(head, batch, True)[0]

    loss(0.0).backward()
    assert float(head.embed_proj[0].weight.grad.abs().sum()) == 0 and float(head.fc.weight.grad.abs().sum()) > 0
    head.zero_grad(set_to_none=True)
    loss(1.0).backward()
    assert float(head.embed_proj[0].weight.grad.abs().sum()) > 0
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    lm_head = head.lm_head.weight.clone()
    with torch.no_grad():
        first = float(loss(0.5))
    for _ in range(12):
        optimizer.zero_grad()
        loss(0.5).backward()
        optimizer.step()
    with torch.no_grad():
        last = float(loss(0.5))
    assert last < first - 0.3, (first, last)
    assert torch.equal(head.lm_head.weight, lm_head)


def test_data_labels_on_greedy_data_train_the_mixed_loss_as_ce_on_the_targets_argmax(make_tiny_llama):
    """With ``labels: data`` on the target's greedy replies, Domino's mixed loss (lambda 0.4: the
    corrected and backbone logits) and its gradients are ``labels: target`` under ``objective: ce``'s,
    without the target's LM head; on other data they differ (negative control)."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=4, seed=3, scale=10.0)
    head = _head(target, mask=47, block=4).train()
    greedy = greedy_rows(target, [[3, 9, 4, 17], [6, 11, 2, 30]], 36)
    noisy = torch.randint(2, 47, greedy.shape, generator=torch.Generator().manual_seed(4))
    loss_mask = (torch.arange(36) >= 4).long().expand(2, -1)

    def step(labels: str, ids: torch.Tensor):
        drafter = DominoDrafterConfig(
            aux_layers=[1, 2, 3], block_size=4, anchors_per_sequence=8, labels=labels, objective="ce"
        )
        task = DominoTask(DominoRecipe(drafter=drafter), target, head)
        task.on_progress(0.6)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        head.zero_grad()
        loss, metrics = task.loss(head, batch, training=False)
        loss.backward()
        return loss.detach(), metrics, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    (loss, metrics, grads), (want, want_metrics, want_grads) = step("data", greedy), step("target", greedy)
    assert base_loss_weight(0.6, 1.0, 1.0) == pytest.approx(0.4) and metrics["tokens"] > 20
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    assert metrics["top1@2"] == want_metrics["top1@2"] and metrics["tokens"] == want_metrics["tokens"]
    assert grads.keys() == want_grads.keys() and "embed_proj.2.weight" in grads
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert abs(float(step("data", noisy)[0] - step("target", noisy)[0])) > 1e-2


@pytest.fixture(scope="module")
def domino_run(tmp_path_factory):
    """A tiny Domino drafter trained 8 steps through draftsmith-train's path (the recipe, the trainer
    and its progress hook), ShareGPT text without regeneration."""
    from draftsmith.train.domino import main

    root = tmp_path_factory.mktemp("domino")
    target = save_tiny_target(root / "target", load_tokenizer("default"), scale=8.0, layers=3)
    drafter = {
        "kind": "domino",
        "aux_layers": [1, 2, 3],
        "num_layers": 1,
        "block_size": 4,
        "anchors_per_sequence": 8,
        "gru_hidden_dim": 16,
        "emb_dim": 8,
    }
    data = {"regenerate": {"enabled": False}, "limit": 8, "held_out_fraction": 0.25}
    recipe = write_recipe(root, target, drafter, data=data, learning_rate=1e-2, max_steps=8, log_every=2)
    return main([str(recipe), "--output_dir", str(root / "run")]), recipe


def test_a_recipe_run_trains_the_correction_with_the_target_lm_head(domino_run):
    """The run's checkpoint is a Domino drafter of the recipe's settings whose LM head is the target's
    (frozen), with the correction trained off its zero-gradient start."""
    trainer, recipe = domino_run
    target = AutoModelForCausalLM.from_pretrained(recipe.parent / "target", dtype=torch.float32)
    head = DominoHead.from_pretrained(trainer.last_checkpoint, target)
    assert (head.block_size, head.draft_slots, head.shift_label, head.pure_draft_prefix_len) == (4, 4, True, 1)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    torch.manual_seed(0)  # the run's seed: the head's initial weights
    fresh = DominoHead.for_target(target, "t", [1, 2, 3], 1, 4, 16, None, gru_hidden_dim=16, emb_dim=8)
    assert not torch.equal(head.embed_proj[2].weight, fresh.embed_proj[2].weight)
    assert len([h for h in trainer.history if "train/loss" in h]) == 4


def test_a_run_with_a_backbone_warmup_trains_its_tokens_then_the_full_vocabulary(domino_run, tmp_path):
    """Through draftsmith-train's path: lambda is logged at 1 through the warm-up and falls after it,
    held-out evaluations score the full vocabulary even inside the warm-up, and the checkpoint is
    the reference's (no warm-up vocabulary saved; the LM head still the target's)."""
    from draftsmith.train.domino import main

    _, recipe = domino_run
    warmup = ["--drafter.labels", "data", "--drafter.backbone_warmup", "0.5", "--drafter.backbone_warmup_vocab", "64"]
    trainer = main([str(recipe), "--output_dir", str(tmp_path / "run"), *warmup, "--training.eval_every", "2"])
    lambdas = [h["train/base_weight"] for h in trainer.history if "train/base_weight" in h]
    assert lambdas[:2] == [1.0, 1.0] and lambdas[-1] < 0.5, lambdas
    assert len(trainer.task.model.warmup_vocab) == 64  # the most frequent reply tokens, special ones included
    evals = [h for h in trainer.history if "eval/ce_loss" in h]
    assert evals and all(h["eval/ce_loss"] > 0 for h in evals)
    state = load_file(trainer.last_checkpoint / "model.safetensors")
    assert not any("warmup" in name for name in state), sorted(state)
    target = AutoModelForCausalLM.from_pretrained(recipe.parent / "target", dtype=torch.float32)
    head = DominoHead.from_pretrained(trainer.last_checkpoint, target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (
            ["--drafter.backbone_warmup", "0.5"],
            "drafter.backbone_warmup = 0.5 learns the data's tokens and drafter.labels is target here (auto",
        ),
        (["--drafter.backbone_warmup", "1"], "drafter.backbone_warmup"),
        (
            ["--drafter.labels", "data", "--drafter.backbone_warmup", "0.5", "--distributed.backend", "deepspeed"]
            + ["--distributed.zero_stage", "3"],
            "drafter.backbone_warmup reads the frozen LM head's rows for its tokens, which ZeRO-3 partitions",
        ),
        (["--drafter.draft_vocab_size", "512"], "drafter.draft_vocab_size"),
        (["--drafter.train_lm_head", "true"], "drafter.train_lm_head"),
        (["--drafter.pure_draft_prefix_len", "4"], "drafter.pure_draft_prefix_len"),
        (["--drafter.base_loss_decay", "0"], "drafter.base_loss_decay"),
        (["--drafter.confidence_head", "true"], "drafter.learn_mask_embedding / confidence_head"),
        (["--drafter.labels", "data", "--drafter.objective", "rkl"], "drafter.objective rkl needs the target's"),
        (["--drafter.labels", "soft"], "drafter.labels"),
    ],
)
def test_a_recipe_out_of_range_is_one_line_before_any_model_loads(domino_run, capsys, override, field):
    from draftsmith.train.domino import main

    _, recipe = domino_run
    assert field in user_error(capsys, main, [str(recipe), *override])


REFERENCE_HEAD = {"mask_token_id", "target_layer_ids", "projector_type", "pure_draft_prefix_len", "emb_dim"}
REFERENCE_HEAD |= {"gru_hidden_dim", "shift_label"}  # SpecForge's configs/qwen3-8b-domino.json dflash_config


def test_the_export_is_the_reference_folder_and_vllm_declines_it(domino_run, tmp_path, capsys):
    """``--format sglang`` writes the reference's folder: ``DFlashDraftModel`` with a Domino
    ``dflash_config`` (SpecForge's field set; ``target_layer_ids`` one less than our aux layers),
    ``emb_dim`` at the top too, the weights under the reference's flat names with no embedding and
    no LM head, and the SGLang command. ``--format speculators`` and vLLM's gate are refused in one
    line each, with the reason."""
    from draftsmith.export import export_checkpoint
    from draftsmith.export.cli import main as export_main
    from draftsmith.export.serve_check import main as gate_main

    trainer, recipe = domino_run
    serve = export_checkpoint(trainer.last_checkpoint, "sglang", tmp_path / "out")
    assert "--speculative-algorithm DFLASH" in serve[0] and "--speculative-num-draft-tokens 4" in serve[0]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    head = config["dflash_config"]
    assert set(head) == REFERENCE_HEAD and head["projector_type"] == "domino"
    assert head["target_layer_ids"] == [0, 1, 2] and (head["gru_hidden_dim"], head["emb_dim"]) == (16, 8)
    assert head["shift_label"] is True and head["pure_draft_prefix_len"] == 1 and config["emb_dim"] == 8
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (4, 3, 1)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out" / "model.safetensors")
    hidden = config["hidden_size"]
    assert weights["prefix_gru.weight_ih_l0"].shape == (3 * 16, hidden)
    assert weights["prefix_gru.weight_hh_l0"].shape == (3 * 16, 16)
    assert weights["embed_proj.0.weight"].shape == (8, hidden + 16)
    assert weights["embed_proj.2.weight"].shape == (config["vocab_size"], 8)
    assert not any(name.startswith(("lm_head", "embed_tokens", "d2t", "t2d")) for name in weights)
    ckpt = str(trainer.last_checkpoint)
    line = user_error(capsys, export_main, [ckpt, "--format", "speculators", "--out", str(tmp_path / "s")])
    assert "speculators 0.9 has no Domino model" in line, line
    line = user_error(capsys, gate_main, [str(tmp_path / "out")])
    assert "vLLM 0.32 cannot serve Domino drafters" in line, line


def test_the_export_loads_in_modelopts_domino_module_with_the_same_forward(domino_run, tmp_path):
    """ModelOpt's own ``DominoModule`` (nvidia-modelopt 0.47, the trainer whose exporter writes this
    folder), built from the export's config.json, loads its weights strictly (every name and shape,
    nothing missing or left over) and gives our drafter's forward on the same block: the backbone's
    normed states over the injected context, and the corrected logits of ``HFDominoModel._apply_domino_head``
    (the GRU over the block's tokens, ``embed_proj`` of ``[state ; GRU output]`` added past
    ``pure_draft_prefix_len``) equal to our drafter's chain logits. Negative control: the
    correction with the GRU's weights swapped differs."""
    pytest.importorskip("modelopt.torch.speculative.plugins.modeling_domino", reason="scripts/install.sh installs it")
    from modelopt.torch.speculative.plugins.modeling_domino import DominoModule
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from draftsmith.export import export_checkpoint

    trainer, recipe = domino_run
    target = AutoModelForCausalLM.from_pretrained(recipe.parent / "target", dtype=torch.float32).eval()
    head = DominoHead.from_pretrained(trainer.last_checkpoint, target).eval()
    export_checkpoint(trainer.last_checkpoint, "sglang", tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    config = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "draftsmith")})
    for key, value in {**raw["dflash_config"], "block_size": raw["block_size"]}.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    theirs = DominoModule(config).eval()
    theirs.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    # The class its lazy init builds (_ROTARY_CLS), made here: its call passes a device keyword that
    # transformers 5.19's Qwen3RotaryEmbedding no longer takes.
    theirs.rotary_emb = Qwen3RotaryEmbedding(config)

    ids = torch.randint(100, 400, (1, 20), generator=torch.Generator().manual_seed(2))
    a, slots = 12, head.block_size
    with torch.no_grad():
        out = target.get_decoder()(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[layer] for layer in head.aux_layers], dim=-1)
        block = torch.full((1, slots), head.mask_token_id)
        block[0, 0] = ids[0, a]
        embed = target.get_input_embeddings()
        want = theirs(embed(block), aux[:, :a], torch.arange(a + slots)[None])
        cache = DynamicCache()
        head.add_context(cache, aux[:, :a], torch.arange(a)[None])
        everything = torch.ones(1, 1, slots, a + slots, dtype=torch.bool)
        hidden = head(block, a + torch.arange(slots)[None], cache, everything)
        torch.testing.assert_close(head.norm(hidden), want, rtol=1e-4, atol=1e-4)

        drafter = DominoDrafter(head)
        drafter.begin(ids[0, : a + 1].tolist(), aux[0, :a])
        chain = drafter.propose(DraftContext(ids[0, : a + 1].tolist(), SamplingConfig(), None, max_tokens=10)).tokens
        previous = torch.tensor([[ids[0, a].item(), *chain[:-1]]])  # shift_label: the block's tokens a..a+b-1

        def reference_logits(gru) -> torch.Tensor:
            start = theirs.pure_draft_prefix_len
            states, _ = gru(embed(previous))
            correction = theirs.embed_proj(torch.cat([want[:, start:], states[:, start:]], dim=-1))
            base = target.lm_head(want)
            return torch.cat([base[:, :start], base[:, start:] + correction], dim=1)[0]

        logits = reference_logits(theirs.prefix_gru)
        assert logits.argmax(-1).tolist() == chain
        torch.testing.assert_close(_training_logits(head, hidden[0], previous[0]), logits, rtol=1e-4, atol=1e-4)
        swapped = torch.nn.GRU(config.hidden_size, config.gru_hidden_dim, batch_first=True, bias=False)
        assert not torch.allclose(reference_logits(swapped), logits)
