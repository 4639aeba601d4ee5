"""What the tests that load our exports into speculators share: its EAGLE-3 model's draft logits."""

from __future__ import annotations

import torch


@torch.no_grad()
def speculators_draft_logits(theirs, features: torch.Tensor, ids: list[int], steps: int) -> list[torch.Tensor]:
    """The draft logits of speculators' ``Eagle3DraftModel`` ``theirs`` for each of ``steps``
    training-time-test passes over ``ids``, given the target's fused ``features`` ``[1, len(ids), H]``
    (pass j feeds back pass j-1's outputs: drafting j tokens ahead)."""
    n = len(ids) - 1
    logits: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda module, args, out: logits.append(out))
    try:
        theirs(
            hidden_states=features[:, :-1],
            input_ids=torch.tensor([ids[1:]]),
            document_ids=torch.zeros(1, n, dtype=torch.long),
            position_ids=torch.arange(n)[None],
            ttt_steps=steps,
        )
    finally:
        hook.remove()
    return logits
