"""The oracle: replays the target's own greedy continuation (a diagnostic, not a real drafter).

Under greedy decoding every draft token is accepted, so its speedup is the engine's ceiling for
the chosen draft length: what is left is the cost of verification passes and engine overhead.
"""

from __future__ import annotations

from draftsmith.eval.engine.drafters.base import DraftContext, Drafter, DrafterSpec
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.engine.tree import TokenTree, chain


class OracleDrafter(Drafter):
    """Proposes the next ``num_tokens`` tokens of the target's greedy output, computed untimed."""

    def __init__(self, runner: CausalLMRunner, num_tokens: int = 8):
        self.runner, self.num_tokens = runner, num_tokens
        self.name = "oracle"
        self.reference: list[int] = []

    def runners(self) -> list:
        return [self.runner]

    def prepare(self, prompt: list[int], max_new_tokens: int) -> None:
        # Imported here: decode imports the drafter registry, which imports this module.
        from draftsmith.eval.engine.decode import autoregressive_greedy

        self.prompt_length = len(prompt)
        self.reference = list(prompt) + autoregressive_greedy(self.runner, prompt, max_new_tokens + 1)

    def propose(self, context: DraftContext) -> TokenTree:
        n = len(context.tokens)
        if context.tokens != self.reference[:n]:  # sampling diverged: nothing left to replay
            return TokenTree()
        return chain(self.reference[n : n + min(self.num_tokens, context.max_tokens)])


def build(spec: DrafterSpec, target) -> OracleDrafter:
    """The drafter of ``oracle?...``: ``target``'s own greedy continuation."""
    return OracleDrafter(CausalLMRunner(target), **spec.options)
