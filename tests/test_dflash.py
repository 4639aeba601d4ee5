"""DFlash: the training pass over many blocks is exactly what one drafting pass computes for each,
drafting is lossless (greedy identical, sampling distributed as the target), slot weights are
DFlash's decay and D-PACE, and training learns.

Tiny random-weight targets (built from a config) keep these fast.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_helpers import SAMPLES, assert_distributed_as_target
from training_helpers import greedy_rows, save_tiny_target, tiny_training_recipe, write_recipe
from transformers import DynamicCache

from draftsmith.config import RecipeError
from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.base import DraftContext
from draftsmith.eval.engine.drafters.dflash import DFlashDrafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.heads.base import target_lm_rows
from draftsmith.heads.dflash import DFlashHead
from draftsmith.target import load_target, load_tokenizer
from draftsmith.train.dflash import (
    DFlashDrafterConfig,
    DFlashTask,
    block_attention,
    block_sparse_attention,
    blocks_per_group,
    grouped_block_attention,
    sample_anchors,
    slot_weights,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 7, 4]


@pytest.fixture(scope="module")
def tiny_target(make_tiny_llama):
    """8 tokens, peaked (weights x 15), 3 layers for the 3 aux layers; token 7 is also the mask."""
    return make_tiny_llama(vocab_size=8, hidden_size=32, layers=3, seed=0, scale=15.0)


def _head(target, mask: int, block: int = 4, draft_vocab=None, seed: int = 1) -> DFlashHead:
    torch.manual_seed(seed)
    vocab = torch.tensor(draft_vocab) if draft_vocab is not None else None
    head = DFlashHead.for_target(target, "tiny", [0, 1, 2], 2, block, mask, vocab)
    with torch.no_grad():  # q/k norms and the norms start at 1: move every weight so the test sees them all
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return head.eval()


def _features(target, ids: list[int]) -> torch.Tensor:
    out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[layer] for layer in (0, 1, 2)], dim=-1)


def test_one_training_pass_over_many_blocks_equals_a_drafting_pass_for_each(make_tiny_llama):
    """Blocks trained together see the context before their own anchor and their own block only:
    each block's slot logits equal a drafting pass with the context cut at its anchor."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    block = 4
    head = _head(target, mask=47, block=block, draft_vocab=[0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47])
    ids = [3, 9, 4, 17, 6, 11, 2, 30, 8, 5, 14, 22]
    anchors, valid = torch.tensor([[2, 6, 9, 0]]), torch.tensor([[True, True, True, False]])
    with torch.no_grad():
        features = _features(target, ids)
        cache = DynamicCache()
        head.add_context(cache, features, torch.arange(len(ids))[None])
        positions = anchors[:, :, None] + torch.arange(block)
        tokens = torch.full_like(positions, 47)
        tokens[:, :, 0] = torch.tensor([ids])[0, anchors[0]]
        mask = block_attention(anchors, valid, torch.ones(1, len(ids), dtype=torch.long), block)
        trained = head(tokens.flatten(1), positions.flatten(1), cache, mask).view(1, 4, block, -1)
        for i, a in enumerate([2, 6, 9]):
            alone = DynamicCache()
            head.add_context(alone, features[:, :a], torch.arange(a)[None])
            drafted = head(tokens[:, i], positions[:, i], alone, torch.ones(1, 1, block, a + block, dtype=torch.bool))
            torch.testing.assert_close(
                head.draft_logits(trained[0, i]), head.draft_logits(drafted[0]), atol=1e-5, rtol=1e-4
            )
        assert (trained[0, 0, 1] - trained[0, 1, 1]).abs().max() > 1e-3


