"""Greedy speculative decoding is lossless: every drafter gives exactly the plain greedy tokens.

The bundled SmolLM2 (fp32) decodes five chat prompts plainly once (module-scoped reference);
each drafter must reproduce those tokens exactly, and the step bookkeeping must add up.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from tree_drafters import GreedyPrefixDrafter, RandomTreeDrafter

from draftsmith.data_prep.chat import render_prompt
from draftsmith.eval.engine.decode import SpeculativeDecoder, autoregressive_greedy
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.hybrid import HybridDrafter
from draftsmith.eval.engine.drafters.medusa import MedusaDrafter, optimal_choices
from draftsmith.eval.engine.drafters.oracle import OracleDrafter
from draftsmith.eval.engine.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.eval.engine.drafters.suffix import SuffixDrafter
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.heads.medusa import MedusaHeads, rank_accuracy

NEW_TOKENS = 64  # the plain reference's length; Medusa's test decodes all of it
# The other drafters decode the reference's first TOKENS (SmolLM2 costs ~0.1 s a token here, and every
# check below holds by then); Medusa's deeper heads are first accepted later, in a repetitive answer.
TOKENS = 48

MESSAGES = [
    "Repeat the following sentence exactly three times: The little robot walked to the market to "
    "buy fresh apples and warm bread.",  # short answer that ends with EOS
    "Here is a Python function:\n```python\ndef add_numbers(first_number, second_number):\n"
    "    result = first_number + second_number\n    return result\n```\n"
    "Rewrite it with type hints and a docstring.",
    "Write a short story about a dragon who learns to bake bread.",
    "Explain in detail how a bicycle works, covering the frame, wheels, chain, gears and brakes.",
    "Write a Python function that checks whether a string is a palindrome, then explain it line by line.",
]
REPETITIVE = (0, 1, 3)  # answers that copy the prompt or repeat themselves
# The costliest drafters (a draft-LM step costs ~2.5 plain steps on this CPU, a random tree step
# ~1.2 with nothing accepted) run on a subset to keep the file near 2 minutes; the cheap ones and
# the tiny-model tests below cover every prompt / many more trees.
DRAFT_LM_PROMPTS = (0, 1, 3)
RANDOM_TREE_PROMPTS = (0, 2)
# The oracle drafts with the target itself (8 target passes a step): one answer that ends with EOS,
# one that runs the full length.
ORACLE_PROMPTS = (0, 2)


def check_bookkeeping(
    gen, plain: list[int], max_depth: int | None = None, most_nodes: int | None = None, new_tokens: int = TOKENS
) -> None:
    """The generation of ``new_tokens`` has the plain reference's tokens and its steps add up; with
    ``most_nodes``, every step with room to draft verified 1 to ``most_nodes`` drafted nodes (a
    drafter that drafted nothing would still be lossless)."""
    reference = plain[:new_tokens]
    assert gen.tokens == reference
    assert len(gen.accepted) == gen.steps == len(gen.drafted)
    # The first token comes from prefill; every later one from exactly one step.
    assert sum(gen.accepted) == len(gen.tokens) - 1
    assert all(a >= 1 for a in gen.accepted)
    if max_depth is not None:
        assert all(a <= max_depth + 1 for a in gen.accepted)
    expected_reason = "eos" if len(reference) < new_tokens else "length"
    assert gen.stop_reason == expected_reason
    if most_nodes is not None:
        produced = itertools.accumulate([1, *gen.accepted])  # new tokens before each step
        for step, (before, nodes) in enumerate(zip(produced, gen.drafted)):
            room = new_tokens - before - 1  # drafted tokens the step can still keep
            assert (1 <= nodes <= most_nodes) if room > 0 else nodes == 0, (step, gen.drafted)


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def target(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def prompts(target):
    _, tokenizer = target
    return [render_prompt(tokenizer, [{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.fixture(scope="module")
def plain(target, prompts):
    model, tokenizer = target
    decoder = SpeculativeDecoder(model, None, tokenizer)
    outputs = []
    for prompt in prompts:
        gen = decoder.generate(prompt, NEW_TOKENS)
        assert gen.steps == len(gen.tokens) - 1 and gen.accepted == [1] * gen.steps
        outputs.append(gen.tokens)
    # One answer ends with EOS, the others run the full length.
    assert [len(o) == NEW_TOKENS for o in outputs] == [False, True, True, True, True]
    return outputs


@pytest.fixture(scope="module")
def small_draft(target):
    """The target's first 2 layers (plus its embeddings, final norm and head) as a draft LM."""
    model, _ = target
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:2]
    draft.config.num_hidden_layers = 2
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:2]
    return draft


