"""Draft-length policies (entropy, confidence), the hierarchical drafter and lenient verification.

Lossless policies must keep every output guarantee: greedy output identical to plain decoding
(fp32), sampled output following the target's exact distribution (the chi-square test of
test_sampling_lossless). Lenience must shift the output distribution by exactly what its closed
form says, and never be allowed where it would be silent (greedy, or a row not named lossy).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from stats_helpers import SAMPLES, chi_square, exact_joint, generate_counts

from draftsmith.errors import UsageError
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter, parse_spec
from draftsmith.eval.engine.drafters.base import DraftContext, StepResult
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.engine.drafters.hierarchical import HierarchicalDrafter
from draftsmith.eval.engine.drafters.oracle import OracleDrafter
from draftsmith.eval.engine.policies import DraftPolicy, EntropyRule, PolicyConfig, entropy
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import ROOT, chain, grow_tree
from draftsmith.eval.engine.verify import lenient_distribution, read_verdict, verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

V = 8
PROMPT = [3, 5, 2, 7, 4]


@pytest.fixture(scope="module")
def target(tiny_pair_target):
    return tiny_pair_target


@pytest.fixture(scope="module")
def draft(tiny_pair_draft):
    return tiny_pair_draft


@pytest.fixture(scope="module")
def middle(make_tiny_llama):
    return middle_draft(make_tiny_llama)


def middle_draft(tiny_llama):
    """A second draft for M2 (``tiny_llama``: conftest's builder): closer to nothing in particular,
    sharper than ``draft``."""
    return tiny_llama(vocab_size=V, hidden_size=32, layers=1, seed=2, scale=12.0)


def with_policy(drafter, **options):
    drafter.policy = PolicyConfig(**options)
    return drafter


# ---------------------------------------------------------------------------------------------
# The pieces


def test_entropy_matches_its_definition():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, -float("inf"), 0.0, 0.0]])
    p = logits.softmax(-1)
    expected = [-(row[row > 0] * row[row > 0].log()).sum().item() for row in p]
    assert entropy(logits).tolist() == pytest.approx(expected, rel=1e-4)
    assert entropy(logits)[0].item() == pytest.approx(math.log(4))


def test_entropy_rule_uses_the_mean_of_rejected_entropies():
    rule = EntropyRule(2.0)
    assert rule.tau == 2.0
    rule.rejected(1.0)
    rule.rejected(4.0)
    assert rule.tau == 2.5
    rule.reset()
    assert rule.tau == 2.0


def test_grow_tree_does_not_expand_uncertain_nodes():
    """Children of a node whose draft entropy exceeds the threshold are never drafted, and the
    entropies of the nodes that did propose are recorded for the adaptive threshold."""
    sharp, flat = torch.full((V,), -10.0), torch.zeros(V)
    sharp[3] = 10.0

    def expand(frontier, builder):  # node 0 (token 3) is certain of its child, node 1 is not
        return torch.stack([sharp if builder.tokens[n] == 3 else flat for n in frontier])

    root = torch.full((V,), -10.0)
    root[3], root[5] = 5.0, 5.0  # two equally likely children: entropy log 2
    greedy = SamplingConfig()
    full = grow_tree(root, expand, depth=3, top_k=2, budget=20, sampling=greedy)
    limited = grow_tree(root, expand, depth=3, top_k=2, budget=20, sampling=greedy, max_entropy=1.0)
    assert limited.entropy[ROOT] == pytest.approx(math.log(2), abs=1e-4)
    # Token 5 (flat below it, entropy log 8 > 1) proposes nothing; token 3's chain goes on.
    node5 = limited.tokens.index(5)
    assert node5 not in limited.proposals and limited.proposals[limited.tokens.index(3)].tokens[0] == 3
    assert len(limited) < len(full) and max(limited.depths) == 3
    assert grow_tree(root, expand, 3, 2, 20, greedy, max_entropy=0.5).tokens == []  # the root itself is too uncertain


def test_policy_records_the_entropy_where_the_target_rejected():
    policy = DraftPolicy(PolicyConfig(entropy_tau=3.0))
    policy.begin()
    tree = chain([1, 2, 3])
    tree.entropy = {ROOT: 0.5, 0: 1.5, 1: 2.5}
    policy.observe(tree, [0], None)  # node 1 (drafted from node 0's distribution) was rejected
    assert policy.max_entropy == 1.5
    policy.observe(tree, [0, 1, 2], None)  # everything accepted: node 2 proposed nothing, no rejection
    assert policy.max_entropy == 1.5
    policy.observe(tree, [], None)
    assert policy.max_entropy == 1.0


def test_spec_options_and_one_line_refusals():
    spec = parse_spec("draft_lm?depth=8&policy=entropy,confidence&entropy_tau=1.5&confidence=0.3")
    assert spec.policy == PolicyConfig(1.5, 0.3, 1.0) and spec.name == "draft_lm+entropy+confidence"
    assert parse_spec("prompt_lookup?lenience=0.5").name == "prompt_lookup+lenience0.5(lossy)"
    assert parse_spec("prompt_lookup?lenience=0.5&name=x").name == "x(lossy)"
    for bad, words in [
        ("prompt_lookup?policy=entropy", "distribution"),
        ("draft_lm?policy=longest", "unknown policy"),
        ("draft_lm?policy=confidence&confidence=1.5", r"confidence must be a number in \(0, 1\)"),
        ("draft_lm?lenience=0", r"lenience must be a number in \(0, 1\]"),
        ("draft_lm?confidence=0.3", "applies to policy=confidence"),
        (
            "draft_lm?policy=entropy&entropy_tau=high",
            r"entropy_tau=high is not allowed: entropy_tau must be a number > 0",
        ),
        ("hierarchical?policy=entropy", "its own entropy rules"),
    ]:
        with pytest.raises(UsageError, match=words):
            parse_spec(bad)


def test_lenience_needs_sampling(target):
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(target, with_policy(OracleDrafter(CausalLMRunner(target)), lenience=0.5))


# ---------------------------------------------------------------------------------------------
# Confidence gating


def test_confidence_gate_drafts_exactly_when_the_target_was_confident(target):
    """Greedy with an oracle: a step drafts iff the target's probability of the token it produced
    last (computed independently, by a full forward) is at least the threshold."""
    threshold = 0.6
    decoder = SpeculativeDecoder(
        target, with_policy(OracleDrafter(CausalLMRunner(target), num_tokens=3), confidence=threshold), eos_ids=set()
    )
    gen = decoder.generate(PROMPT, 30)
    plain = SpeculativeDecoder(target, None, eos_ids=set()).generate(PROMPT, 30)
    assert gen.tokens == plain.tokens
    with torch.no_grad():
        probs = target(torch.tensor([PROMPT + gen.tokens])).logits[0].softmax(-1)
    confidence = [probs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(gen.tokens)]
    produced = 1  # tokens known before each step (the first comes from prefill)
    expected = []
    for i, accepted in enumerate(gen.accepted):
        expected.append(i == 0 or confidence[produced - 1] >= threshold)
        produced += accepted
    assert [d > 0 for d in gen.drafted] == expected
    assert 0 < sum(expected) < len(expected)  # both branches happen on this model


# ---------------------------------------------------------------------------------------------
# Lossless: greedy identical, sampling exact


def policy_drafters(target, draft, middle):
    return {
        # Thresholds inside the drafts' entropy ranges on these prompts (1.3-1.95 and 1.45-1.9 nats).
        "entropy": with_policy(DraftLMDrafter(draft, depth=3), entropy_tau=1.7),
        "entropy_tree": with_policy(DraftLMDrafter(draft, depth=2, top_k=2, budget=4), entropy_tau=1.7),
        "confidence": with_policy(DraftLMDrafter(draft, depth=2), confidence=0.6),
        "hierarchical": HierarchicalDrafter(draft, middle, depth=3, m1_depth=2, m1_tau=1.8, m2_tau=1.7),
    }


def test_policies_are_lossless_greedy(target, draft, middle):
    prompts = [PROMPT, [1, 2, 3, 4], [7, 7, 0, 1, 5, 6]]
    plain = SpeculativeDecoder(target, None, eos_ids=set())
    for name, drafter in policy_drafters(target, draft, middle).items():
        decoder = SpeculativeDecoder(target, drafter, eos_ids=set())
        drafted = skipped = 0
        for prompt in prompts:
            gen = decoder.generate(prompt, 40)
            assert gen.tokens == plain.generate(prompt, 40).tokens, name
            drafted += sum(gen.drafted)
            skipped += gen.drafted.count(0)
        assert drafted > 0 and skipped > 0, name  # the policy both drafted and held back


@pytest.mark.parametrize("name", ["entropy", "entropy_tree", "confidence", "hierarchical"])
def test_policies_are_lossless_sampling(target, draft, middle, name):
    drafter = policy_drafters(target, draft, middle)[name]
    sampling = SamplingConfig(1.0)
    decoder = SpeculativeDecoder(target, drafter, None, sampling, eos_ids=set())
    counts, _, drafted = generate_counts(decoder, PROMPT, 4, SAMPLES)
    statistic, threshold, _ = chi_square(counts, exact_joint(target, PROMPT, 4, sampling), SAMPLES)
    print(f"{name}: chi2 {statistic:.1f} < {threshold:.1f}; tree sizes {drafted.most_common(5)}")
    assert statistic < threshold
    sizes = collections.Counter(size for shape, c in drafted.items() for size in shape for _ in range(c))
    assert sizes[0] > 100 and sum(c for s, c in sizes.items() if s > 0) > 100  # both drafted and held back


def test_hierarchical_pending_tokens_follow_m2(target, draft, middle):
    """What M2 passes on is M2's own distribution at every position (what makes the target's
    verification exact): the first pending token's frequencies match M2's next-token distribution."""
    drafter = HierarchicalDrafter(draft, middle, depth=1, m1_depth=1, m1_tau=10.0, m2_tau=10.0)
    sampling = SamplingConfig(1.0)
    counts = collections.Counter()
    generator = torch.Generator().manual_seed(0)
    drafter.begin(PROMPT, None)
    for _ in range(SAMPLES):
        tree = drafter.propose(DraftContext(PROMPT, sampling, generator, 1))
        counts[(tree.tokens[0],)] += 1
    with torch.no_grad():
        p2 = middle(torch.tensor([PROMPT])).logits[0, -1].softmax(-1).double().tolist()
    statistic, threshold, _ = chi_square(counts, {(t,): p for t, p in enumerate(p2) if p > 0}, SAMPLES)
    assert statistic < threshold
    # The negative control: M1's own distribution is far from it.
    with torch.no_grad():
        p1 = draft(torch.tensor([PROMPT])).logits[0, -1].softmax(-1).double().tolist()
    wrong, _, _ = chi_square(counts, {(t,): p for t, p in enumerate(p1) if p > 0}, SAMPLES)
    assert wrong > 10 * threshold


def test_hierarchical_thresholds_follow_the_rejections(target, draft, middle):
    """Greedy, one burst: M1's threshold becomes M1's entropy where M2 first disagreed, the pending
    chain is M1's agreed prefix plus M2's own token there, and M2's threshold becomes M2's entropy
    where the target rejected."""
    drafter = HierarchicalDrafter(draft, middle, depth=4, m1_depth=4, m1_tau=10.0, m2_tau=10.0)
    drafter.begin(PROMPT, None)
    tree = drafter.propose(DraftContext(PROMPT, SamplingConfig(), None, 4))
    chain_tokens, m1_entropy = [], []
    with torch.no_grad():
        for _ in range(4):  # M1's own greedy chain, and its entropy at each position
            logits = draft(torch.tensor([PROMPT + chain_tokens])).logits[0, -1]
            m1_entropy.append(entropy(logits).item())
            chain_tokens.append(int(logits.argmax()))
        m2_logits = middle(torch.tensor([PROMPT + chain_tokens])).logits[0, len(PROMPT) - 1 :]
    m2_own = m2_logits.argmax(-1).tolist()
    first = next(i for i in range(4) if chain_tokens[i] != m2_own[i])  # these two models disagree early
    assert tree.tokens == chain_tokens[:first] + [m2_own[first]]
    assert drafter.rule1.tau == pytest.approx(m1_entropy[first], abs=1e-4)
    m2_entropy = entropy(m2_logits[: first + 1]).tolist()
    assert drafter._m2_entropy == pytest.approx(m2_entropy, abs=1e-4)
    # The target keeps none of them: M2's entropy at the first pending token becomes its threshold.
    drafter.accept(StepResult([(tree.tokens[0] + 1) % V], None, PROMPT))
    assert drafter.rule2.tau == pytest.approx(m2_entropy[0], abs=1e-4)


def test_hierarchical_counts_the_accepted_path_not_equal_tokens(draft, middle):
    """The target's token after a rejection can equal the rejected one (a residual that fell back to
    p): the rejection is where the accepted path ends, whatever token the target emitted there."""
    drafter = HierarchicalDrafter(draft, middle, depth=3, m1_depth=3, m1_tau=10.0, m2_tau=10.0)
    drafter.begin(PROMPT, None)
    drafter._pending, drafter._m2_entropy = [5, 6, 7], [0.5, 1.25, 2.0]
    drafter.accept(StepResult([5, 6], None, PROMPT + [5, 6]))  # 5 kept, 6 rejected, then 6 emitted
    assert drafter.rule2.count == 1 and drafter.rule2.tau == 1.25
    drafter._pending, drafter._m2_entropy = [5, 6, 7], [0.5, 1.25, 2.0]
    drafter.accept(StepResult([5, 6, 7, 1], None, PROMPT + [5, 6, 7, 1]))  # all kept, plus the bonus
    assert drafter.rule2.count == 1


@pytest.mark.slow
def test_hierarchical_defaults_draft_on_the_bundled_target(smollm2):
    """The default spec on SmolLM2 (fp32, greedy) drafts and the target accepts some of it: with
    the former default students (2 and 6 layers) no drafted token was ever accepted (acceptance
    length 1.00), because untrained cuts of SmolLM2 agree with it only from ~26 layers up. A declined
    position counts as rejected at its entropy, so the thresholds rise to where the students'
    entropies are (a 2-layer M1 sits at 3-6 nats against the 2-nat start); the output stays the
    target's own."""
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    drafter = build_drafter("hierarchical", model)
    gen = SpeculativeDecoder(model, drafter, eos_ids=set()).generate(prompt, 48)
    assert gen.tokens == SpeculativeDecoder(model, None, eos_ids=set()).generate(prompt, 48).tokens
    drafted = sum(n > 0 for n in gen.drafted)
    tau = sum(gen.accepted) / len(gen.accepted)
    print(
        f"hierarchical defaults: {drafted} of {len(gen.drafted)} steps drafted, acceptance length {tau:.2f}, "
        f"M1 tau {drafter.rule1.tau:.2f}, M2 tau {drafter.rule2.tau:.2f}"
    )
    assert drafted >= len(gen.drafted) // 10, gen.drafted
    assert tau > 1.05, gen.accepted


