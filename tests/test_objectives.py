"""Token objectives (train/objectives.py): hand-computed values, speculators' own functions on random
logits, bounded memory over a large vocabulary, and each kind's loss taking the recipe's choice."""

from __future__ import annotations

import json
import math

import pytest
import torch
from speculators.losses import eager as reference
from speculators.losses.utils import _EAGER_LOSS_FN_MAP, resolve_loss_config
from training_helpers import save_tiny_target, write_recipe

from draftsmith.config import RecipeError, from_dict
from draftsmith.heads.eagle import EagleHead
from draftsmith.target import load_tokenizer
from draftsmith.train import objectives
from draftsmith.train.objectives import (
    OBJECTIVES,
    mixed_token_loss,
    objective_rows,
    parse_objective,
    row_dot,
    soft_coefficients,
    soft_target_cross_entropy,
    token_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")

P = torch.tensor([[0.7, 0.3]])
Q = torch.tensor([[0.4, 0.6]])
KL = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
ALPHA = 0.4 + 0.3  # sum min(p, q)
LAMBDA = math.exp(-3 * ALPHA)
HAND = {
    "kl_div": KL,
    "rkl": 0.4 * math.log(0.4 / 0.7) + 0.6 * math.log(0.6 / 0.3),
    "jsd": 0.5 * (0.7 * math.log(0.7 / 0.55) + 0.3 * math.log(0.3 / 0.45))
    + 0.5 * (0.4 * math.log(0.4 / 0.55) + 0.6 * math.log(0.6 / 0.45)),
    "ce": -math.log(0.4),
    "tv": 1 - ALPHA,
    "nla": -math.log(ALPHA),
    "lk_hybrid": LAMBDA * KL + (1 - LAMBDA) * (1 - ALPHA),
}


def _random(rows: int, vocab: int, seed: int, scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * scale for _ in range(2))


def test_names_are_speculators_loss_names():
    assert set(OBJECTIVES) == set(_EAGER_LOSS_FN_MAP)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_matches_its_hand_computed_value(name):
    assert objective_rows({name: 1.0}, Q.log(), P).item() == pytest.approx(HAND[name], rel=1e-5)
    # Student logits are only defined up to a constant per row.
    assert objective_rows({name: 1.0}, Q.log() - 2.0, P).item() == pytest.approx(HAND[name], rel=1e-5)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_equals_speculators_function_in_value_and_gradient(name):
    student, target = _random(12, 40, seed=OBJECTIVES.index(name))
    ours_logits = student.clone().requires_grad_()
    theirs_logits = student.clone().requires_grad_()
    ours = objective_rows({name: 1.0}, ours_logits, target.softmax(-1))
    theirs = _EAGER_LOSS_FN_MAP[name](theirs_logits[None], target[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = torch.rand(12, generator=torch.Generator().manual_seed(9))
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_logits.grad, theirs_logits.grad, rtol=1e-4, atol=1e-6)


def test_a_weighted_mix_is_speculators_compound_of_the_same_spec():
    spec = '{"ce": 0.1, "tv": 0.9}'
    student, target = _random(8, 30, seed=5)
    ours = objective_rows(parse_objective(spec), student, target.softmax(-1))
    theirs = sum(w * fn(student[None], target[None])[0] for fn, w in resolve_loss_config(spec, "eager").values())
    torch.testing.assert_close(ours, theirs)
    assert parse_objective(json.loads(spec)) == parse_objective(spec) == {"ce": 0.1, "tv": 0.9}


def test_jsd_beta_is_the_generalised_jsd():
    beta = 0.2
    m = beta * P + (1 - beta) * Q
    expected = beta * (P * (P / m).log()).sum() + (1 - beta) * (Q * (Q / m).log()).sum()
    assert objective_rows({"jsd": 1.0}, Q.log(), P, beta=beta).item() == pytest.approx(expected.item(), rel=1e-5)
    assert reference.js_div_loss(Q.log()[None], P.log()[None]).item() == pytest.approx(HAND["jsd"], rel=1e-5)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_only_the_student_gets_a_gradient_and_identical_distributions_cost_nothing(name):
    student, target = _random(4, 9, seed=2)
    student.requires_grad_()
    target.requires_grad_()
    probs = target.softmax(-1)
    objective_rows({name: 1.0}, student, probs).sum().backward()
    assert target.grad is None and student.grad.abs().sum() > 0
    same = objective_rows({name: 1.0}, target.detach(), probs.detach())
    if name == "ce":  # the target's argmax is not certain: -log p(argmax) > 0
        torch.testing.assert_close(same, -probs.detach().max(-1).values.log())
    else:
        torch.testing.assert_close(same, torch.zeros(4), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("kl", None),
        ("fkl", None),
        ("tvd", None),
        ("lk", None),
        ("hinge", "unknown objective 'hinge'"),
        ({"ce": -0.1, "tv": 1.0}, "weight of 'ce' must be a finite number >= 0"),
        ({"ce": 0.0}, "at least one weight must be > 0"),
        ('{"ce": 0.1,', "is not valid JSON"),
        ({}, "must be a name or a non-empty mapping"),
    ],
)
def test_specs_are_read_or_refused_naming_the_field(spec, message):
    from draftsmith.train.eagle3 import Eagle3Recipe

    if message is None:
        assert set(parse_objective(spec)) <= set(OBJECTIVES)
        assert from_dict(Eagle3Recipe, {"drafter": {"objective": spec}}).drafter.objective == spec
        return
    with pytest.raises(RecipeError, match=f"drafter.objective: .*{message}"):
        from_dict(Eagle3Recipe, {"drafter": {"objective": spec}}, "r.yaml")


def test_rows_are_scored_in_chunks_with_bounded_memory(monkeypatch):
    """Over a large vocabulary the terms' fp32 intermediates exist for one chunk at a time: what
    autograd keeps for the backward pass is about the logits themselves, not a copy per term
    (negative control: the unchunked terms keep several), and values and gradients are unchanged."""
    student, target = _random(64, 4096, seed=7)
    probs = target.softmax(-1)
    mix = {"kl_div": 0.3, "jsd": 0.3, "lk_hybrid": 0.4}

    def saved_bytes(fn) -> tuple[int, torch.Tensor, torch.Tensor]:
        logits = student.clone().requires_grad_()
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rows = fn(logits)
        rows.sum().backward()
        return total, rows.detach(), logits.grad

    logits_bytes = student.numel() * 4
    monkeypatch.setattr(objectives, "CHUNK_ELEMENTS", 8 * 4096)  # 8 rows a chunk
    chunked, values, grad = saved_bytes(lambda z: objective_rows(mix, z, probs))
    whole, whole_values, whole_grad = saved_bytes(lambda z: objectives._terms(mix, z, probs, 0.5))
    assert chunked <= 2.1 * logits_bytes, chunked / logits_bytes  # the logits and the target's rows
    assert whole >= 5 * logits_bytes, whole / logits_bytes
    torch.testing.assert_close(values, whole_values)
    torch.testing.assert_close(grad, whole_grad)


def test_token_loss_keeps_the_soft_cross_entropy_for_forward_kl_and_adds_other_objectives():
    """Forward KL trains as the soft cross-entropy (equal gradient; the value differs by p's
    entropy); any other objective is the extra coefficients' cross-entropy plus ``weight`` x it."""
    student, target = _random(6, 20, seed=11)
    probs = target.softmax(-1)
    logits = student.clone().requires_grad_()
    loss, lse = token_loss(logits, probs, probs, {"kl_div": 1.0}, 1.0)
    entropy = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(loss - entropy, objective_rows({"kl_div": 1.0}, student, probs))
    torch.testing.assert_close(lse, student.logsumexp(-1))
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    tv_loss, _ = token_loss(logits, torch.zeros_like(probs), probs, {"tv": 1.0}, 0.5 * kept)
    torch.testing.assert_close(tv_loss, 0.5 * kept * (1 - torch.minimum(student.softmax(-1), probs).sum(-1)))


@pytest.mark.parametrize(
    "mix", [{"ce": 1.0}, {"kl_div": 0.3, "ce": 0.7}, {"kl_div": 2.0}, {"kl_div": 0.3, "ce": 0.7, "tv": 0.5}]
)
def test_forward_kl_and_ce_train_as_one_soft_cross_entropy_with_their_weights(monkeypatch, mix):
    """``kl_div`` and ``ce`` (and their weights) go into the soft cross-entropy's coefficients: the
    value equals :func:`objective_rows` of the mix plus ``w_kl`` x p's entropy, the gradient equals
    its gradient, and only the other terms are scored apart (for ``ce`` and ``kl_div`` alone the
    chunked scorer never runs). Ties in p go to the first id, as ``argmax``."""
    student, target = _random(7, 30, seed=12)
    probs = target.softmax(-1)
    probs[0, :2] = probs[0].max()  # a tie: argmax takes id 0
    probs = probs / probs.sum(-1, keepdim=True)
    scored: list[dict] = []
    real = objectives.objective_rows
    monkeypatch.setattr(objectives, "objective_rows", lambda m, *a, **k: scored.append(m) or real(m, *a, **k))
    logits = student.clone().requires_grad_()
    loss, _ = token_loss(logits, soft_coefficients(mix, probs), probs, mix, 1.0)
    loss.sum().backward()
    assert scored == ([{"tv": 0.5}] if "tv" in mix else [])
    want_logits = student.clone().requires_grad_()
    want = real(mix, want_logits, probs)
    want.sum().backward()
    entropy = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(loss, want + mix.get("kl_div", 0.0) * entropy)
    torch.testing.assert_close(logits.grad, want_logits.grad)


def test_the_soft_cross_entropy_goes_a_chunk_of_rows_at_a_time_with_the_whole_rows_values(monkeypatch):
    """With 3 rows a pass (7 passes over 20 rows) the soft cross-entropy, its log-normaliser, its
    gradient and :func:`row_dot` equal the composite whole-row forms to 1e-6."""
    monkeypatch.setattr(objectives, "PASS_ELEMENTS", 3 * 50)
    student, target = _random(20, 50, seed=5)
    coeff = target.softmax(-1) * 1.5
    logits = student.clone().requires_grad_()
    loss, lse = soft_target_cross_entropy(logits, coeff)
    scale = torch.linspace(0.5, 1.5, 20)
    (loss * scale).sum().backward()
    whole = student.double().requires_grad_()  # the composite in fp64: the reference, not its rounding
    want = -(coeff.double() * whole.log_softmax(-1)).sum(-1)
    (want * scale.double()).sum().backward()
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, student.double().logsumexp(-1).float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, whole.grad.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row_dot(coeff, student), (coeff * student).sum(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mix", [{"kl_div": 1.0}, {"ce": 0.1, "tv": 0.9}], ids=["kl_div", "ce-tv"])
@pytest.mark.parametrize("weight", [0.0, 0.4])
def test_the_fused_mixed_loss_equals_the_two_token_losses_composed(monkeypatch, mix, weight):
    """Domino's loss, ``(1 - w) token_loss(b + m x) + w token_loss(b)``, fused and in chunks of 3
    rows, equals the two losses composed (values, log-normaliser, summed logits and the gradients
    of b and x) to 1e-6; a row with m = 0 takes no gradient into x. Negative control: another
    weight gives another loss."""
    monkeypatch.setattr(objectives, "PASS_ELEMENTS", 3 * 40)
    base, addend = _random(11, 40, seed=9)
    probs = next(iter(_random(11, 40, seed=10))).softmax(-1)
    coeff = soft_coefficients(mix, probs)
    switch = torch.tensor([False, True, True, False, True, True, True, True, False, True, True])
    kept = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    scale = torch.linspace(0.5, 2.0, 11)

    def composed(b, x):
        logits = b + x * switch[:, None]
        loss, lse = token_loss(logits, coeff, probs, mix, kept)
        base_loss, _ = token_loss(b, coeff, probs, mix, kept)
        return (1 - weight) * loss + weight * base_loss, lse, logits

    results = []
    for fn in (composed, lambda b, x: mixed_token_loss(b, x, switch, coeff, probs, mix, kept, weight)):
        b, x = base.clone().requires_grad_(), addend.clone().requires_grad_()
        loss, lse, logits = fn(b, x)
        ((loss * scale).sum() + (logits.detach() * 0).sum()).backward()
        results.append((loss.detach(), lse, logits.detach(), b.grad, x.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert results[1][4][~switch].abs().max() == 0 and results[1][4][switch].abs().max() > 0
    other = mixed_token_loss(base, addend, switch, coeff, probs, mix, kept, 0.9)[0]
    assert (other - results[1][0]).abs().max() > 1e-3


def test_hard_labels_are_the_cross_entropy_on_those_tokens_in_value_and_gradient(monkeypatch):
    """Coefficients given as token ids (-1: no loss), in chunks of 3 rows, are
    ``F.cross_entropy(..., ignore_index=-1)`` per row and the dense one-hot rows' soft
    cross-entropy, in value, log-normaliser and gradient; alone and in Domino's fused mix. Negative
    control: one label moved gives another loss on that row only."""
    monkeypatch.setattr(objectives, "PASS_ELEMENTS", 3 * 40)
    base, addend = _random(11, 40, seed=11)
    labels = torch.randint(0, 40, (11,), generator=torch.Generator().manual_seed(12))
    labels[[2, 7]] = -1
    onehot = torch.zeros(11, 40).scatter_(-1, labels.clamp(min=0)[:, None], 1.0) * (labels >= 0)[:, None]
    scale = torch.linspace(0.5, 2.0, 11)

    def run(fn, coeff):
        z = base.clone().requires_grad_()
        loss, lse = fn(z, coeff)
        (loss * scale).sum().backward()
        return loss.detach(), lse, z.grad

    hard = run(soft_target_cross_entropy, labels)
    want = torch.nn.functional.cross_entropy(base, labels, ignore_index=-1, reduction="none")
    torch.testing.assert_close(hard[0], want)
    for got, want in zip(hard, run(soft_target_cross_entropy, onehot)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert hard[2][[2, 7]].abs().max() == 0 and hard[0][[2, 7]].abs().max() == 0
    moved = labels.clone()
    moved[4] = (moved[4] + 1) % 40
    changed = (soft_target_cross_entropy(base, moved)[0] - hard[0]).abs() > 1e-4
    assert changed.tolist() == [row == 4 for row in range(11)]

    switch = torch.tensor([False, True, True, False, True, True, True, True, False, True, True])
    mixed = []
    for coeff in (labels, onehot):
        b, x = base.clone().requires_grad_(), addend.clone().requires_grad_()
        loss, lse, logits = mixed_token_loss(b, x, switch, coeff, None, {"kl_div": 1.0}, 1.0, 0.4)
        (loss * scale).sum().backward()
        mixed.append((loss.detach(), lse, logits.detach(), b.grad, x.grad))
    for got, want in zip(*mixed):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert row_dot(labels, base)[[2, 7]].abs().max() == 0
    torch.testing.assert_close(row_dot(labels, base), row_dot(onehot, base))


def test_the_unrolled_loss_scores_each_pass_with_the_recipes_objective(make_tiny_llama):
    """EAGLE-1/3, HASS and P-EAGLE's loss: ``ce_weight`` x the objective per scored row, each
    pass's mean weighted ``decay ** j``; HASS's top-K term is still added; forward KL is today's loss."""
    from draftsmith.train.unroll import UnrollLoss, unroll, unrolled_loss

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = EagleHead.for_target(target, "tiny", init="random").eval()
    ids = [3, 9, 4, 17, 6, 11, 2, 30]
    mask, pad = torch.ones(1, len(ids), dtype=torch.bool), torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        features = target.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state
        outputs = unroll(head, torch.tensor([ids]), features[:, :-1], pad, 2)
        p0 = head.target_logits(features[0, 1:-1]).float().softmax(-1)
        p1 = head.target_logits(features[0, 2:-1]).float().softmax(-1)
        q0 = head.draft_logits(outputs[0][0, :-1]).float()
        q1 = head.draft_logits(outputs[1][0, :-2]).float()

        def loss(**kwargs):
            return unrolled_loss(head, outputs, features, mask, pad, UnrollLoss(decay=0.5, **kwargs), True)[0]

        tv0, tv1 = (1 - torch.minimum(q.softmax(-1), p).sum(-1) for q, p in ((q0, p0), (q1, p1)))
        torch.testing.assert_close(loss(objective={"tv": 1.0}, ce_weight=0.3), 0.3 * (tv0.mean() + 0.5 * tv1.mean()))
        mix = {"ce": 0.1, "tv": 0.9}
        torch.testing.assert_close(
            loss(objective=mix),
            objective_rows(mix, q0, p0).mean() + 0.5 * objective_rows(mix, q1, p1).mean(),
        )
        ce0, ce1 = (-(p * q.log_softmax(-1)).sum(-1) for q, p in ((q0, p0), (q1, p1)))
        torch.testing.assert_close(loss(), ce0.mean() + 0.5 * ce1.mean())
        torch.testing.assert_close(loss(objective={"kl_div": 2.0}), 2 * loss())  # a lone term's weight counts
        best0, best1 = p0.argmax(-1, keepdim=True), p1.argmax(-1, keepdim=True)
        top1 = [
            -(p.gather(-1, b) * q.log_softmax(-1).gather(-1, b)).mean()
            for q, p, b in ((q0, p0, best0), (q1, p1, best1))
        ]
        torch.testing.assert_close(
            loss(objective={"tv": 1.0}, top_k=1),
            tv0.mean() + top1[0] + 0.5 * (tv1.mean() + top1[1]),
        )


@pytest.fixture(scope="module")
def tiny_target_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("objectives")
    return root, save_tiny_target(root / "target", load_tokenizer("default"), scale=8.0)


@pytest.mark.parametrize(
    "kind,drafter",
    [
        ("eagle3", {"aux_layers": [0, 1, 2], "ttt_steps": 2, "draft_vocab_size": 512, "objective": "lk_hybrid"}),
        (
            "dflash",
            {
                "aux_layers": [0, 1, 2],
                "num_layers": 1,
                "block_size": 4,
                "anchors_per_sequence": 16,
                "draft_vocab_size": 512,
                "objective": {"ce": 0.1, "tv": 0.9},
            },
        ),
        (
            "domino",
            {
                "aux_layers": [0, 1, 2],
                "num_layers": 1,
                "block_size": 4,
                "anchors_per_sequence": 16,
                "labels": "data",
                "objective": "ce",
            },
        ),
        ("eagle", {"objective": "tv", "ce_weight": 1.0, "regression_weight": 0.0}),
        ("medusa", {"num_heads": 2, "objective": "nla"}),
    ],
)
def test_training_under_another_objective_lowers_it(tiny_target_folder, kind, drafter, tmp_path):
    """A few steps of each loss family under a non-default objective: the logged loss (the
    objective itself, no KL in it) falls (Medusa's against the target's distribution, not the
    data's tokens), and the recipe copy in the checkpoint keeps the choice."""
    import importlib

    import yaml

    root, target = tiny_target_folder
    recipe = write_recipe(
        tmp_path,
        target,
        {"kind": kind, **drafter},
        data={"regenerate": {"enabled": False}},
        learning_rate=3e-3,
        lr_schedule="constant",
        max_steps=16,
        log_every=4,
    )
    trainer = importlib.import_module(f"draftsmith.train.{kind}").main(
        [str(recipe), "--output_dir", str(tmp_path / "run")]
    )
    losses = [h["train/loss"] for h in trainer.history if "train/loss" in h]
    assert losses[-1] < losses[0] * 0.95, losses
    if kind == "eagle":
        assert all(0.0 < value <= 1.0 for value in losses)  # a TV: a probability, not a cross-entropy
    saved = yaml.safe_load((trainer.last_checkpoint / "recipe.yaml").read_text())
    assert saved["drafter"]["objective"] == drafter["objective"]


def test_medusa_heads_score_the_targets_distribution_one_position_before_each_label(make_tiny_llama):
    """With an objective, head k at position i is scored against the target's distribution at
    i + k + 1 (which predicts its label, token i + k + 2), over the heads' draft vocabulary; without
    one, against the data's token (Medusa's own loss)."""
    from draftsmith.heads.medusa import MedusaHeads, head_positions
    from draftsmith.train.medusa import MedusaRecipe, MedusaTask

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=2, seed=5, scale=10.0)
    vocab = torch.arange(0, 48, 2)
    heads = MedusaHeads.for_target(target, "tiny", num_heads=2, draft_vocab=vocab)
    torch.nn.init.normal_(heads.blocks[0][0].linear.weight, std=0.5)
    ids = torch.tensor([[3, 9, 4, 17, 6, 11, 2, 30, 5]])
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "attention_mask": torch.ones_like(ids),
    }
    recipe = MedusaRecipe()
    recipe.drafter.num_heads, recipe.drafter.objective = 2, "tv"
    task = MedusaTask(recipe, target, heads)
    with torch.no_grad():
        loss, metrics = task.loss(heads, batch, training=True)
        hidden = target.get_decoder()(input_ids=ids).last_hidden_state[0]
        full = target.lm_head(hidden).softmax(-1)
        positions, _ = head_positions(batch, 2)
        expected = 0
        for k, logits in enumerate(heads(hidden[None], positions)):
            p = target.lm_head(hidden[positions[k] + k + 1])[:, vocab].softmax(-1)
            tv = 1 - torch.minimum(logits.softmax(-1), p).sum(-1)
            expected = expected + 0.8**k * tv.mean()
    torch.testing.assert_close(loss, expected)
    assert full.shape[-1] == 48  # the target's own distribution is renormalised over the 24 drafted ids
    recipe.drafter.objective = None
    with torch.no_grad():
        data_loss, _ = MedusaTask(recipe, target, heads).loss(heads, batch, training=True)
    assert abs(float(data_loss) - float(loss)) > 0.1  # the data's tokens: another loss