# ---------------------------------------------------------------------------------------------
# Tests on the bundled SmolLM2


@pytest.mark.slow
def test_plain_decoder_matches_hf_generate(target, prompts, plain):
    model, _ = target
    for i in (0, 2):  # one that stops at EOS, one that runs the full length
        ids = torch.tensor([prompts[i]])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=2
            )
        assert out[0, ids.shape[1] :].tolist() == plain[i]
    # ... and the oracle's reference decode (no EOS handling) continues past the EOS.
    continued = autoregressive_greedy(CausalLMRunner(model), prompts[0], len(plain[0]) + 3)
    assert continued[: len(plain[0])] == plain[0] and len(continued) == len(plain[0]) + 3


@pytest.mark.slow
@pytest.mark.parametrize("branches", [1, 3])
def test_prompt_lookup_is_lossless(target, prompts, plain, branches):
    model, tokenizer = target
    decoder = SpeculativeDecoder(model, PromptLookupDrafter(num_tokens=6, branches=branches), tokenizer)
    saved = 0
    for i, (prompt, reference) in enumerate(zip(prompts, plain)):
        gen = decoder.generate(prompt, TOKENS)
        check_bookkeeping(gen, reference, max_depth=6)
        if i in REPETITIVE:
            saved += (len(gen.tokens) - 1) - gen.steps
    # Prompt lookup really accepts drafts on the copying prompts (each saved step is a token).
    assert saved >= 20


@pytest.mark.slow
def test_oracle_is_lossless_and_accepts_everything(target, prompts, plain):
    model, tokenizer = target
    decoder = SpeculativeDecoder(model, OracleDrafter(CausalLMRunner(model), num_tokens=8), tokenizer)
    for i in ORACLE_PROMPTS:
        prompt, reference = prompts[i], plain[i]
        gen = decoder.generate(prompt, TOKENS)
        check_bookkeeping(gen, reference, max_depth=8)
        # Every drafted token is accepted: 9 tokens per step until the end.
        assert gen.steps == math.ceil((len(gen.tokens) - 1) / 9)
        assert all(a == 9 for a in gen.accepted[:-1])
        if len(gen.tokens) == TOKENS:
            assert gen.acceptance_length > 4


def _check_prompts(decoder, prompts, plain, indices, max_depth=4, most_nodes=None, new_tokens=TOKENS):
    generations = [decoder.generate(prompts[i], new_tokens) for i in indices]
    for i, gen in zip(indices, generations):
        check_bookkeeping(gen, plain[i], max_depth=max_depth, most_nodes=most_nodes, new_tokens=new_tokens)
    return generations


@pytest.mark.slow
@pytest.mark.parametrize("top_k,budget", [(1, None), (3, 10)], ids=["chain", "tree"])
def test_draft_lm_is_lossless(target, prompts, plain, small_draft, top_k, budget):
    model, tokenizer = target
    drafter = DraftLMDrafter(small_draft, depth=4, top_k=top_k, budget=budget)
    decoder = SpeculativeDecoder(model, drafter, tokenizer)
    _check_prompts(decoder, prompts, plain, DRAFT_LM_PROMPTS, most_nodes=budget or 4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["path", "tree"])
def test_suffix_is_lossless(target, prompts, plain, shape):
    model, tokenizer = target
    decoder = SpeculativeDecoder(model, SuffixDrafter(num_tokens=8, shape=shape), tokenizer)
    saved = 0
    for prompt, reference in zip(prompts, plain):
        gen = decoder.generate(prompt, TOKENS)
        check_bookkeeping(gen, reference, max_depth=8)
        saved += (len(gen.tokens) - 1) - gen.steps
    # Suffix drafts really are accepted (the copying prompts, and earlier outputs it has cached).
    assert saved >= 20


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["switch", "merge"])
def test_hybrid_of_a_draft_lm_and_suffix_is_lossless(target, prompts, plain, small_draft, mode):
    model, tokenizer = target
    parts = [DraftLMDrafter(small_draft, depth=3, top_k=2, budget=6), SuffixDrafter(num_tokens=8)]
    drafter = HybridDrafter(parts, learned=[True, False], budget=12, mode=mode)
    decoder = SpeculativeDecoder(model, drafter, tokenizer)
    for i in DRAFT_LM_PROMPTS:
        gen = decoder.generate(prompts[i], TOKENS)
        check_bookkeeping(gen, plain[i], max_depth=12)
        # Per generation: a step may decode plainly (a tree whose nodes do not pay, or a skipped
        # learned part with no lookup match), but every generation drafts, within the budget.
        assert 0 < sum(gen.drafted) and max(gen.drafted) <= 12, (i, gen.drafted)
    if mode == "switch":  # a confident suffix draft skipped the draft LM in some steps
        assert drafter.skipped > 0
    else:
        assert drafter.skipped == 0


