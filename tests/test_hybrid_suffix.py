"""Suffix drafts, hybrid trees and prepacked linears: the pieces, on real values."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from tree_drafters import RandomTreeDrafter

from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter, parse_spec, split_parts
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, StepResult
from draftsmith.eval.engine.drafters.hybrid import HybridDrafter, merge_trees
from draftsmith.eval.engine.drafters.suffix import SuffixDrafter
from draftsmith.eval.engine.pass_cost import priced_size
from draftsmith.eval.engine.prepack import PackedForward, available, packed, prepack_linears, unpack_linears
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.tree import ROOT, TreeBuilder

GREEDY = SamplingConfig()


def context(tokens, max_tokens=8):
    return DraftContext(list(tokens), GREEDY, None, max_tokens)


def test_suffix_drafts_the_continuation_seen_before_with_its_estimates():
    drafter = SuffixDrafter(num_tokens=4, max_spec_factor=4.0)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6]
    drafter.begin(prompt + [7], None)
    tree = drafter.propose(context(prompt + [7]))
    # The context ends in 5 6 7, seen once before, followed by 8 9 10: a chain of those.
    assert tree.tokens[:3] == [8, 9, 10] and tree.parents[:3] == [ROOT, 0, 1]
    assert all(s <= 0 for s in tree.scores) and tree.scores == sorted(tree.scores, reverse=True)
    # The accepted tokens extend the request's tree: what was drafted becomes the history.
    drafter.accept(StepResult([8, 9, 10], None, prompt + [7, 8, 9, 10]))
    drafter.begin([1, 2, 5, 6, 7], None)  # a new generation sees the earlier output
    again = drafter.propose(context([1, 2, 5, 6, 7]))
    assert again.tokens[:1] == [8]


def test_suffix_respects_the_remaining_budget_and_empty_matches():
    drafter = SuffixDrafter(num_tokens=8, max_spec_factor=8.0)
    drafter.begin([1, 2, 3, 1, 2], None)
    assert len(drafter.propose(context([1, 2, 3, 1, 2], max_tokens=1))) == 1
    assert len(drafter.propose(context([1, 2, 3, 1, 2], max_tokens=0))) == 0
    drafter.begin([40, 41, 42], None)
    assert len(drafter.propose(context([40, 41, 42]))) == 0


def _tree(paths: list[tuple[list[int], float]]):
    """A deterministic tree from (token path, log estimate of its last node) pairs, parents first."""
    builder, node_of, score_of = TreeBuilder(), {(): ROOT}, {(): 0.0}
    children: dict[tuple, list] = {}
    for path, score in paths:
        children.setdefault(tuple(path[:-1]), []).append((path[-1], score))
        score_of[tuple(path)] = score
    for parent in sorted(children, key=len):
        tokens = [t for t, _ in children[parent]]
        ids = builder.add(node_of[parent], tokens, [s - score_of[parent] for _, s in children[parent]])
        node_of.update({parent + (t,): i for t, i in zip(tokens, ids)})
    return builder.build()


def test_merge_shares_paths_and_gives_the_budget_to_the_likeliest_nodes():
    learned = _tree([([1], math.log(0.6)), ([2], math.log(0.3)), ([1, 3], math.log(0.4))])
    lookup = _tree([([1], math.log(0.9)), ([1, 4], math.log(0.8)), ([1, 4, 5], math.log(0.7))])
    merged = merge_trees([learned, lookup], [learned.scores, lookup.scores], budget=4, greedy=True)
    paths = {tuple(merged.tokens[n] for n in merged.path_to(i)) for i in range(len(merged))}
    # [1] is one node (its best estimate 0.9); the 4 likeliest: 1, 1-4, 1-4-5, 1-3; 2 (0.3) is cut.
    assert paths == {(1,), (1, 4), (1, 4, 5), (1, 3)}
    assert merged.proposals[0].tokens == [3, 4]  # both parts' candidates below the shared node
    assert math.isclose(math.exp(max(merged.scores)), 0.9, rel_tol=1e-6)


def test_merge_for_sampling_keeps_one_proposal_per_parent():
    q = torch.tensor([0.1, 0.6, 0.3])
    builder = TreeBuilder()
    (a, b) = builder.add(ROOT, [1, 2], [math.log(0.6), math.log(0.3)], probs=q)
    sampled = builder.build()
    lookup = _tree([([2], math.log(0.9)), ([2, 0], math.log(0.8)), ([0], math.log(0.5))])
    merged = merge_trees([sampled, lookup], [sampled.scores, lookup.scores], budget=10, greedy=False)
    # The root's candidates are the sampled part's draws (its q kept); the lookup's root token 0 and
    # its subtree are dropped, but its child under the shared node 2 stays (the sampled part has none).
    assert merged.proposals[ROOT].tokens == [1, 2] and merged.proposals[ROOT].probs is q
    node_2 = merged.proposals[ROOT].nodes[1]
    assert merged.proposals[node_2].tokens == [0] and merged.proposals[node_2].probs is None
    assert sorted(merged.tokens) == [0, 1, 2]


def test_hybrid_specs_parse_with_parenthesised_parts():
    assert split_parts("(eagle3:a?depth=4)+suffix+(prompt_lookup?num_tokens=3&branches=2)") == [
        "eagle3:a?depth=4",
        "suffix",
        "prompt_lookup?num_tokens=3&branches=2",
    ]
    spec = parse_spec("hybrid:(prompt_lookup?num_tokens=3)+suffix?budget=12&mode=merge")
    assert spec.path == "(prompt_lookup?num_tokens=3)+suffix"
    assert spec.options == {"budget": 12, "mode": "merge"} and spec.name == "hybrid:prompt_lookup+suffix"
    for bad in ("hybrid:suffix", "hybrid:(suffix+prompt_lookup", "hybrid:suffix+"):
        with pytest.raises(UsageError):
            split_parts(bad.removeprefix("hybrid:"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linears_compute_what_f_linear_does(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32, bias=False)).to(dtype)
    x = torch.randn(1, 13, 64).to(dtype)
    with torch.no_grad():
        before = model(x)
        if not available(torch.device("cpu"), dtype):  # bf16 on an AVX2-only CPU: nothing packs
            assert prepack_linears(model, "on") == 0 and "forward" not in vars(model[0])
            return
        assert prepack_linears(model, "on") == 2 and isinstance(model[0].forward, PackedForward)
        with packed():
            after = model(x)
        assert torch.equal(model(x), before)  # outside the engine: exactly the plain computation
        assert prepack_linears(model, "on") == 0  # already packed
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(after, before, atol=tolerance, rtol=tolerance)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight"}
    assert unpack_linears(model) == 2 and "forward" not in vars(model[0])


def test_prepacked_linears_follow_weight_changes_autograd_and_copies():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    prepack_linears(linear, "on")
    x = torch.randn(4, 16)
    with torch.no_grad(), packed():
        linear.weight.mul_(2.0)  # in place, as an optimiser step or a LoRA merge
        torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias)
    with packed():
        loss = linear(x).sum()  # with autograd: the plain path, gradients reach the weight
    loss.backward()
    torch.testing.assert_close(linear.weight.grad, x.sum(0).expand(8, 16))
    twin = copy.deepcopy(linear)  # a oneDNN tensor cannot be copied: the copy packs itself again
    with torch.no_grad(), packed():
        twin.weight.add_(1.0)
        torch.testing.assert_close(twin(x), x @ twin.weight.T + twin.bias)
        torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias)
    assert prepack_linears(nn.Linear(4, 4), "off") == 0


def test_priced_size_keeps_only_nodes_that_pay_for_their_place_in_the_pass():
    # A CPU-like pass: 2 rows cost 1.6x one row, every further row 5% more.
    costs = {n: 1.0 if n == 1 else 1.6 + 0.05 * (n - 2) for n in range(1, 18)}
    assert priced_size([0.9, 0.8, 0.7], costs, 0.0, 16) == 3  # 3.4 tokens for 1.65 > 1 token for 1.0
    assert priced_size([0.3, 0.2, 0.1], costs, 0.0, 16) == 0  # 1.6 tokens would cost 1.65: decode plainly
    assert priced_size([0.9] + [0.01] * 12, costs, 0.0, 16) == 1  # weak nodes are cut, not carried
    # Drafting already paid for makes the pass's share smaller: more nodes pay.
    assert priced_size([0.3, 0.2, 0.1], costs, 5.0, 16) == 3
    assert priced_size([0.9, 0.8], None, 0.0, 16) == 2 and priced_size([0.9] * 20, None, 0.0, 16) == 16
    assert priced_size([0.9] * 20, costs, 0.0, 30) <= 16  # never past the measured sizes


def test_merge_prices_the_tree_so_a_weak_part_gets_no_nodes():
    costs = {n: 1.0 if n == 1 else 1.6 + 0.05 * (n - 2) for n in range(1, 18)}
    strong = _tree([([1], math.log(0.9)), ([1, 4], math.log(0.8)), ([1, 4, 5], math.log(0.7))])
    weak = _tree([([2], math.log(0.05)), ([3], math.log(0.04)), ([2, 6], math.log(0.02))])
    merged = merge_trees([weak, strong], [weak.scores, strong.scores], budget=16, greedy=True, costs=costs)
    assert sorted(merged.tokens) == [1, 4, 5]  # the unpriced merge verifies all 6 nodes
    unpriced = merge_trees([weak, strong], [weak.scores, strong.scores], budget=16, greedy=True)
    assert len(unpriced) == 6
    alone = merge_trees([weak], [weak.scores], budget=16, greedy=True, costs=costs)
    assert len(alone) == 0


class _ScriptedDrafter(Drafter):
    """Drafts the next ``depth`` tokens of a known continuation (as a learned drafter with scores),
    except in the generation's steps listed in ``wrong``, where it drafts a token that is never right."""

    def __init__(self, reference: list[int], wrong: set[int], depth: int = 3, vocab: int = 64):
        self.reference, self.wrong, self.depth, self.vocab = reference, wrong, depth, vocab
        self.calls: list[int] = []  # per generation: how many times it drafted

    def prepare(self, prompt, max_new_tokens):
        self.calls.append(0)

    def propose(self, context):
        step, n = self.calls[-1], len(context.tokens)
        self.calls[-1] += 1
        builder, parent = TreeBuilder(), ROOT
        chain = self.reference[n : n + min(self.depth, context.max_tokens)]
        if step in self.wrong and chain:
            chain = [(chain[0] + 1) % self.vocab]
        for token in chain:
            (parent,) = builder.add(parent, [token], [math.log(0.9)])
        return builder.build()


