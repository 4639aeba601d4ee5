"""P-EAGLE: training's parallel unroll is exactly what one drafting pass computes, drafting is
lossless (greedy identical, sampling distributed as the target), and training learns.

Tiny random-weight targets (built from a config) keep these fast; the parallel unroll is checked
against the engine's one-pass drafting position by position, as EAGLE-3's unroll is.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from speculators_helpers import aux_features
from stats_helpers import SAMPLES, assert_distributed_as_target
from training_helpers import tiny_training_recipe

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.base import DraftContext
from draftsmith.eval.engine.drafters.peagle import PEagleDrafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.heads.peagle import PEagleHead
from draftsmith.heads.vocab import unused_token_id
from draftsmith.target import load_tokenizer
from draftsmith.train.eagle3 import Eagle3DrafterConfig, Eagle3Recipe, Eagle3Task
from draftsmith.train.peagle import PEagleDrafterConfig, PEagleRecipe, PEagleTask, mask_inputs
from draftsmith.train.unroll import chain_sample, supervised_next, unroll

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 7, 4]


@pytest.fixture(scope="module")
def tiny_target(make_tiny_llama):
    """8 tokens, peaked (weights x 15), 3 layers for the head's 3 aux layers. With no spare token,
    the mask is token 7: the head then reads a real 7 as a mask (weaker drafts, still lossless)."""
    return make_tiny_llama(vocab_size=8, hidden_size=32, layers=3, seed=0, scale=15.0)


AUX = (0, 1, 2)  # the aux layers every head here fuses


def _head(target, mask: int, draft_vocab=None, init: str = "random", seed: int = 1, num_layers: int = 1) -> PEagleHead:
    torch.manual_seed(seed)
    vocab = torch.tensor(draft_vocab) if draft_vocab is not None else None
    head = PEagleHead.for_target(
        target, "tiny", list(AUX), vocab, init, mask_token_id=mask, num_depths=4, num_layers=num_layers
    )
    with torch.no_grad():  # move every weight off its start so the test sees the head's own
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return head.eval()


def _parallel_unroll(head, ids, features, padding, steps, chains=None) -> list[torch.Tensor]:
    """The shared unroll of ``head`` with P-EAGLE's later passes (:func:`mask_inputs`), as its task runs it."""
    return unroll(
        head, ids, features, padding, steps, later_inputs=partial(mask_inputs, head.mask_token_id), chains=chains
    )


