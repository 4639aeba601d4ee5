"""Hierarchical drafting (HSDDW, Syu & Lee, NAACL Findings 2025): a fast draft M1, a stronger
draft M2 that pre-verifies M1, and the target Mp that alone decides the output.

Each engine step: M1 drafts a burst under its entropy rule; M2 scores the whole burst in one
forward and verifies it exactly as a target would (greedy match, or rejection sampling against
M1's draft distribution, replacing the first rejected token by its own correction). While M2
accepts everything and stays confident (its entropy at every position at most its own adaptive
threshold), control returns to M1 to extend the draft; when M2 rejects, loses confidence or the
draft is full, the pending chain goes to the target, which verifies it in one pass.

Lossless: every pending token is distributed as M2's distribution at its position (an accepted
M1 token or M2's correction from the residual), so the target verifies it against that
distribution with the engine's usual rejection sampling; greedy, pending tokens are M2's greedy
tokens and the target keeps only those equal to its own.

Thresholds adapt per sequence (:class:`~draftsmith.eval.engine.policies.EntropyRule`): M1's from the M1
entropies of the tokens M2 rejected, M2's from the M2 entropies of the tokens the target rejected.
A position a model declines (its entropy above its threshold) counts as a rejection at that
entropy: without it, a model whose entropies all start above the initial threshold (a 2-layer cut
of SmolLM2 sits at 3-6 nats against the 2-nat start) never drafts, is never rejected and never
adapts. Declines pull a threshold up, rejections of drafted tokens pull it down, so it settles
where the two balance.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.errors import UsageError
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec, StepResult
from draftsmith.eval.engine.drafters.draft_lm import DraftLMDrafter, cut_from_target
from draftsmith.eval.engine.policies import DEFAULT_ENTROPY_TAU, EntropyRule, entropy
from draftsmith.eval.engine.sampling import probabilities, sample
from draftsmith.eval.engine.tree import ROOT, TokenTree, chain
from draftsmith.eval.engine.verify import residual
from draftsmith.heads.draft_lm import draft_vocab_from_counts, load_draft_lm

# Untrained cuts of SmolLM2 (30 layers) are accepted only from ~26 layers up: a 6-layer M2
# never was (acceptance length 1.00), a 28-layer one makes the default draft above 1.0.
DEFAULT_LAYERS = {"m1": 6, "m2": 28}


class HierarchicalDrafter(Drafter):
    """M1 (``m1``) drafts bursts of up to ``m1_depth`` tokens, M2 (``m2``) pre-verifies them, and
    at most ``depth`` pending tokens go to the target per step."""

    def __init__(
        self,
        m1: PreTrainedModel,
        m2: PreTrainedModel,
        depth: int = 8,
        m1_depth: int = 4,
        m1_tau: float = DEFAULT_ENTROPY_TAU,
        m2_tau: float = DEFAULT_ENTROPY_TAU,
        name: str = "hierarchical",
        m1_vocab: torch.Tensor | None = None,
        m2_vocab: torch.Tensor | None = None,
    ):
        """``m1_vocab`` / ``m2_vocab``: token ids each model drafts from (see ``DraftLMDrafter``)."""
        self.m1 = DraftLMDrafter(m1, depth=m1_depth, draft_vocab=m1_vocab)
        self.m2 = DraftLMDrafter(m2, draft_vocab=m2_vocab)
        self.depth, self.name = depth, name
        self.rule1, self.rule2 = EntropyRule(m1_tau), EntropyRule(m2_tau)
        self._pending: list[int] = []
        self._m2_entropy: list[float] = []

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """A new sequence: empty caches, initial thresholds."""
        self.m1.begin(tokens, hidden)
        self.m2.begin(tokens, hidden)
        self.rule1.reset()
        self.rule2.reset()
        self._pending, self._m2_entropy = [], []

    def _pre_verify(
        self, burst: TokenTree, logits: torch.Tensor, sampling, generator
    ) -> tuple[list[list[float]], torch.Tensor | None]:
        """M2's verdict on an M1 burst, read back in one transfer: per position, [M2 accepts the M1
        token, M2's entropy, M2's correction token]; and M2's distributions when sampling. Entropies
        are of the distribution each model drafts from, as for M1 (the warped one when sampling)."""
        tokens = torch.tensor(burst.tokens, device=logits.device)
        if sampling.greedy:
            p, own = None, logits.argmax(-1)
            accept, correction, spread = own == tokens, own, entropy(logits)
        else:
            p = probabilities(logits, sampling)
            q = torch.stack([burst.proposals[ROOT if i == 0 else i - 1].probs for i in range(len(burst))]).to(p)
            p_x, q_x = p.gather(1, tokens[:, None])[:, 0], q.gather(1, tokens[:, None])[:, 0]
            u = torch.rand(p_x.shape, generator=generator, device=p.device)
            accept = u * q_x < p_x
            correction = sample(residual(p, q), generator)
            spread = torch.special.entr(p).sum(-1)
        return torch.stack([accept.double(), spread.double(), correction.double()], 1).tolist(), p

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        """M1 bursts pre-verified by M2 until M2 rejects, loses confidence or the draft is full:
        the pending chain, with M2's distributions as its draft distributions when sampling."""
        sampling, generator = context.sampling, context.generator
        budget = min(self.depth, context.max_tokens)
        pending: list[int] = []
        m2_probs: list[torch.Tensor] = []
        self._m2_entropy = []
        while len(pending) < budget:
            sequence = context.tokens + pending
            burst = self.m1.propose(DraftContext(sequence, sampling, generator, budget - len(pending), self.rule1.tau))
            for node, value in burst.entropy.items():
                if node not in burst.proposals:  # M1 declined to draft after this node
                    self.rule1.rejected(value)
            if not len(burst):  # M1 is not confident enough to draft at all
                break
            # M2's distributions after the sequence and after each burst token but the last: one forward.
            logits = self.m2.sync(sequence + burst.tokens[:-1], rows=len(burst))
            verdicts, p2 = self._pre_verify(burst, logits, sampling, generator)
            stop = False
            for i, (accepted, spread, correction) in enumerate(verdicts):
                if spread > self.rule2.tau:  # M2 lost confidence: its token here would be a guess
                    self.rule2.rejected(spread)
                    stop = True
                    break
                if p2 is not None:
                    m2_probs.append(p2[i])
                self._m2_entropy.append(spread)
                if accepted:
                    pending.append(burst.tokens[i])
                    continue
                self.rule1.rejected(burst.entropy[ROOT if i == 0 else i - 1])
                pending.append(int(correction))
                stop = True
                break
            if stop:
                break
        self._pending = pending
        return chain(pending, m2_probs or None)

    def accept(self, result: StepResult) -> None:
        """Update M2's threshold with its entropy where the target rejected a pending token."""
        # The tree was the pending chain: the accepted path is its first len - 1 tokens. Comparing
        # tokens instead would count a target token equal to the rejected one (a residual that fell
        # back to p) as accepted, and read past the result's end.
        accepted = len(result.accepted) - 1
        if accepted < len(self._pending):  # the target rejected the pending token at this position
            self.rule2.rejected(self._m2_entropy[accepted])
        self._pending, self._m2_entropy = [], []


def build(spec: DrafterSpec, target: PreTrainedModel) -> HierarchicalDrafter:
    """The drafter of ``hierarchical?...``: M1 and M2 trained draft LMs (``m1=``/``m2=``) or cut from ``target``."""
    param = next(target.parameters())
    options = dict(spec.options)
    vocab = options.pop("vocab", None)
    models = []
    for m in ("m1", "m2"):  # a trained draft LM, or layers cut from the target
        path = options.pop(m, None)
        layers = options.pop(f"{m}_layers", DEFAULT_LAYERS[m])
        if path is None and vocab is not None:
            raise UsageError(f"hierarchical option vocab=N needs trained draft LMs (m1=PATH&m2=PATH); {m} has none")
        models.append(
            load_draft_lm(str(path), param.dtype, param.device)
            if path is not None
            else cut_from_target(target, layers, f"hierarchical option {m}_layers")
        )
        if vocab is not None:
            options[f"{m}_vocab"] = draft_vocab_from_counts(str(path), int(vocab), models[-1])
    return HierarchicalDrafter(*models, **options)