def test_switch_mode_drafts_again_after_a_learned_step_that_accepted_nothing(make_tiny_llama):
    """Issue 42 (1): a first learned step that accepts nothing made the measured yield 0, and the
    lookup's `expected >= 0` skipped the learned part for the rest of the run."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    prompt = [5, 9, 3, 17, 22, 8, 41, 2]
    reference = SpeculativeDecoder(model, None, eos_ids=set()).generate(prompt, 40).tokens
    learned = _ScriptedDrafter(prompt + reference, wrong={0})
    lookup = RandomTreeDrafter(64, seed=0, max_depth=2)  # a scoreless lookup that is rarely right
    drafter = HybridDrafter([learned, lookup], learned=[True, False], budget=8, mode="switch")
    decoder = SpeculativeDecoder(model, drafter, eos_ids=set())
    for _ in range(2):
        gen = decoder.generate(prompt, 40)
        assert gen.tokens == reference
    # Each generation starts by drafting with the learned part and comes back to it once it pays;
    # once it has yielded, it drafts on (only the step after the wrong one was skipped).
    assert learned.calls[0] >= 8 and learned.calls[1] >= 8
    assert max(gen.accepted) == 4


def test_a_hybrid_from_its_spec_prices_nodes_with_the_targets_measured_pass_costs(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    priced = build_drafter(parse_spec("hybrid:prompt_lookup+suffix?budget=6"), model)
    assert sorted(priced.costs) == list(range(1, 8)) and all(c > 0 for c in priced.costs.values())
    assert build_drafter(parse_spec("hybrid:prompt_lookup+suffix?nodes=budget"), model).costs is None
    with pytest.raises(UsageError, match="nodes=all is not allowed"):
        build_drafter(parse_spec("hybrid:prompt_lookup+suffix?nodes=all"), model)


def _hybrid_run(
    make_tiny_llama,
    wrong_learned: set[int],
    mode: str = "switch",
    steps: int = 120,
    lookup_depth: int = 2,
    learned_depth: int = 3,
    generations: int = 1,
):
    """Generations with a learned part wrong in ``wrong_learned``'s steps and a scored lookup that is
    always right (``lookup_depth`` 0: it never proposes), both claiming 0.9 per token; returns
    (hybrid, learned, lookup, last generation)."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    prompt = [5, 9, 3, 17, 22, 8, 41, 2]
    reference = SpeculativeDecoder(model, None, eos_ids=set()).generate(prompt, steps).tokens
    learned = _ScriptedDrafter(prompt + reference, wrong=wrong_learned, depth=learned_depth)
    lookup = _ScriptedDrafter(prompt + reference, wrong=set(), depth=lookup_depth)
    costs = {n: 1.0 + 0.2 * (n - 1) for n in range(1, 10)}
    drafter = HybridDrafter([learned, lookup], learned=[True, False], budget=8, mode=mode, costs=costs)
    for _ in range(generations):
        gen = SpeculativeDecoder(model, drafter, eos_ids=set()).generate(prompt, steps)
        assert gen.tokens == reference
    return drafter, learned, lookup, gen