@pytest.mark.parametrize(
    ("draft_vocab", "num_layers"),
    [(None, 1), ([0, 1, 2, 3, 5, 8, 13, 21, 34, 40], 1), (None, 3)],
    ids=["full_vocab", "reduced_vocab", "three_layers"],
)
def test_parallel_unroll_equals_one_drafting_pass(make_tiny_llama, draft_vocab, num_layers):
    """Pass j at position t of the parallel unroll is the draft at depth j + 1 after token t + 1:
    what the drafter's one pass over ``[..., token t + 1, MASK x j]`` gives in its row j. With
    several layers, each keeps its own keys in training's one cache (and the engine's) and attends
    blockwise (``unrolled_attention``) in every pass."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, draft_vocab=draft_vocab, num_layers=num_layers)
    ids = [3, 9, 4, 17, 6, 11, 2, 30, 8, 5, 14, 22]
    steps = 4
    with torch.no_grad():
        features = aux_features(target, ids, AUX)
        outputs = _parallel_unroll(
            head, torch.tensor([ids]), features[:, :-1], torch.ones(1, len(ids), dtype=torch.long), steps
        )
        assert (outputs[2] - outputs[1]).abs().max() > 1e-3  # later passes are not the same pass again
        for t in (2, 5, 7):
            runner = CausalLMRunner(decoder=head, lm_head=head.logits, config=head.config)
            runner.reset()
            runner.forward(ids[1 : t + 1], features=features[:, :t])  # the context before token t + 1
            masks = head.mask_hidden[0].expand(steps - 1, -1)
            rows = runner.forward(
                [ids[t + 1]] + [head.mask_token_id] * (steps - 1),
                list(range(-1, steps - 1)),
                list(range(steps)),
                features=torch.cat([features[0, t : t + 1], masks])[None],
            )
            for j in range(steps):
                torch.testing.assert_close(
                    head.draft_logits(rows[j]), head.draft_logits(outputs[j][0, t]), atol=1e-5, rtol=1e-4
                )


def test_chain_sampling_keeps_a_decaying_share_of_nested_supervised_chains():
    """Depth d >= 2 keeps floor(max(0.7 ** (d - 1), 0.2) x its supervised positions) (fewer only
    where chains ran out), every kept chain was kept one depth up, and none is unsupervised."""
    torch.manual_seed(0)
    loss_mask = torch.zeros(3, 200, dtype=torch.long)
    loss_mask[0, 20:180] = loss_mask[1, 50:] = loss_mask[2, 5:40] = 1
    padding = torch.ones_like(loss_mask)
    padding[2, 60:] = 0
    supervised = supervised_next(loss_mask, padding)
    chains = chain_sample(supervised, 7, 0.7, 0.2)
    kept = torch.ones_like(supervised)
    for j, chain in enumerate(chains, start=1):
        rows = chain.rows(supervised.shape[1])
        need = torch.cat([supervised[:, j:], supervised.new_zeros(3, j)], dim=1)
        assert not (rows & ~need).any() and not (rows & ~kept).any(), j
        want = (need.sum(-1) * max(0.7**j, 0.2)).floor()
        assert (rows.sum(-1) <= want).all() and (rows.sum(-1) >= want - j).all(), (j, rows.sum(-1), want)
        assert torch.equal(chain.valid.sum(-1), rows.sum(-1))  # distinct positions
        kept = rows
    assert [c.positions.shape[1] for c in chains] == [112, 78, 54, 38, 32, 32]  # row 0's 160 supervised positions
    assert chain_sample(supervised, 1, 0.7, 0.2) == []  # one depth: nothing to sample


def test_a_sampled_pass_computes_what_the_full_unroll_does_at_its_chains(make_tiny_llama):
    """Training on sampled chains changes which drafts are scored, not their values: every sampled
    row of pass j equals the full parallel unroll's (the ancestors it attends to were computed)."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47)
    torch.manual_seed(2)
    ids = torch.randint(0, 47, (2, 40))
    padding = torch.ones_like(ids)
    padding[1, 31:] = 0
    loss_mask = padding.clone()
    loss_mask[:, :6] = 0
    steps = 5
    with torch.no_grad():
        features = torch.cat([aux_features(target, row.tolist(), AUX) for row in ids])
        full = _parallel_unroll(head, ids, features[:, :-1], padding, steps)
        chains = chain_sample(supervised_next(loss_mask, padding), steps, 0.5, 0.25)
        sampled = _parallel_unroll(head, ids, features[:, :-1], padding, steps, chains)
    torch.testing.assert_close(sampled[0], full[0], atol=1e-5, rtol=1e-4)
    for j, chain in enumerate(chains, start=1):
        rows = chain.rows(ids.shape[1] - 1)
        assert rows.sum() > 0
        torch.testing.assert_close(sampled[j][rows], full[j][rows], atol=1e-5, rtol=1e-4)
        assert not sampled[j][~rows].any()