def test_block_sparse_attention_equals_dense_masked_sdpa_in_values_and_gradients():
    """Blocks scored in groups (three groups of 3 blocks, the last padded by two) over grouped-query
    heads give dense SDPA's output under block_attention's mask, and the same gradients for the
    queries, keys and values, with invalid anchors and a padded row among them."""
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, block, count = 2, 4, 2, 8, 40, 3, 7
    assert blocks_per_group(count, length, block) == 3
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[1, 30:] = 0
    anchors = torch.tensor([[1, 5, 9, 17, 20, 33, 38], [2, 3, 11, 25, 28, 0, 0]])
    valid = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    q = torch.randn(batch, heads, count * block, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, length + count * block, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, length + count * block, dim, requires_grad=True)
    mask = grouped_block_attention(anchors, valid, padding, block)
    assert mask.shape == (batch * 3, 1, 3 * block, length + 3 * block)
    sparse, _ = block_sparse_attention(torch.nn.Module(), q, k, v, mask, scaling=dim**-0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=block_attention(anchors, valid, padding, block), enable_gqa=True, scale=dim**-0.5
    ).transpose(1, 2)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(dense)
    grads = [torch.autograd.grad((out * weights).sum(), (q, k, v)) for out in (sparse, dense)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_training_step_is_unchanged_by_block_sparse_attention(make_tiny_llama):
    """The DFlash loss and every gradient of the drafter are the dense path's, over a padded batch
    whose anchors fill several groups (and leave invalid ones in the short row)."""
    from types import SimpleNamespace

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, block=3, draft_vocab=[0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47]).train()
    cfg = DFlashDrafterConfig(aux_layers=[0, 1, 2], block_size=3, anchors_per_sequence=9)
    task = DFlashTask(SimpleNamespace(drafter=cfg), target, head)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 47, (2, 40), generator=generator)
    padding = torch.ones_like(ids)
    padding[1, 22:] = 0
    loss_mask = padding.clone()
    loss_mask[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": padding, "loss_mask": loss_mask}
    assert blocks_per_group(9, 40, 3) == 3  # three groups a row
    results = []
    for sparse in (True, False):
        task.block_sparse = sparse
        head.zero_grad()
        loss, metrics = task.loss(head, batch, training=False)  # held-out anchors: the same blocks twice
        loss.backward()
        results.append((loss.detach(), metrics, {n: p.grad.clone() for n, p in head.named_parameters()}))
    (loss, metrics, grads), (dense_loss, dense_metrics, dense_grads) = results
    assert metrics["tokens"] == dense_metrics["tokens"] > 10
    torch.testing.assert_close(loss, dense_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == dense_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], dense_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert head.config._attn_implementation == "sdpa"  # the drafting pass's attention is left as it was


@pytest.mark.parametrize("training", [False, True], ids=["held-out", "training"])
def test_data_labels_on_greedy_data_train_as_ce_on_the_targets_argmax(make_tiny_llama, training):
    """On the target's own greedy replies, ``labels: data`` and ``labels: target`` reading the
    target's argmax from the data (a greedily regenerated recipe) both give the loss, metrics and
    gradients of ``labels: target`` with ``objective: ce`` and the exact argmax, over a reduced draft
    vocabulary that drops some labels (every metric but ``ce_loss``, which ``labels: target`` takes
    against the distribution), in training and held out. Negative controls: on data that is not
    the target's greedy output they differ."""
    from types import SimpleNamespace

    from draftsmith.train.fused import regenerated_data

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, block=3, draft_vocab=[0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47]).train()
    greedy = greedy_rows(target, [[3, 9, 4, 17], [6, 11, 2, 30]], 40)
    noisy = torch.randint(2, 47, greedy.shape, generator=torch.Generator().manual_seed(4))
    loss_mask = (torch.arange(40) >= 4).long().expand(2, -1)

    def step(labels: str, ids: torch.Tensor, greedy_recipe: bool = False):
        cfg = DFlashDrafterConfig(
            aux_layers=[0, 1, 2], block_size=3, anchors_per_sequence=9, labels=labels, objective="ce"
        )
        recipe = SimpleNamespace(drafter=cfg, data=regenerated_data() if greedy_recipe else None)
        task = DFlashTask(recipe, target, head)
        assert task.greedy_replies is greedy_recipe
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        head.zero_grad()
        torch.manual_seed(0)  # the same anchors every call
        loss, metrics = task.loss(head, batch, training=training)
        loss.backward()
        return loss.detach(), metrics, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    want, want_metrics, want_grads = step("target", greedy)
    inside = torch.isin(greedy[:, 4:], head.draft_vocab)
    assert want_metrics["tokens"] > 20 and want > 0 and 0 < inside.float().mean() < 1  # some labels are dropped
    for loss, metrics, grads in (step("data", greedy), step("target", greedy, greedy_recipe=True)):
        torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
        assert metrics.keys() == want_metrics.keys()
        for key in metrics.keys() - {"ce_loss"}:  # under labels: target, against the target's distribution
            assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-5), key
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert 0 < step("data", greedy)[1]["ce_loss"] < want_metrics["ce_loss"]  # dropped labels score nothing
    exact = step("target", noisy)[0]
    assert abs(float(step("data", noisy)[0] - exact)) > 1e-2
    if training:  # the masks read from the data differ from the target's argmax's
        assert abs(float(step("target", noisy, greedy_recipe=True)[0] - exact)) > 1e-3