def always_drafting(draft, middle) -> HierarchicalDrafter:
    """A hierarchical drafter whose thresholds lie above any entropy here: it drafts every step."""
    return HierarchicalDrafter(draft, middle, depth=3, m1_depth=2, m1_tau=10.0, m2_tau=10.0)


@pytest.mark.parametrize("wrong", [False, True], ids=["m2_distributions", "negative_control_m1_distributions"])
def test_hierarchical_target_verifies_against_m2(monkeypatch, target, draft, middle, wrong):
    """Always drafting (thresholds above any entropy here), the output is exact; verifying the same
    tokens against M1's distributions instead of M2's (a plausible bug) fails the same test."""
    drafter = always_drafting(draft, middle)
    if wrong:
        pre_verify = drafter._pre_verify

        def m1_distributions(burst, logits, sampling, generator):
            rows, _ = pre_verify(burst, logits, sampling, generator)
            return rows, torch.stack([burst.proposals[ROOT if i == 0 else i - 1].probs for i in range(len(burst))])

        monkeypatch.setattr(drafter, "_pre_verify", m1_distributions)
    sampling = SamplingConfig(1.0)
    n = 1200 if wrong else SAMPLES  # the control fails by 3.2x at 1,200 (2.3x at 1,000)
    counts, _, _ = generate_counts(SpeculativeDecoder(target, drafter, None, sampling, eos_ids=set()), PROMPT, 4, n)
    statistic, threshold, _ = chi_square(counts, exact_joint(target, PROMPT, 4, sampling), n)
    assert (statistic > 2 * threshold) if wrong else (statistic < threshold)