def test_the_tasks_later_passes_read_the_mask_token_and_no_feature(make_tiny_llama):
    """What each head call of P-EAGLE's training loss reads, full and chain-sampled: pass 0 the real
    tokens and the target's features, every later pass only the mask token and no feature nor fed-back
    output (the head's mask feature), so no pass reads another's output."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47).train()
    steps = 4
    torch.manual_seed(2)
    ids = torch.randint(0, 47, (2, 40))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    seen = []
    head.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            (args[0], sorted(k for k in kwargs if k in ("features", "hidden_states")))
        ),
        with_kwargs=True,
    )
    for ratio in (1.0, 0.5):  # every position, then sampled chains
        drafter = PEagleDrafterConfig(ttt_steps=steps, aux_layers=list(AUX), down_sample_ratio=ratio)
        task = PEagleTask(PEagleRecipe(drafter=drafter), target, head)
        seen.clear()
        task.loss(head, batch, training=True)
        assert len(seen) == steps
        assert torch.equal(seen[0][0], ids[:, 1:]) and seen[0][1] == ["features"]
        widths = [pass_ids.shape[1] for pass_ids, _ in seen[1:]]
        assert (widths == [39] * 3) if ratio == 1.0 else (max(widths) < 39), widths
        for pass_ids, inputs in seen[1:]:
            assert (pass_ids == 47).all() and inputs == [], (pass_ids, inputs)


def test_the_training_loss_is_one_mean_over_every_sampled_draft_of_every_depth(make_tiny_llama):
    """As speculators (losses/utils.py loss_function over all COD-sampled rows) and SpecForge
    (compute_peagle_metrics) reduce it: the soft cross-entropy of every scored draft, all depths
    together, divided once by their count; chain sampling's row counts then weigh the depths
    (not each depth's own mean, summed, which weighs a depth-7 draft like several depth-1 ones)."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47).train()
    steps = 4
    drafter = PEagleDrafterConfig(ttt_steps=steps, aux_layers=[0, 1, 2], down_sample_ratio=0.5)
    task = PEagleTask(PEagleRecipe(drafter=drafter), target, head)
    torch.manual_seed(2)
    ids = torch.randint(0, 47, (2, 40))
    padding = torch.ones_like(ids)
    padding[1, 31:] = 0
    loss_mask = padding.clone()
    loss_mask[:, :6] = 0
    batch = {"input_ids": ids, "attention_mask": padding, "loss_mask": loss_mask}
    torch.manual_seed(5)
    chains = task.sample_chains(batch, task.cfg.ttt_steps)
    torch.manual_seed(5)
    loss, _ = task.loss(head, batch, training=True)
    with torch.no_grad():
        out = target.get_decoder()(input_ids=ids, attention_mask=padding, output_hidden_states=True)
        features = torch.cat([out.hidden_states[layer] for layer in (0, 1, 2)], dim=-1)
        outputs = _parallel_unroll(head, ids, features[:, :-1], padding, steps)
        needed = supervised_next(loss_mask, padding)
        per_depth = []
        for j, pred in enumerate(outputs):
            n = ids.shape[1] - 1 - j
            rows = needed[:, j : j + n] & (chains[j - 1].rows(n + j)[:, :n] if j else True)
            p = head.target_logits(out.last_hidden_state[:, 1:][:, j : j + n][rows]).softmax(-1)
            per_depth.append(-(p * head.draft_logits(pred[:, :n][rows]).log_softmax(-1)).sum(-1))
    counts = [len(ce) for ce in per_depth]
    assert counts[0] > counts[1] > counts[2] > counts[3] > 0, counts  # sampling thins the deep depths
    pooled = torch.cat(per_depth).mean()
    torch.testing.assert_close(loss, pooled, atol=1e-5, rtol=1e-5)
    assert abs(pooled - sum(ce.mean() for ce in per_depth)) > 1.0  # the old reduction is far from it


def test_the_head_trains_its_own_embedding_table_and_drafts_with_it(make_tiny_llama, tmp_path):
    """As speculators trains P-EAGLE (``embed_requires_grad: True``, "matches p-eagle-train"): the
    head's token table starts as the target's and every row a batch reads gets a gradient, the
    mask token's and the real tokens' (not the mask row only); the checkpoint keeps the trained
    table and the engine's drafter embeds with it, not with the target's."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    torch.manual_seed(1)
    head = PEagleHead.for_target(target, "tiny", [0, 1, 2], None, "random", mask_token_id=47, num_depths=3)
    table = target.get_input_embeddings().weight
    assert torch.equal(head.embed_tokens.weight, table) and head.embed_tokens.weight.requires_grad
    drafter = PEagleDrafterConfig(ttt_steps=3, aux_layers=[0, 1, 2], down_sample_ratio=1.0)
    task = PEagleTask(PEagleRecipe(drafter=drafter), target, head.train())
    torch.manual_seed(2)
    ids = torch.randint(0, 40, (2, 24))  # tokens 40..46 never occur
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, _ = task.loss(head, batch, training=True)
    loss.backward()
    moved = head.embed_tokens.weight.grad.abs().sum(-1) > 0
    read = set(ids[:, 1:].flatten().tolist()) | {47}  # pass 0 embeds tokens 1.., passes 1.. the mask token
    assert set(moved.nonzero().flatten().tolist()) == read
    with torch.no_grad():
        head.embed_tokens.weight.sub_(0.5 * head.embed_tokens.weight.grad.sign())  # a "trained" table
    head.eval().save_pretrained(tmp_path / "ckpt")
    loaded = build_drafter(f"peagle:{tmp_path / 'ckpt'}", target).head
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)
    features = torch.randn(1, 4, 3 * 32)
    with torch.no_grad():
        trained = loaded.draft_logits(loaded(ids[:1, :4], features).last_hidden_state)
        torch.testing.assert_close(trained, head.draft_logits(head(ids[:1, :4], features).last_hidden_state))
        loaded.embed_tokens.weight.copy_(table)
        assert (loaded.draft_logits(loaded(ids[:1, :4], features).last_hidden_state) - trained).abs().max() > 1e-2


def test_a_checkpoint_from_before_the_table_trained_loads_with_the_targets_table(make_tiny_llama, tmp_path):
    """Checkpoints that kept only the mask row (``mask_embedding``) load with the target's table and
    that row, which is what they drafted with."""
    from safetensors.torch import load_file, save_file

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47)
    head.save_pretrained(tmp_path / "ckpt")
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    row = state.pop("embed_tokens.weight")[47].clone()
    save_file({**state, "mask_embedding": row}, str(tmp_path / "ckpt" / "model.safetensors"))
    loaded = PEagleHead.from_pretrained(tmp_path / "ckpt", target)
    want = target.get_input_embeddings().weight.detach().clone()
    want[47] = row
    assert torch.equal(loaded.embed_tokens.weight, want)


def test_a_head_of_four_layers_has_vllms_layout_and_saves_and_loads_with_its_layers(make_tiny_llama, tmp_path):
    """``num_layers=4``: layer 0 reads ``[embedding ; hidden]`` (q/k/v over 2 x hidden, ``hidden_norm``),
    layers 1..3 are the target's plain decoder layers over the hidden state (q/k/v over hidden, no
    ``hidden_norm``), as vLLM's ``llama_eagle3.py`` and speculators' ``Eagle3DraftModel`` build them,
    each with its own cache slot; every layer changes the drafts; the checkpoint records 4 layers and
    reloads (directly and through the registry) with the same outputs; a checkpoint from before the
    option (no ``num_layers``) loads with one layer."""
    import json

    from safetensors.torch import load_file

    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, num_layers=4)
    assert len(head.layers) == 4 and head.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in head.layers] == [0, 1, 2, 3]
    head.save_pretrained(tmp_path / "ckpt")
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert state["layers.0.self_attn.q_proj.weight"].shape == (32, 64) and "layers.0.hidden_norm.weight" in state
    for i in (1, 2, 3):
        assert state[f"layers.{i}.self_attn.q_proj.weight"].shape == (32, 32)
        assert state[f"layers.{i}.self_attn.k_proj.weight"].shape == (16, 32)
        assert f"layers.{i}.input_layernorm.weight" in state and f"layers.{i}.mlp.down_proj.weight" in state
        assert f"layers.{i}.hidden_norm.weight" not in state
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["num_layers"] == 4 and config["target_config"]["num_hidden_layers"] == 4

    ids = torch.tensor([[3, 9, 4, 17, 47, 47]])
    features = aux_features(target, [3, 9, 4, 17, 6, 11], AUX)
    loaded = PEagleHead.from_pretrained(tmp_path / "ckpt", target).eval()
    served = build_drafter(f"peagle:{tmp_path / 'ckpt'}", target).head
    with torch.no_grad():
        want = head.draft_logits(head(ids, features).last_hidden_state)
        assert len(loaded.layers) == len(served.layers) == 4
        assert torch.equal(loaded.draft_logits(loaded(ids, features).last_hidden_state), want)
        assert torch.equal(served.draft_logits(served(ids, features).last_hidden_state), want)
        for i in (1, 3):  # every layer is in the path: zeroing one's MLP output moves the drafts
            loaded.layers[i].mlp.down_proj.weight.zero_()
            assert (loaded.draft_logits(loaded(ids, features).last_hidden_state) - want).abs().max() > 1e-2

    one = _head(target, mask=47)
    one.save_pretrained(tmp_path / "old")
    old = json.loads((tmp_path / "old" / "config.json").read_text())
    del old["num_layers"]  # written before the option
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    again = PEagleHead.from_pretrained(tmp_path / "old", target).eval()
    assert len(again.layers) == 1
    with torch.no_grad():
        torch.testing.assert_close(
            again.draft_logits(again(ids, features).last_hidden_state),
            one.draft_logits(one(ids, features).last_hidden_state),
            rtol=0,
            atol=0,
        )
    with pytest.raises(ValueError, match="at least one decoder layer"):
        PEagleHead.for_target(target, "tiny", [0, 1, 2], None, mask_token_id=47, num_layers=0)


def test_the_drafter_proposes_what_the_parallel_unroll_scores(make_tiny_llama):
    """Through the engine's protocol, the drafter's greedy chain after token t + 1 is the parallel
    unroll's argmax of pass j at position t for every depth j + 1."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47, draft_vocab=[0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47])
    ids = [3, 9, 4, 17, 6, 11, 2, 30, 8, 5, 14, 22]
    t = 5
    with torch.no_grad():
        features = aux_features(target, ids, AUX)
        outputs = _parallel_unroll(
            head, torch.tensor([ids]), features[:, :-1], torch.ones(1, len(ids), dtype=torch.long), 4
        )
    want = [int(head.draft_vocab[head.draft_logits(out[0, t]).argmax()]) for out in outputs]
    drafter = PEagleDrafter(head)
    drafter.begin(ids[: t + 2], features[0, : t + 1])  # the root is token t + 1
    tree = drafter.propose(DraftContext(ids[: t + 2], SamplingConfig(), None, max_tokens=10))
    assert drafter.depth == 4 and tree.tokens == want and tree.parents == [-1, 0, 1, 2]