@pytest.mark.parametrize(
    "override, message",
    [
        ({"objective": "tv"}, "drafter.objective tv needs the target's distribution"),
        ({"confidence_head": True}, "drafter.confidence_head learns"),
        ({"out_of_vocab_targets": "renormalise"}, "drafter.out_of_vocab_targets: renormalise"),
    ],
)
def test_data_labels_refuse_what_needs_the_targets_distribution(override, message):
    with pytest.raises(ValueError, match=message):
        DFlashDrafterConfig(labels="data", **override).validate()
    DFlashDrafterConfig(labels="target", **override).validate()


@pytest.mark.parametrize(
    "drafter, regenerate, chosen",
    [
        ({}, {}, "data"),
        ({"objective": {"kl_div": 0.5, "ce": 0.5}}, {}, "data"),
        ({}, None, "target"),
        ({}, {"temperature": 0.7}, "target"),  # sampled replies: not the target's argmax
        ({}, {"conversations": 50}, "target"),  # the other conversations keep their own replies
        ({"objective": "lk_hybrid"}, {}, "target"),
        ({"confidence_head": True}, {}, "target"),
        ({"out_of_vocab_targets": "renormalise"}, {}, "target"),
        ({"labels": "target"}, {}, "target"),
        ({"labels": "data"}, None, "data"),
    ],
)
def test_auto_labels_are_the_data_only_where_the_target_wrote_it_greedily(drafter, regenerate, chosen, capsys):
    """``labels: auto`` is ``data`` where every reply is the target's greedy rewrite and nothing needs
    its distribution; the same condition gates reading the target's argmax from the data."""
    from dataclasses import replace

    from draftsmith.recipe import DataConfig
    from draftsmith.train.dflash import resolve_labels
    from draftsmith.train.fused import regenerated_data
    from draftsmith.train.unroll import greedy_replies

    data = DataConfig() if regenerate is None else regenerated_data()
    if regenerate:
        data = replace(data, regenerate=replace(data.regenerate, **regenerate))
    assert greedy_replies(data) is (regenerate == {})
    assert resolve_labels(DFlashDrafterConfig(**drafter), data) == chosen
    said = capsys.readouterr().out
    assert said.startswith(f"drafter.labels auto -> {chosen}: ") if "labels" not in drafter else said == ""