def test_a_scored_part_is_calibrated_by_the_acceptance_its_verified_nodes_had(make_tiny_llama):
    """A learned part that claims 0.9 a token and is never right: its depth's measured ratio falls
    far below 1 and its calibrated estimates with it, so pricing stops verifying its nodes; a part
    that is always right keeps its claims (negative control)."""
    drafter, learned, lookup, gen = _hybrid_run(make_tiny_llama, wrong_learned=set(range(1000)), mode="merge")
    weak, strong = drafter.calibration
    assert weak.ratio(1) < 0.5, weak.ratio(1)
    assert strong.ratio(1) >= 1.0 and strong.ratio(2) >= 1.0
    scores = [math.log(0.9), 2 * math.log(0.9)]
    assert weak.apply(scores, [1, 2])[0] < math.log(0.45)
    assert strong.apply(scores, [1, 2]) == pytest.approx([0.0, 0.0], abs=0.11)  # capped at certainty
    # Once calibrated, the weak part's nodes are seldom verified: uncalibrated, its claims would buy
    # a place every step (it drafts every step in merge mode).
    verified = weak.claimed[0] / 0.9
    assert learned.calls[0] == len(gen.accepted) and verified <= len(gen.accepted) / 4, (verified, len(gen.accepted))


def test_the_learned_part_is_skipped_before_it_drafts_where_the_lookup_alone_yields_more(make_tiny_llama):
    """Switch mode: a learned part that never yields drafts in few steps (its first, then probes
    whose interval doubles each time it loses: ~log2 of the steps), not every step as merge mode has it;
    the next generation starts from what the last one measured, without drafting it first."""
    drafter, learned, _, gen = _hybrid_run(make_tiny_llama, wrong_learned=set(range(1000)), steps=240, generations=2)
    steps = len(gen.accepted)
    assert drafter.mode == "switch" and drafter.skipped >= steps
    assert learned.calls[0] <= 2 + math.ceil(math.log2(steps / drafter.probe)), (learned.calls, steps)
    assert learned.calls[1] <= 2, learned.calls  # its probe interval carried over, not reset
    merged, learned_merged, _, merged_gen = _hybrid_run(make_tiny_llama, wrong_learned=set(range(1000)), mode="merge")
    assert learned_merged.calls[0] == len(merged_gen.accepted)  # merge: every step


