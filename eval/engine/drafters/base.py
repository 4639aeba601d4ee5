"""The one interface every drafter implements.

Per generation the engine calls ``prepare`` (untimed set-up, e.g. the oracle's reference
decode), ``begin`` after the target's prefill, then alternately ``propose`` (a token tree hung
below the last committed token) and ``accept`` (what the target kept). Drafters that need the
target's features (EAGLE, Medusa) set ``needs_hidden`` and receive the target's last hidden
state of every token as it enters the target's cache, or, where ``feature_layers`` names target
layers (EAGLE-3), those layers' hidden states concatenated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from draftsmith.eval.engine.policies import PolicyConfig
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.tree import TokenTree


@dataclass
class DraftContext:
    """What a drafter may look at when it proposes."""

    # prompt + generated so far (the engine's list, grown in place: read it, copy to keep); the last one is the root
    # of the next tree
    tokens: list[int]
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_tokens: int  # no use drafting deeper than the remaining new-token budget
    max_entropy: float | None = None  # the entropy policy's threshold: expand no node less certain than this


@dataclass
class StepResult:
    """What the target kept in one verification step."""

    accepted: list[int]  # accepted draft tokens followed by the target's own next token
    hidden: torch.Tensor | None  # target features (see Drafter.feature_layers) of [root] + accepted draft rows
    tokens: list[int]  # the full sequence after this step (the engine's list: copy to keep)


class Drafter(ABC):
    """A source of token trees for the target to verify."""

    name: str = "drafter"
    needs_hidden: bool = False
    feature_layers: list[int] | None = None  # target layers whose states ``hidden`` carries (None: the last)
    # The model that must verify this drafter's trees when it is not the engine's target (a
    # drafter trained jointly with a tuned copy of the target, e.g. Medusa-2); None: the target.
    verifier = None
    verifier_label = ""  # what ``verifier`` is, for tables
    tree_label = ""  # how its draft tree was chosen (depth=auto: the plan), for tables
    policy = None  # the PolicyConfig the engine applies with this drafter (None: fixed drafting)

    def assistant(self):
        """``(model, draft length)`` when this drafter is a whole causal LM that Hugging Face
        ``generate`` can take as its ``assistant_model`` (a kind declared ``hf_assistant``), else None."""
        return None

    def runners(self) -> list:
        """The :class:`~draftsmith.eval.engine.target_runner.CausalLMRunner` s it drafts with (their
        static shapes and CUDA graphs follow the decoder's ``cuda_graphs``); none by default."""
        return []

    def verifying(self):
        """The context ``verifier`` verifies in (e.g. with the drafter's LoRA adapter switched on)."""
        return nullcontext()

    def prepare(self, prompt: list[int], max_new_tokens: int) -> None:
        """Untimed work before a generation (most drafters need none)."""

    def begin(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """The target has prefilled ``tokens[:-1]``; ``tokens[-1]`` is its first new token."""

    @abstractmethod
    def propose(self, context: DraftContext) -> TokenTree:
        """A tree of guesses for the tokens after ``context.tokens`` (may be empty)."""

    def accept(self, result: StepResult) -> None:
        """Update internal state (caches, features) after verification. Steps may also come
        without a ``propose`` before them (a policy let the target decode alone)."""


@dataclass
class DrafterSpec:
    """A parsed ``KIND[:PATH][?options]`` string (:func:`~draftsmith.eval.engine.drafters.parse_spec`)."""

    kind: str
    path: str | None = None
    options: dict = field(default_factory=dict)
    name: str = ""
    policy: PolicyConfig = PolicyConfig()


def load_head(head_class, spec: DrafterSpec, target: torch.nn.Module) -> torch.nn.Module:
    """The head of ``head_class`` in ``spec.path``, bound to ``target`` and in its dtype."""
    return head_class.from_pretrained(spec.path, target).to(next(target.parameters()).dtype)