@pytest.mark.slow
def test_medusa_is_lossless(target, prompts, plain):
    """Medusa heads (fresh ones, perturbed so their guesses vary) over a 12-node static tree."""
    model, tokenizer = target
    heads = MedusaHeads.for_target(model, "default", num_heads=4, num_layers=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.copy_(torch.randn(block[0].linear.weight.shape, generator=generator) * 0.02)
    accuracy = [[0.6, 0.7, 0.75], [0.4, 0.5, 0.55], [0.3, 0.35, 0.4], [0.2, 0.25, 0.3]]
    drafter = MedusaDrafter(heads, optimal_choices(rank_accuracy(accuracy), 12))
    decoder = SpeculativeDecoder(model, drafter, tokenizer)
    generations = _check_prompts(decoder, prompts, plain, REPETITIVE, most_nodes=12, new_tokens=NEW_TOKENS)
    assert max(a for gen in generations for a in gen.accepted) >= 3  # deeper heads' guesses were accepted too


@pytest.mark.slow
def test_random_trees_are_lossless(target, prompts, plain):
    model, tokenizer = target
    decoder = SpeculativeDecoder(model, RandomTreeDrafter(model.config.vocab_size, seed=1), tokenizer)
    _check_prompts(decoder, prompts, plain, RANDOM_TREE_PROMPTS)


@pytest.mark.slow
def test_scattered_correct_paths_are_accepted_exactly(target, prompts, plain):
    model, tokenizer = target
    noncontiguous = 0
    for seed, (prompt, reference) in enumerate(zip(prompts, plain)):
        drafter = GreedyPrefixDrafter(prompt, reference[:TOKENS], model.config.vocab_size, seed=seed)
        gen = SpeculativeDecoder(model, drafter, tokenizer).generate(prompt, TOKENS)
        check_bookkeeping(gen, reference, max_depth=7)
        # Each step yields exactly the correct drafted tokens plus the bonus token.
        assert gen.accepted == drafter.expected
        noncontiguous += drafter.noncontiguous
    assert noncontiguous >= 20


# ---------------------------------------------------------------------------------------------
# Fast checks on a tiny random model


def test_draft_lm_equal_to_target_accepts_every_token(make_tiny_llama):
    """A draft LM with the target's own weights must be fully accepted: its cache stays in sync."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=11)
    prompt = [5, 9, 3, 17, 22, 8]
    plain = SpeculativeDecoder(model, None, eos_ids=set()).generate(prompt, 40)
    assert plain.accepted == [1] * 39
    for depth in (1, 4):
        gen = SpeculativeDecoder(model, DraftLMDrafter(model, depth=depth), eos_ids=set()).generate(prompt, 40)
        assert gen.tokens == plain.tokens
        assert gen.accepted[:-1] == [depth + 1] * (len(gen.accepted) - 1)
        assert sum(gen.accepted) == 39 and gen.steps == math.ceil(39 / (depth + 1))
    # A dynamic tree from the exact target always contains the greedy token at depth 1.
    tree = DraftLMDrafter(model, depth=3, top_k=2, budget=5)
    gen = SpeculativeDecoder(model, tree, eos_ids=set()).generate(prompt, 40)
    assert gen.tokens == plain.tokens and all(a >= 2 for a in gen.accepted[:-1])


@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_tiny_drafters_are_lossless(make_tiny_llama, cuda_graphs):
    target = make_tiny_llama(vocab_size=32, hidden_size=32, layers=2, seed=4)
    draft = make_tiny_llama(vocab_size=32, hidden_size=32, layers=1, seed=5)
    rng = random.Random(0)
    for trial in range(4):
        prompt = [rng.randrange(32) for _ in range(10)] * 2
        reference = SpeculativeDecoder(target, None, eos_ids=set()).generate(prompt, 30).tokens
        drafters = [
            PromptLookupDrafter(branches=3),
            OracleDrafter(CausalLMRunner(target), num_tokens=5),
            DraftLMDrafter(draft, depth=3, top_k=3, budget=6),
            RandomTreeDrafter(32, seed=trial),
            GreedyPrefixDrafter(prompt, reference, 32, seed=trial),
        ]
        for drafter in drafters:
            gen = SpeculativeDecoder(target, drafter, eos_ids=set(), cuda_graphs=cuda_graphs).generate(prompt, 30)
            assert gen.tokens == reference, drafter.name
            assert sum(gen.accepted) == 29 and len(gen.accepted) == gen.steps
            if isinstance(drafter, GreedyPrefixDrafter):
                assert gen.accepted == drafter.expected