def test_switch_judges_the_learned_part_by_what_it_adds_over_the_lookup_not_by_its_steps_tokens(make_tiny_llama):
    """A learned part that drafts exactly what the lookup drafts is right every time, and steps with
    it accept the most tokens a step there is; it adds nothing, costs its drafting, and is skipped. A
    decision on the tokens of steps it drafted in (the lookup's included) kept it drafting."""
    drafter, learned, _, gen = _hybrid_run(make_tiny_llama, wrong_learned=set(), learned_depth=2, steps=160)
    assert max(gen.accepted) == 3 and drafter.gain[0].value == 0.0
    assert learned.calls[0] <= 2 + math.ceil(math.log2(len(gen.accepted) / drafter.probe)), learned.calls


def test_switch_keeps_a_learned_part_that_drafts_where_the_lookup_has_no_match(make_tiny_llama):
    """A lookup that never proposes and a learned part that is always right: it drafts every step
    (its measured gain is its whole chain); the same lookup with a learned part that is never right
    decodes plainly after its probes (negative control)."""
    drafter, learned, _, gen = _hybrid_run(make_tiny_llama, wrong_learned=set(), lookup_depth=0)
    assert learned.calls[0] == len(gen.accepted) and drafter.skipped == 0
    assert drafter.gain[1].value == pytest.approx(3.0, abs=0.2) and drafter.gain[0].value is None
    wrong, wrong_learned, _, wrong_gen = _hybrid_run(make_tiny_llama, wrong_learned=set(range(1000)), lookup_depth=0)
    assert wrong_learned.calls[0] <= 2 + math.ceil(math.log2(len(wrong_gen.accepted) / wrong.probe))
    assert max(wrong_gen.accepted) == 1