def test_hierarchical_spec_builds_cut_students(smollm2):
    model, _ = smollm2
    drafter = build_drafter("hierarchical?m1_layers=2&m2_layers=0,1,2,29&depth=5", model)
    assert isinstance(drafter, HierarchicalDrafter) and drafter.depth == 5
    assert (
        drafter.m1.runner.model.config.num_hidden_layers == 2 and drafter.m2.runner.model.config.num_hidden_layers == 4
    )
    last = model.model.layers[29].mlp.down_proj.weight
    assert torch.equal(drafter.m2.runner.model.model.layers[3].mlp.down_proj.weight, last)
    defaults = build_drafter("hierarchical", model)
    assert [d.runner.model.config.num_hidden_layers for d in (defaults.m1, defaults.m2)] == [6, 28]


# ---------------------------------------------------------------------------------------------
# Lenience (lossy by design)


def test_lenience_output_matches_its_closed_form(target, draft):
    """One candidate drawn from q, verified with lenience 0.5: the emitted token follows
    ``lenient_distribution`` (not p), and acceptance rises above the lossless rate."""
    with torch.no_grad():
        p = target(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
        q = draft(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    logits = torch.stack([p.log(), p.log()])  # row 0 scores the candidate; row 1 (after it) unused here
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(1.0)
    outcomes = {1.0: collections.Counter(), 0.5: collections.Counter()}
    accepted = {1.0: 0, 0.5: 0}
    for lenience, counts in outcomes.items():
        for _ in range(SAMPLES):
            token = int(torch.multinomial(q, 1, generator=generator))
            tree = chain([token], [q])
            path, last = read_verdict(verify_sampling(tree, logits, sampling, generator, lenience).tolist())
            counts[(token if path else last,)] += 1
            accepted[lenience] += bool(path)
    for lenience, counts in outcomes.items():
        exact = lenient_distribution(p.double(), q.double(), lenience)
        statistic, threshold, _ = chi_square(counts, {(t,): v for t, v in enumerate(exact.tolist()) if v > 0}, SAMPLES)
        assert statistic < threshold, lenience
    assert torch.allclose(lenient_distribution(p.double(), q.double(), 1.0), p.double())
    shift = 0.5 * (lenient_distribution(p.double(), q.double(), 0.5) - p.double()).abs().sum().item()
    assert shift > 0.02  # really lossy on this case
    assert accepted[0.5] > accepted[1.0] + 100