def test_the_drafter_proposes_what_the_training_pass_scores(make_tiny_llama):
    """Through the engine's protocol (begin with the prompt's features, propose after the root),
    the drafter's greedy chain of K tokens is the argmax at every slot of the anchor's block
    ``[anchor, MASK x K]``: the training pass's block for K = block_size - 1, and for fewer the
    shorter block vLLM runs (1 + num_speculative_tokens query slots), whose slots differ from the
    full block's (they attend both ways), so the gate compares what vLLM serves."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    block, vocab = 4, [0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47]
    head = _head(target, mask=47, block=block, draft_vocab=vocab)
    ids = [3, 9, 4, 17, 6, 11, 2, 30]
    a = 6
    hidden = {}
    with torch.no_grad():
        features = _features(target, ids)
        for slots in (block, block - 1):
            cache = DynamicCache()
            head.add_context(cache, features, torch.arange(len(ids))[None])
            anchors, valid = torch.tensor([[a]]), torch.tensor([[True]])
            tokens = torch.tensor([[ids[a]] + [47] * (slots - 1)])
            hidden[slots - 1] = head(
                tokens,
                anchors + torch.arange(slots),
                cache,
                block_attention(anchors, valid, torch.ones(1, len(ids), dtype=torch.long), slots),
            )[0, 1:]
    assert not torch.allclose(hidden[block - 2], hidden[block - 1][: block - 2], atol=1e-3)
    for depth in (block - 1, block - 2):
        want = head.draft_vocab[head.draft_logits(hidden[depth]).argmax(-1)].tolist()
        drafter = DFlashDrafter(head, depth)
        drafter.begin(ids[: a + 1], features[0, :a])
        tree = drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10))
        assert tree.tokens == want and tree.parents == list(range(-1, depth - 1))
        # Near the output's end fewer tokens are wanted, but vLLM still runs the K-slot block.
        drafter.begin(ids[: a + 1], features[0, :a])
        tree = drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=1))
        assert tree.tokens == want[:1]


def test_anchors_are_distinct_supervised_positions_and_slot_weights_follow_dflash():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]])
    padding = torch.tensor([[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]])
    anchors, valid = sample_anchors(loss_mask, padding, 2, torch.Generator().manual_seed(0))
    allowed = {0: {2, 3, 6}, 1: {1}}  # a where tokens a and a + 1 are supervised
    for row in range(2):
        chosen = anchors[row][valid[row]].tolist()
        assert chosen == sorted(set(chosen)) and set(chosen) <= allowed[row]
        assert len(chosen) == min(2, len(allowed[row]))
    supervised = torch.tensor([[[True, True, False, True]]])
    decay = slot_weights(torch.zeros(1, 1, 4), supervised, DFlashDrafterConfig(decay_gamma=2.0))
    torch.testing.assert_close(decay, torch.tensor([[[1.0, math.exp(-0.5), 0.0, math.exp(-1.5)]]]))
    accept = torch.tensor([[[1.0, 0.5, 0.3, 1.0]]])
    cfg = DFlashDrafterConfig(weighting="dpace", dpace_alpha=0.5)
    # survival s = 0.5 accept + 0.5 where supervised (1, 0.75, -, 1), reach P = cumprod (1, 0.75, 0.75, 0.75),
    # weight = sum of later supervised reaches: (1 + 0.75 + 0.75, 0.75 + 0.75, 0, 0.75).
    torch.testing.assert_close(slot_weights(accept, supervised, cfg), torch.tensor([[[2.5, 1.5, 0.0, 0.75]]]))


def test_blocks_are_anchored_on_reply_tokens_only():
    """In serving a block's anchor is the target's bonus token, a reply token: so are training's,
    as speculators (models/dflash/utils.py select_anchors: loss_mask[a]) and SpecForge
    (_sample_anchor_positions) draw them, with token a + 1 supervised too (the block's first
    slot). The prompt's last token (the assistant header's end), whose next token is the reply's
    first, never anchors; nor does a reply's last token before the next prompt."""
    #                    prompt       reply 1        prompt      reply 2     pad
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]])
    padding = torch.tensor([[1] * 13 + [0, 0]])
    for generator in (torch.Generator().manual_seed(0), None):  # held-out draws, training's draws
        anchors, valid = sample_anchors(loss_mask, padding, 16, generator)
        assert anchors[0][valid[0]].tolist() == [3, 4, 5, 10, 11]  # every allowed anchor, and no other


def test_greedy_dflash_is_lossless_and_drafts_in_one_pass(tiny_target, tmp_path):
    head = _head(tiny_target, mask=7, block=5)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = build_drafter(f"dflash:{tmp_path / 'ckpt'}", tiny_target)
    assert isinstance(drafter, DFlashDrafter) and drafter.depth == 4 and drafter.feature_layers == [0, 1, 2]
    calls = []
    drafter.head.register_forward_hook(lambda *args: calls.append(1))
    plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
    produced = steps = drafting = 0
    for prompt in (PROMPT, [1, 1, 6], list(range(8)) * 3):
        want = plain.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == want.tokens
        produced, steps = produced + sum(got.accepted), steps + got.steps
        drafting += sum(1 for n in got.drafted if n)
    assert len(calls) == drafting  # one pass a step that drafts (the last step, with one token left, does not)
    assert produced / steps > 1.05  # some drafts were accepted along the way


