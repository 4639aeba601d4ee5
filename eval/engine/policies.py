"""Draft-length policies of the shared engine: how much to draft each step, and whether to draft.

- ``entropy`` (the self-verify dynamic window of HSDDW, Syu & Lee, NAACL Findings 2025): a node
  whose draft distribution has entropy above a threshold tau is not expanded, so a chain stops
  there and a tree branch stops growing (an uncertain root drafts nothing). tau starts at an
  option value and, per sequence, becomes the mean draft entropy at the tokens the target has
  rejected so far.
- ``confidence`` (target-confidence gating): after each verification, when the target's
  probability of the token it just produced is below a threshold, the next steps decode with the
  target alone until it is confident again.
- ``lenience`` (Leviathan et al. 2023): an explicitly *lossy* relaxation of sampling
  verification (see :mod:`draftsmith.eval.engine.verify`); every table names such a row as lossy.

Policies only change which tree is verified (or whether one is), never how the target verifies
it, so every lossless guarantee of the engine holds under ``entropy`` and ``confidence``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import UsageError

POLICIES = ("fixed", "entropy", "confidence")
DEFAULT_ENTROPY_TAU = 2.0  # nats; only the first steps use it (see EntropyRule)
DEFAULT_CONFIDENCE = 0.5


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the softmax of each row of ``logits`` (``-inf`` entries allowed)."""
    return torch.special.entr(logits.float().softmax(-1)).sum(-1)


class EntropyRule:
    """HSDDW's adaptive entropy threshold for one sequence: ``initial`` until the first rejection,
    then the mean entropy of the rejected draft tokens (running mean, O(1) per step)."""

    def __init__(self, initial: float):
        self.initial = initial
        self.reset()

    def reset(self) -> None:
        """Forget the rejections (a new sequence)."""
        self.total, self.count = 0.0, 0

    @property
    def tau(self) -> float:
        """The threshold now: the initial value until a rejection, then the mean rejected entropy."""
        return self.total / self.count if self.count else self.initial

    def rejected(self, value: float) -> None:
        """A draft token drawn from a distribution of entropy ``value`` was rejected."""
        self.total += value
        self.count += 1


@dataclass(frozen=True)
class PolicyConfig:
    """What ``policy=``, ``entropy_tau=``, ``confidence=`` and ``lenience=`` of a drafter spec ask for."""

    entropy_tau: float | None = None  # initial threshold of the entropy rule (None: off)
    confidence: float | None = None  # gate threshold on the target's confidence (None: off)
    lenience: float = 1.0  # 1: lossless verification

    @classmethod
    def from_options(cls, spec: str, options: dict) -> PolicyConfig:
        """Pop the policy options out of a spec's ``options`` (numbers already range-checked by
        :func:`draftsmith.eval.engine.drafters.parse_spec`) and check the policy names (one-line errors)."""
        names = [n for n in str(options.pop("policy", "fixed")).split(",") if n]
        unknown = sorted(set(names) - set(POLICIES))
        if unknown or not names:
            raise UsageError(
                f"--drafter {spec!r}: unknown policy {','.join(unknown) or '(empty)'}; "
                f"choose from {', '.join(POLICIES)} (comma-separated to combine entropy,confidence)"
            )
        for option, policy in (("entropy_tau", "entropy"), ("confidence", "confidence")):
            if option in options and policy not in names:
                raise UsageError(f"--drafter {spec!r}: {option}= applies to policy={policy}; add it to policy=")
        # Values are numbers in range already: the spec parser checks them against its options table.
        tau = float(options.pop("entropy_tau", DEFAULT_ENTROPY_TAU))
        confidence = float(options.pop("confidence", DEFAULT_CONFIDENCE))
        lenience = float(options.pop("lenience", 1.0))
        return cls(tau if "entropy" in names else None, confidence if "confidence" in names else None, lenience)

    @property
    def lossy(self) -> bool:
        """Whether verification is relaxed (output no longer exactly the target's)."""
        return self.lenience < 1.0

    def label(self) -> str:
        """What this policy adds to a method's default name, e.g. ``+entropy`` or ``+lenience0.5(lossy)``."""
        parts = (["entropy"] if self.entropy_tau else []) + (["confidence"] if self.confidence else [])
        if self.lossy:
            parts.append(f"lenience{self.lenience:g}(lossy)")
        return "".join(f"+{p}" for p in parts)


class DraftPolicy:
    """A :class:`PolicyConfig`'s state over one generation, driven by the decoding loop."""

    def __init__(self, config: PolicyConfig = PolicyConfig()):
        self.config = config
        self.rule = EntropyRule(config.entropy_tau) if config.entropy_tau else None
        self.confident = True

    def begin(self) -> None:
        """Start a sequence: the initial threshold, and drafting allowed."""
        if self.rule is not None:
            self.rule.reset()
        self.confident = True

    @property
    def drafting(self) -> bool:
        """Whether to draft this step (the confidence gate)."""
        return self.confident

    @property
    def max_entropy(self) -> float | None:
        """The entropy above which drafters stop expanding a node (None: no limit)."""
        return self.rule.tau if self.rule is not None else None

    def observe(self, tree, path: list[int], confident: bool | None) -> None:
        """After a verification: ``path`` the accepted nodes of ``tree`` (None when the target
        decoded alone), ``confident`` whether the target's confidence met the threshold."""
        if confident is not None:
            self.confident = confident
        if self.rule is not None and tree is not None:
            end = path[-1] if path else -1
            value = tree.entropy.get(end)
            proposal = tree.proposals.get(end)
            # A rejection only where the end node's children were verified (all pruned: nothing was).
            if value is not None and proposal is not None and any(n is not None for n in proposal.nodes):
                self.rule.rejected(value)
