"""Tree attention and cache commits in CausalLMRunner, plus tree building and Medusa choices.

Every tree node's logits must equal those of running the prompt plus the node's root-to-node path
as an ordinary sequence; after commit() the cache must be the one plain decoding would have.

Tolerance (fp32): the tree pass and the plain pass compute the same function with different
matrix shapes and attention kernels (4D additive mask vs. causal fast path), so they differ only
by float32 reduction order. On the bundled SmolLM2 (logits of magnitude ~20-40) the largest
difference measured over all 21 rows was 4.0e-5 for the tree below (4.8e-5 for another random
tree); for comparison, the same sequence run cached token by token vs. in one uncached forward
differs by 5.4e-5. We allow 2e-4 (about 4x the measured maximum). Cached keys/values (up to ~20
in size) differed by at most 1.9e-5; we allow 1e-4. Any real error (a node
seeing a non-ancestor, a wrong position, a wrong cache row) moves logits by O(1); the negative
control below checks that such an error is far outside the bound.
"""

from __future__ import annotations

import json
import random
import weakref

import pytest
import torch

from draftsmith.eval.engine.drafters.medusa import load_choices
from draftsmith.eval.engine.target_runner import CausalLMRunner, tree_rows
from draftsmith.eval.engine.tree import ROOT, TreeBuilder, ancestor_mask, chain

LOGIT_TOL = 2e-4  # fp32, see the module docstring
KV_TOL = 1e-4  # cached keys/values are O(1-10) and suffer the same reduction-order noise

PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog while the farmer counts his sheep and the sun "
    "slowly sets behind the distant hills near the old stone bridge."
)


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """Random topologically ordered tree: (tokens, parents, depths); parent -1 is the root."""
    tokens, parents, depths = [], [], []
    for i in range(n):
        parent = rng.randrange(-1, i)
        parents.append(parent)
        depths.append(1 if parent == ROOT else depths[parent] + 1)
        tokens.append(rng.randrange(vocab))
    return tokens, parents, depths


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