def test_sampling_with_dflash_matches_exact_distribution(tiny_target):
    drafter = DFlashDrafter(_head(tiny_target, mask=7, block=3, draft_vocab=[0, 2, 3, 5, 6, 7]))
    accepted = assert_distributed_as_target(tiny_target, drafter, PROMPT, 4, SAMPLES)
    assert sum(n for a, n in accepted.items() if max(a) > 1) > 100, accepted  # drafts were accepted, often


@pytest.fixture(scope="module")
def dflash_recipe(tmp_path_factory):
    drafter = {
        "kind": "dflash",
        "aux_layers": [0, 1, 2],
        "num_layers": 1,
        "block_size": 4,
        "anchors_per_sequence": 16,
        "draft_vocab_size": 512,
    }
    return tiny_training_recipe(tmp_path_factory.mktemp("dflash"), drafter)


def test_training_lowers_the_loss_and_records_accuracy_per_slot(dflash_recipe, tmp_path):
    from draftsmith.train.dflash import main

    trainer = main([str(dflash_recipe), "--output_dir", str(tmp_path / "run")])
    logs = [h for h in trainer.history if "train/loss" in h]
    assert logs[-1]["train/loss"] < logs[0]["train/loss"] - 0.05, [h["train/loss"] for h in logs]
    for h in logs:
        slots = [h[f"train/top1@{k}"] for k in (1, 2, 3)]
        assert all(0.0 <= a <= 1.0 for a in slots) and h["train/top1"] == slots[0] and "train/top1@4" not in h
    head = DFlashHead.from_pretrained(trainer.last_checkpoint)
    assert (head.block_size, len(head.layers), len(head.depth_accuracy)) == (4, 1, 3)
    tokenizer = load_tokenizer("default")
    assert tokenizer.added_tokens_decoder[head.mask_token_id].special
    assert all(head.mask_token_id not in row["input_ids"] for row in trainer.train_data)


def test_train_lm_head_false_keeps_the_targets_rows_as_speculators_trains(dflash_recipe, tmp_path):
    """``drafter.train_lm_head: false`` (the default) leaves the LM head at the target's rows for the
    draft vocabulary while the layers train; ``true`` trains it too."""
    from draftsmith.train.dflash import main

    target = load_target(str(dflash_recipe.parent / "target"), "float32")[0]
    args = ["--training.max_steps", "3", "--training.eval_every", "0"]
    heads = {}
    for train in ("true", "false"):
        run = main([str(dflash_recipe), "--output_dir", str(tmp_path / train), *args, "--drafter.train_lm_head", train])
        heads[train] = DFlashHead.from_pretrained(run.last_checkpoint)
    rows = target_lm_rows(target, heads["false"].draft_vocab)
    assert torch.equal(heads["false"].lm_head.weight, rows)
    assert not torch.allclose(heads["true"].lm_head.weight, rows)
    assert not torch.equal(heads["false"].fc.weight, heads["true"].fc.weight)


def test_a_resumed_run_draws_the_anchors_an_uninterrupted_one_draws(dflash_recipe, tmp_path):
    """Anchors come from the random state the checkpoint holds: the resumed steps' losses and the
    final weights are the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    from draftsmith.train.dflash import main

    args = [
        "--training.max_steps",
        "6",
        "--training.save_every",
        "3",
        "--training.log_every",
        "1",
        "--training.eval_every",
        "0",
    ]
    whole = main([str(dflash_recipe), "--output_dir", str(tmp_path / "whole"), *args])
    main([str(dflash_recipe), "--output_dir", str(tmp_path / "cut"), *args, "--training.stop_after_steps", "3"])
    resumed = main([str(dflash_recipe), "--output_dir", str(tmp_path / "cut"), *args, "--resume"])
    losses = [{h["step"]: h["train/loss"] for h in run.history if "train/loss" in h} for run in (whole, resumed)]
    assert sorted(losses[1]) == [4, 5, 6] and all(losses[1][k] == losses[0][k] for k in (4, 5, 6)), losses
    expected = load_file(str(whole.last_checkpoint / "model.safetensors"))
    got = load_file(str(resumed.last_checkpoint / "model.safetensors"))
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.fixture(scope="module")
def reserved_mask_target(tmp_path_factory):
    """A saved tiny target (the bundled tokenizer) whose row for the mask token 16 was never
    trained: zero, as Llama-3's reserved tokens are near zero."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_target(tmp_path_factory.mktemp("reserved") / "target", load_tokenizer("default"), layers=3)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight[16] = 0
    target.save_pretrained(folder)
    return folder, target