def test_greedy_peagle_is_lossless_and_drafts_in_one_pass(tiny_target, tmp_path):
    """Greedy decoding with P-EAGLE gives plain decoding's tokens; a checkpoint loads through the
    registry with its trained depth; one head forward per step whatever the depth."""
    head = _head(tiny_target, mask=7, init="identity")
    head.save_pretrained(tmp_path / "ckpt")
    drafter = build_drafter(f"peagle:{tmp_path / 'ckpt'}", tiny_target)
    assert isinstance(drafter, PEagleDrafter) and drafter.depth == 4 and drafter.head.mask_token_id == 7
    calls = []
    drafter.head.register_forward_hook(lambda *args: calls.append(1))
    plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
    produced = steps = 0
    for prompt in (PROMPT, [1, 1, 6], list(range(8)) * 3):
        want = plain.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == want.tokens
        produced, steps = produced + sum(got.accepted), steps + got.steps
    assert len(calls) == steps  # one pass a step
    assert produced / steps > 1.1  # drafts were accepted along the way


def test_sampling_with_peagle_matches_exact_distribution(tiny_target):
    drafter = PEagleDrafter(_head(tiny_target, mask=7, draft_vocab=[0, 2, 3, 5, 6, 7], init="identity"), depth=3)
    accepted = assert_distributed_as_target(tiny_target, drafter, PROMPT, 4, SAMPLES)
    assert sum(n for a, n in accepted.items() if max(a) > 1) > 100, accepted  # drafts were accepted, often


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    drafter = {"kind": "peagle", "aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 512}
    return tiny_training_recipe(tmp_path_factory.mktemp("peagle"), drafter)


def test_training_lowers_the_loss_and_saves_a_head_the_engine_drafts_with(tiny_recipe, tmp_path):
    """Training picks a mask token the data never uses (SmolLM2's tokenizer has no spare one),
    lowers the loss, records held-out accuracy per depth and saves a head that loads and drafts."""
    from draftsmith.train.peagle import main

    trainer = main([str(tiny_recipe), "--output_dir", str(tmp_path / "run")])
    losses = [h["train/loss"] for h in trainer.history if "train/loss" in h]
    assert losses[-1] < losses[0] - 0.05, losses
    tokenizer = load_tokenizer("default")
    mask = trainer.task.model.mask_token_id
    assert mask == unused_token_id(tokenizer, trainer.train_data, len(tokenizer))
    assert tokenizer.added_tokens_decoder[mask].special and mask not in (tokenizer.eos_token_id, tokenizer.bos_token_id)
    assert all(mask not in row["input_ids"] for row in trainer.train_data)
    head = PEagleHead.from_pretrained(trainer.last_checkpoint)
    assert (head.mask_token_id, head.num_depths, len(head.depth_accuracy)) == (mask, 3, 3)
    trained = trainer.task.model.state_dict()
    assert all(torch.equal(value, trained[key].to(value.dtype)) for key, value in head.state_dict().items())


def test_training_a_head_of_two_layers_trains_both_and_saves_them(tiny_recipe, tmp_path, capsys):
    """``drafter.num_layers: 2``: the head is built with two layers, training moves the second (its
    output projections start at zero with the identity init, so only gradients through it move
    them), and the checkpoint reloads with both, as trained; ``num_layers: 0`` is a one-line error."""
    from cli_helpers import assert_user_error

    from draftsmith.train.peagle import main

    run = tmp_path / "run"
    trainer = main(
        [str(tiny_recipe), "--output_dir", str(run), "--drafter.num_layers", "2", "--training.max_steps", "4"]
    )
    losses = [h["train/loss"] for h in trainer.history if "train/loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
    head = PEagleHead.from_pretrained(trainer.last_checkpoint)
    assert len(head.layers) == 2 and head.layers[1].self_attn.layer_idx == 1
    trained = trainer.task.model.state_dict()
    assert all(torch.equal(value, trained[key].to(value.dtype)) for key, value in head.state_dict().items())
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # zero at the start: moved by training
        assert head.layers[1].get_submodule(name.rsplit(".", 1)[0]).weight.abs().max() > 0, name
    assert_user_error(
        capsys,
        r"drafter\.num_layers must be an integer >= 1, got 0$",
        main,
        [str(tiny_recipe), "--output_dir", str(tmp_path / "never"), "--drafter.num_layers", "0"],
    )
    assert not (tmp_path / "never").exists()


def test_the_heads_own_table_starts_as_the_targets_module_embeds_gemmas_scale_included():
    """A P-EAGLE head's table is a plain embedding: it starts as the rows the target's embedding
    module gives (Gemma 3 scales its lookups by sqrt(hidden)), not the raw weights, or every
    token would enter the head at the wrong size."""
    from family_targets import tiny_family

    target = tiny_family("gemma3")
    head = PEagleHead.for_target(target, "tiny", [0, 1, 2], mask_token_id=3, num_depths=2)
    ids = torch.tensor([[5, 9, 17, 40]])
    with torch.no_grad():
        expected = target.get_input_embeddings()(ids)
        raw = target.get_input_embeddings().weight[ids]
    torch.testing.assert_close(head.embed(ids), expected)
    assert not torch.allclose(raw, expected)  # the scale is there to be missed


def test_reach_keeps_the_pass_that_trains_the_mask_feature(make_tiny_llama):
    """Under ``depth_weighting: reach`` a P-EAGLE step keeps its second pass however low the logged
    rates: only passes j > 0 read ``mask_hidden``, and DDP expects every parameter's gradient every
    step. Its graph reaches ``mask_hidden`` (a gradient, zero where depth 1's rate on the batch was 0);
    EAGLE-3 may drop to one pass."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    head = _head(target, mask=47).train()
    drafter = PEagleDrafterConfig(ttt_steps=4, aux_layers=[0, 1, 2], depth_weighting="reach")
    task = PEagleTask(PEagleRecipe(drafter=drafter), target, head)
    task.window_rates = [0.01, 0.01, 0.01]  # depth 2's reach 0.01, below the 0.05 floor
    assert task.passes() == 2
    eagle3 = Eagle3Task(Eagle3Recipe(drafter=Eagle3DrafterConfig(ttt_steps=4, depth_weighting="reach")), target, head)
    eagle3.window_rates = [0.01]
    assert eagle3.passes() == 1
    ids = torch.randint(0, 47, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, metrics = task.loss(head, batch, training=True)
    loss.backward()
    assert "rows@2" in metrics and "rows@3" not in metrics
    assert head.mask_hidden.grad is not None