# Per model, the plain logits of each sequence already run: the SmolLM2 tests compare the same tree's
# 21 sequences again and again (~0.3 s a forward on one thread).
_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def plain_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits after ``ids`` from the HF model run on the plain sequence, no cache."""
    seen, key = _PLAIN.setdefault(model, {}), tuple(ids)
    if key not in seen:
        seen[key] = model(torch.tensor([ids])).logits[0, -1].float()
    return seen[key]


@torch.no_grad()
def check_tree_against_plain(model, prompt: list[int], root: int, tokens, parents, depths, chunks=None):
    """Run [root] + tree after ``prompt`` (optionally over several forwards) and compare every row.

    Returns (runner, max abs logit difference over all rows).
    """
    runner = CausalLMRunner(model)
    runner.reset()
    runner.forward(prompt)
    row_parents, row_depths = tree_rows(parents, depths)
    row_tokens = [root] + tokens
    bounds = chunks or [0, len(row_tokens)]
    logits = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        hidden = runner.forward(row_tokens[start:end], row_parents[start:end], row_depths[start:end])
        assert hidden.shape[0] == end - start
        logits.append(runner.logits(hidden))
    logits = torch.cat(logits)
    assert runner.length == len(prompt)
    assert runner.pending_parents == row_parents
    worst = 0.0
    for node in [ROOT] + list(range(len(tokens))):
        seq = prompt + [root] + [tokens[j] for j in path_of(parents, node)]
        diff = (logits[node + 1] - plain_last_logits(model, seq)).abs().max().item()
        worst = max(worst, diff)
    return runner, worst


# ---------------------------------------------------------------------------------------------
# Fast checks on tiny random models (both attention implementations)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiny_tree_logits_match_plain(make_tiny_llama, attn):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    model.config._attn_implementation = attn
    rng = random.Random(7)
    prompt = [rng.randrange(64) for _ in range(12)]
    tokens, parents, depths = random_tree(rng, 15, 64)
    _, worst = check_tree_against_plain(model, prompt, 5, tokens, parents, depths)
    assert worst < 1e-5
    # Grown over three forwards, parents indexing rows of earlier forwards.
    _, worst = check_tree_against_plain(model, prompt, 5, tokens, parents, depths, chunks=[0, 4, 9, 16])
    assert worst < 1e-5


def test_ancestor_mask():
    mask = ancestor_mask([ROOT, 0, 0, 1, ROOT, 4])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


# ---------------------------------------------------------------------------------------------
# The bundled SmolLM2 (fp32)


@pytest.fixture(scope="module")
def setup(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer(PROMPT_TEXT)["input_ids"]
    assert 25 <= len(prompt) <= 40
    root = int(plain_last_logits(model, prompt).argmax())  # what plain decoding would emit next
    rng = random.Random(2024)
    tokens, parents, depths = random_tree(rng, 20, model.config.vocab_size)
    assert max(depths) >= 4
    return model, prompt, root, tokens, parents, depths


@pytest.mark.slow
def test_every_tree_node_matches_plain_sequence(setup):
    model, prompt, root, tokens, parents, depths = setup
    _, worst = check_tree_against_plain(model, prompt, root, tokens, parents, depths)
    print(f"tree attention: max |logit diff| over 21 rows = {worst:.2e}")
    assert worst < LOGIT_TOL


@pytest.mark.slow
def test_wrong_mask_is_far_outside_tolerance(setup):
    """Negative control: the same rows run as one causal chain (every row sees all earlier rows)."""
    model, prompt, root, tokens, parents, depths = setup
    runner = CausalLMRunner(model)
    runner.reset()
    runner.forward(prompt)
    n = len(tokens) + 1
    logits = runner.logits(runner.forward([root] + tokens, [ROOT] + list(range(n - 1)), list(range(n))))
    worst = 0.0
    for node in range(len(tokens)):
        seq = prompt + [root] + [tokens[j] for j in path_of(parents, node)]
        worst = max(worst, (logits[node + 1] - plain_last_logits(model, seq)).abs().max().item())
    assert worst > 1000 * LOGIT_TOL


@pytest.mark.slow
def test_tree_grown_over_several_forwards(setup):
    model, prompt, root, tokens, parents, depths = setup
    _, worst = check_tree_against_plain(model, prompt, root, tokens, parents, depths, chunks=[0, 3, 8, 14, 21])
    assert worst < LOGIT_TOL


def reference_cache(model, ids: list[int]) -> CausalLMRunner:
    runner = CausalLMRunner(model)
    runner.reset()
    runner.forward(ids)
    return runner


def assert_same_cache(runner: CausalLMRunner, reference: CausalLMRunner) -> None:
    assert runner.length == reference.length
    assert runner.cache.get_seq_length() == reference.length
    for layer, ref in zip(runner.cache.layers, reference.cache.layers, strict=True):
        assert layer.keys.shape == ref.keys.shape
        assert (layer.keys - ref.keys).abs().max().item() < KV_TOL
        assert (layer.values - ref.values).abs().max().item() < KV_TOL


def deepest_noncontiguous_node(parents: list[int], depths: list[int]) -> int:
    """The deepest node whose committed rows are not 0..k (so commit() must move cache rows)."""
    for node in sorted(range(len(parents)), key=lambda i: (-depths[i], i)):
        rows = [0] + [j + 1 for j in path_of(parents, node)]
        if rows != list(range(len(rows))):
            return node
    raise AssertionError("random tree has no non-contiguous path")


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [None, [0, 3, 8, 14, 21]], ids=["one_forward", "grown"])
def test_commit_keeps_exactly_the_plain_cache(setup, chunks):
    model, prompt, root, tokens, parents, depths = setup
    runner, _ = check_tree_against_plain(model, prompt, root, tokens, parents, depths, chunks=chunks)
    node = deepest_noncontiguous_node(parents, depths)
    path = path_of(parents, node)
    assert len(path) >= 3
    rows = [0] + [j + 1 for j in path]
    runner.commit(rows)
    accepted = prompt + [root] + [tokens[j] for j in path]
    assert runner.pending_parents == []
    assert_same_cache(runner, reference_cache(model, accepted))

    # Decoding goes on from the committed cache exactly as from plain processing: a chain step...
    nxt = int(plain_last_logits(model, accepted).argmax())
    logits = runner.logits(runner.forward([nxt]))[-1]
    assert (logits - plain_last_logits(model, accepted + [nxt])).abs().max().item() < LOGIT_TOL
    # ...and a second tree step on top of it, committing a path of that tree too.
    accepted = accepted + [nxt]
    rng = random.Random(5)
    tokens2, parents2, depths2 = random_tree(rng, 8, model.config.vocab_size)
    row_parents, row_depths = tree_rows(parents2, depths2)
    root2 = int(logits.argmax())
    logits2 = runner.logits(runner.forward([root2] + tokens2, row_parents, row_depths))
    for node2 in [ROOT] + list(range(len(tokens2))):
        seq = accepted + [root2] + [tokens2[j] for j in path_of(parents2, node2)]
        assert (logits2[node2 + 1] - plain_last_logits(model, seq)).abs().max().item() < LOGIT_TOL
    node2 = max(range(len(tokens2)), key=lambda i: depths2[i])
    runner.commit([0] + [j + 1 for j in path_of(parents2, node2)])
    accepted = accepted + [root2] + [tokens2[j] for j in path_of(parents2, node2)]
    assert_same_cache(runner, reference_cache(model, accepted))


@pytest.mark.slow
def test_commit_root_only_and_rollback(setup):
    model, prompt, root, tokens, parents, depths = setup
    runner, _ = check_tree_against_plain(model, prompt, root, tokens, parents, depths)
    runner.commit([0])  # every draft rejected: only the root enters the cache
    assert_same_cache(runner, reference_cache(model, prompt + [root]))
    runner.rollback(len(prompt) - 5)
    assert_same_cache(runner, reference_cache(model, prompt[:-5]))
    logits = runner.logits(runner.forward(prompt[-5:]))[-1]
    assert (logits - plain_last_logits(model, prompt)).abs().max().item() < LOGIT_TOL


def test_chain_commits_at_once_and_refuses_pending(make_tiny_llama):
    model = make_tiny_llama(vocab_size=32, hidden_size=16, layers=1, seed=1)
    runner = CausalLMRunner(model)
    runner.forward([1, 2, 3])
    assert runner.length == 3
    runner.forward([4, 5], [ROOT, 0], [0, 1])
    with pytest.raises(RuntimeError, match="commit"):
        runner.forward([6])
    runner.commit([0])
    assert runner.length == 4 and runner.cache.get_seq_length() == 4


# ---------------------------------------------------------------------------------------------
# TreeBuilder pruning and Medusa choices


def test_tree_builder_prunes_to_budget_and_renumbers():
    b = TreeBuilder()
    a, bb, c = b.add(ROOT, [10, 11, 12], scores=[-0.1, -2.0, -0.5])  # nodes 0, 1, 2
    a1, a2 = b.add(a, [20, 21], scores=[-0.2, -3.0])  # cumulative -0.3, -3.1
    (b1,) = b.add(bb, [22], scores=[-0.1])  # -2.1, child of a pruned node
    (c1,) = b.add(c, [23], scores=[-0.4])  # -0.9
    (a1a,) = b.add(a1, [30], scores=[-0.05])  # -0.35
    assert len(b) == 8

    tree = b.build(budget=4)  # best: A (-0.1), A1 (-0.3), A1a (-0.35), C (-0.5)
    assert tree.tokens == [10, 12, 20, 30]
    assert tree.parents == [ROOT, ROOT, 0, 2]
    assert tree.depths == [1, 1, 2, 3]
    assert all(p < i for i, p in enumerate(tree.parents))  # topological after renumbering
    # Proposals keep every drawn candidate in draw order; pruned ones map to None.
    assert tree.proposals[ROOT].tokens == [10, 11, 12]
    assert tree.proposals[ROOT].nodes == [0, None, 1]
    assert tree.proposals[0].tokens == [20, 21] and tree.proposals[0].nodes == [2, None]
    assert tree.proposals[1].tokens == [23] and tree.proposals[1].nodes == [None]  # C kept, C1 pruned
    assert tree.proposals[2].tokens == [30] and tree.proposals[2].nodes == [3]
    assert set(tree.proposals) == {ROOT, 0, 1, 2}  # B was pruned: its candidates are gone
    assert tree.child_by_token(ROOT, 11) is None and tree.child_by_token(ROOT, 12) == 1
    assert tree.path_to(3) == [0, 2, 3]

    full = b.build()
    assert len(full) == 8 and b.build(budget=100).tokens == full.tokens
    assert full.tokens == [10, 11, 12, 20, 21, 22, 23, 30]  # by depth, then insertion order
    assert all(p < i for i, p in enumerate(full.parents))
    assert (bb, b1, c1, a2, a1a) == (1, 5, 6, 4, 7)  # builder ids are insertion order


def test_tree_builder_keeps_ancestors_when_scores_rise():
    """Scores should not increase along a path; if they do, build still returns a closed tree."""
    b = TreeBuilder()
    (a, c) = b.add(ROOT, [1, 2], scores=[-1.0, -0.5])
    (a1,) = b.add(a, [3], scores=[+5.0])  # cumulative 4.0: the best node, its parent the worst
    tree = b.build(budget=1)
    assert tree.tokens == [1, 3] and tree.parents == [ROOT, 0]
    assert tree.proposals[ROOT].nodes == [0, None]


def test_tree_builder_random_budgets():
    rng = random.Random(0)
    for _ in range(50):
        b = TreeBuilder()
        frontier = [ROOT]
        for _ in range(rng.randint(1, 4)):
            new = []
            for parent in frontier:
                k = rng.randint(1, 3)
                new += b.add(parent, rng.sample(range(100), k), scores=[-rng.random() for _ in range(k)])
            frontier = rng.sample(new, min(len(new), 3))
        budget = rng.randint(1, len(b))
        tree = b.build(budget)
        assert len(tree) == budget
        # Scores only decrease along a path, so the kept nodes are exactly the `budget` best,
        # renumbered by (depth, insertion order).
        best = sorted(range(len(b)), key=lambda i: -b.scores[i])[:budget]
        expected = sorted(best, key=lambda i: (b.depths[i], i))
        assert tree.tokens == [b.tokens[i] for i in expected]
        assert tree.depths == [b.depths[i] for i in expected]
        for i, parent in enumerate(tree.parents):
            assert parent < i
            assert tree.depths[i] == (1 if parent == ROOT else tree.depths[parent] + 1)
        for parent, proposal in tree.proposals.items():
            assert parent == ROOT or 0 <= parent < len(tree)
            for token, node in zip(proposal.tokens, proposal.nodes):
                if node is not None:
                    assert tree.tokens[node] == token and tree.parents[node] == parent
        # Every tree node is listed exactly once in its parent's proposal.
        listed = sorted(n for p in tree.proposals.values() for n in p.nodes if n is not None)
        assert listed == list(range(len(tree)))


def test_chain_builds_a_single_path():
    probs = [torch.full((4,), 0.25), None]
    tree = chain([7, 8], probs)
    assert tree.tokens == [7, 8] and tree.parents == [ROOT, 0] and tree.depths == [1, 2]
    assert tree.proposals[ROOT].probs is probs[0] and tree.proposals[0].probs is None


def test_load_choices(tmp_path):
    assert load_choices([[1], [0], [0, 0], [0, 0]]) == [(0,), (1,), (0, 0)]  # dedup, sorted
    assert load_choices("[[0], [0, 1], [0, 0]]") == [(0,), (0, 0), (0, 1)]
    path = tmp_path / "choices.json"
    path.write_text(json.dumps([[0], [1], [0, 0], [0, 0, 0], [1, 0]]))
    assert load_choices(str(path)) == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match=r"no parent \[0, 1\]"):
        load_choices([[0], [0, 0], [0, 1, 0]])
    with pytest.raises(ValueError, match="no parent"):
        load_choices([[1, 0]])
    with pytest.raises(ValueError, match="ranks >= 0"):
        load_choices([[0], [-1]])
    with pytest.raises(ValueError, match="non-empty"):
        load_choices([[]])


def test_tree_plan_follows_the_measured_costs_and_acceptance():
    from draftsmith.eval.engine.pass_cost import chain_speedup, plan_tree

    # Pass costs in one-token passes as measured on this project's CPUs: fp32 with a step at 4
    # tokens, bf16 nearly flat.
    fp32 = {
        1: 1.0,
        2: 1.06,
        3: 1.20,
        4: 1.57,
        5: 1.64,
        6: 1.8,
        7: 1.91,
        8: 1.95,
        9: 1.98,
        10: 2.1,
        11: 2.2,
        12: 2.25,
        13: 2.31,
    }
    bf16 = {n: 1.0 + 0.012 * (n - 1) for n in range(1, 14)}
    # Leviathan et al.: a = 0.5, two drafts -> 1.75 tokens a step, over 1.20 + 2 x 0.1 passes.
    assert chain_speedup(fp32, 2, 0.5, 0.1) == pytest.approx(1.75 / 1.4)
    # A young head (22% top-1) drafts one token in fp32, where every deeper pass costs more than it gains...
    assert plan_tree(fp32, 0.22, 0.1)[:2] == (1, 1)
    # ...and the same head on the flat bf16 curve widens that level into 9 candidates.
    assert plan_tree(bf16, 0.22, 0.07)[:2] == (1, 9)
    # A better head drafts deeper.
    depth, budget, expected = plan_tree(bf16, 0.6, 0.07)
    assert depth >= 3 and budget >= depth and expected == pytest.approx(chain_speedup(bf16, depth, 0.6, 0.07))
    # Per-depth acceptance (a head's held-out top-1 at each depth): tokens a step are 1 + a1 + a1 a2 + ...,
    # and a list's last rate holds deeper; a constant list is the constant.
    assert chain_speedup(fp32, 3, [0.5, 0.4], 0.1) == pytest.approx((1 + 0.5 + 0.2 + 0.08) / (1.57 + 0.3))
    assert chain_speedup(bf16, 4, [0.6] * 2, 0.07) == pytest.approx(chain_speedup(bf16, 4, 0.6, 0.07))
    # A head strong at depth 1 and useless below it drafts one token however cheap the passes.
    assert plan_tree(bf16, [0.9, 0.0], 0.07)[0] == 1


def test_a_noisy_cost_curve_does_not_deepen_the_tree_of_a_head_that_is_never_right():
    """Timings on a tiny model can say a 4-token pass is cheaper than a 2-token one (CI once planned
    depth 3 for a head with 0% accuracy from such a curve); the planner's curve is their isotonic fit."""
    from draftsmith.eval.engine.pass_cost import plan_tree
    from draftsmith.eval.engine.tree_plan import monotone

    noisy = {1: 1.0, 2: 1.6, 3: 1.3, 4: 1.0, 5: 1.7}
    assert plan_tree(noisy, 0.0, 0.05, max_depth=3, max_budget=4)[0] == 3  # what the raw medians plan
    # The violators 1.6, 1.3, 1.0 are pooled into their mean; a monotone curve is kept as it is.
    assert monotone(noisy) == pytest.approx({1: 1.0, 2: 1.3, 3: 1.3, 4: 1.3, 5: 1.7})
    assert monotone({1: 1.0, 2: 1.0, 3: 2.0}) == {1: 1.0, 2: 1.0, 3: 2.0}
    assert plan_tree(monotone(noisy), 0.0, 0.05, max_depth=3, max_budget=4)[:2] == (1, 3)