def test_a_near_zero_mask_row_is_refused_at_training_start_unless_the_row_is_learned(reserved_mask_target):
    """Every mask slot would enter layer 0 as ~0: training refuses it in one line naming
    drafter.mask_token_id (a recipe error: exit code 2), and with drafter.learn_mask_embedding the
    head learns a row of its own, started at the table's median norm, which training moves."""
    from types import SimpleNamespace

    folder, target = reserved_mask_target
    tokenizer = load_tokenizer("default")
    cfg = DFlashDrafterConfig(aux_layers=[0, 1, 2], num_layers=1, block_size=4, mask_token_id=16)
    recipe = SimpleNamespace(drafter=cfg, target=SimpleNamespace(name=str(folder)))
    refusal = r"drafter\.mask_token_id = 16: .* norm 0, near zero .*learn_mask_embedding: true"
    with pytest.raises(RecipeError, match=refusal) as error:
        DFlashTask.new_head(recipe, target, None, tokenizer, [])
    assert "\n" not in str(error.value)
    cfg.learn_mask_embedding = True
    head = DFlashTask.new_head(recipe, target, torch.arange(600), tokenizer, [])
    norms = target.get_input_embeddings().weight.norm(dim=-1)
    assert head.mask_embedding.norm().item() == pytest.approx(norms.median().item(), rel=1e-4)
    task = DFlashTask(SimpleNamespace(drafter=cfg), target, head.train())
    ids = torch.randint(20, 600, (1, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, _ = task.loss(head, batch, training=True)
    loss.backward()
    assert head.mask_embedding.grad.abs().sum() > 0  # trained, not a frozen copy


def test_a_learned_mask_row_feeds_the_mask_slots_and_exports_as_vllms_mask_embedding(reserved_mask_target, tmp_path):
    """The learned row replaces the target's in the mask slots only; it survives save and load,
    exports as mask_embedding.pt (vLLM 0.32's DFlash loader: {"embedding", "mask_token_id"}, in the
    target's dtype) outside model.safetensors and loads back as the same drafter; the export of a
    head that reads the target's near-zero row is refused; checkpoints from before the option load."""
    import json

    from safetensors.torch import load_file

    from draftsmith.export import export_checkpoint

    folder, target = reserved_mask_target
    torch.manual_seed(0)
    head = DFlashHead.for_target(target, str(folder), [0, 1, 2], 1, 4, 16, torch.arange(600), True)
    with torch.no_grad():
        head.mask_embedding.add_(torch.randn_like(head.mask_embedding))
    ids = torch.tensor([[5, 16, 16, 16]])
    embedded = head.embed(ids)
    torch.testing.assert_close(embedded[0, 1:], head.mask_embedding.detach().expand(3, -1))
    torch.testing.assert_close(embedded[0, 0], target.get_input_embeddings().weight[5])
    head.save_pretrained(tmp_path / "ckpt")
    loaded = DFlashHead.from_pretrained(tmp_path / "ckpt", target)
    assert torch.equal(loaded.mask_embedding, head.mask_embedding)

    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    shipped = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert shipped["mask_token_id"] == 16 and shipped["embedding"].dtype == torch.float32
    assert torch.equal(shipped["embedding"], head.mask_embedding.detach())
    assert "mask_embedding" not in load_file(str(tmp_path / "out" / "model.safetensors"))
    back = build_drafter(f"dflash:{tmp_path / 'out'}", target)
    assert torch.equal(back.head.mask_embedding, head.mask_embedding)
    features = torch.randn(1, 6, 3 * target.config.hidden_size)
    with torch.no_grad():
        outs = []
        for model in (head.eval(), back.head):
            cache = DynamicCache()
            model.add_context(cache, features, torch.arange(6)[None])
            outs.append(model(ids, torch.arange(6, 10)[None], cache, torch.ones(1, 1, 4, 10, dtype=torch.bool)))
        torch.testing.assert_close(outs[0], outs[1])

    frozen = DFlashHead.for_target(target, str(folder), [0, 1, 2], 1, 4, 16, torch.arange(600))
    frozen.save_pretrained(tmp_path / "frozen")
    with pytest.raises(UsageError, match=r"drafter\.mask_token_id = 16, of norm 0 .*learn_mask_embedding: true"):
        export_checkpoint(tmp_path / "frozen", "speculators", tmp_path / "frozen-out")

    config = json.loads((tmp_path / "frozen" / "config.json").read_text())
    del config["learn_mask_embedding"]  # a checkpoint from before the option
    (tmp_path / "frozen" / "config.json").write_text(json.dumps(config))
    assert DFlashHead.from_pretrained(tmp_path / "frozen", target).mask_embedding is None


@pytest.mark.slow
def test_vllm_serves_a_learned_mask_row_from_the_export(tmp_path):
    """The real vLLM (0.32) reads the exported mask_embedding.pt: a DFlash drafter trained with a
    learned mask row on a target whose mask row is zero is served as our engine drafts it (the
    gate: vLLM's acceptance per position within the margin of ours, or too few drafts to tell; none
    differ), and the same export without the file (vLLM then feeds every mask slot the target's
    zero row) is accepted nowhere and fails the gate."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from draftsmith.export import export_checkpoint
    from draftsmith.export.serve_check import main as check_main
    from draftsmith.train.dflash import main as train
    from draftsmith.vllm_engine import why_unavailable

    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    tokenizer = load_tokenizer("default")
    folder = save_tiny_target(tmp_path / "target", tokenizer, hidden_size=128, layers=4, scale=8.0)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        target.get_input_embeddings().weight[16] = 0  # never trained, as Llama-3's reserved rows
    target.save_pretrained(folder)
    regenerated = tmp_path / "regenerated.jsonl"
    data = {
        "limit": 16,
        "max_length": 160,
        "held_out_fraction": 0.1,
        "regenerate": {"enabled": True, "max_new_tokens": 64, "output": str(regenerated)},
    }
    drafter = {
        "kind": "dflash",
        "aux_layers": [0, 1, 2],
        "num_layers": 1,
        "block_size": 4,
        "anchors_per_sequence": 32,
        "draft_vocab_size": 2048,
        "mask_token_id": 16,
        "learn_mask_embedding": True,
        # the control below (no learned row: vLLM accepts nothing) was measured on this head; a head
        # trained on the data's tokens (auto, on regenerated data) still drafts some right without it
        "labels": "target",
    }
    recipe = write_recipe(
        tmp_path,
        folder,
        drafter,
        data=data,
        learning_rate=3e-3,
        lr_schedule="constant",
        max_steps=300,
        log_every=100,
        eval_every=0,
    )
    checkpoint = train([str(recipe), "--output_dir", str(tmp_path / "run")]).last_checkpoint
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as out:
        for line in regenerated.read_text().splitlines():
            messages = json.loads(line)["messages"]
            out.write(json.dumps({"prompt": next(m["content"] for m in messages if m["role"] == "user")}) + "\n")
    export_checkpoint(checkpoint, "speculators", tmp_path / "out")
    assert (tmp_path / "out" / "mask_embedding.pt").is_file()
    results = {}
    for name in ("learned", "without"):
        folder_out = tmp_path / "out" if name == "learned" else tmp_path / "without"
        if name == "without":
            shutil.copytree(tmp_path / "out", folder_out)
            (folder_out / "mask_embedding.pt").unlink()
        try:
            check_main([str(folder_out), "--prompts", str(prompts), "--limit", "4", "--max-new-tokens", "32"])
            code = 0
        except SystemExit as exit:
            code = exit.code
        results[name] = (code, json.loads((folder_out / "serve_check.json").read_text()))
    code, result = results["learned"]
    assert result["same_output"] is True and result["verdict"] in ("passed", "inconclusive"), result
    assert all(position["verdict"] != "failed" for position in result["positions"]), result["positions"]
    first = result["positions"][0]
    assert first["verdict"] == "passed" and first["vllm"] > 0.5, result["positions"]
    code, without = results["without"]
    assert code != 0 and without["verdict"] == "failed", without
    assert all(position["vllm_accepted"] == 0 for position in without["positions"]), without["positions"]
