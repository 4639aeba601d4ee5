"""What the tests that load our exports into speculators share: its EAGLE-3 model, loaded from an
exported folder, and its draft logits set against our head's (the target's features of a sequence
and our head's unrolled passes over them)."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.train.unroll import unroll


def aux_features(target, ids: list[int], layers) -> torch.Tensor:
    """The target's ``hidden_states[L]`` of ``ids`` for each L in ``layers``, concatenated ``[1, n, k*h]``
    (``layers`` None: its last hidden state, what an EAGLE-1 head reads)."""
    out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    if layers is None:
        return out.last_hidden_state
    return torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)


def unroll_over(head, target, ids: list[int], layers, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's features of ``ids`` (``aux_features``' ``layers``) and ``head``'s ``steps``
    training-time-test passes over them (``unroll``: no padding, each later pass fed the one
    before through the head's own ``feedback_input``)."""
    features = aux_features(target, ids, layers)
    padding = torch.ones(1, len(ids), dtype=torch.long)
    return features, unroll(head, torch.tensor([ids]), features[:, :-1], padding, steps, head.feedback_input)


def load_speculators(folder, verifier: Path | None = None):
    """speculators' own loader on an exported folder, with eager attention (its default, flex
    attention, needs a GPU); ``verifier``: the target's local folder in place of the hub id the
    export names (it reads the verifier's embedding and LM head from there, and there is no hub here)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    if verifier is not None:
        config.speculators_config.verifier.name_or_path = str(verifier)
    return Eagle3DraftModel.from_pretrained(folder, config=config).eval()


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


def draft_logits_both(head, theirs, target, ids: list[int], steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per training-time-test pass, speculators' draft logits and ours over the positions whose
    drafts read no padding, given the target's features of ``ids`` (the engine concatenates the aux
    states in the exported, ascending, layer order)."""
    with torch.no_grad():
        _, ours = unroll_over(head, target, ids, head.aux_layers, steps)
        served = aux_features(target, ids, theirs.config.eagle_aux_hidden_state_layer_ids)
        logits = speculators_draft_logits(theirs, served, ids, steps)
        assert len(logits) == steps
        valid = [len(ids) - 1 - step for step in range(steps)]  # pass j's last j positions read padding tokens
        return [(logits[j][0, : valid[j]], head.draft_logits(ours[j])[0, : valid[j]]) for j in range(steps)]


def assert_same_logits(head, theirs, target, ids: list[int], steps: int = 2) -> None:
    """speculators' draft logits equal ours, given the target's features of ``ids``, for ``steps``
    training-time-test passes (pass j feeds back pass j-1's outputs: drafting j tokens ahead)."""
    both = draft_logits_both(head, theirs, target, ids, steps)
    for theirs_logits, ours in both:
        torch.testing.assert_close(theirs_logits, ours, atol=2e-5, rtol=1e-5)
    n = len(ids) - 1
    assert (both[1][0][: n - 1] - both[0][0][: n - 1]).abs().max() > 1e-2  # pass 1 is not pass 0 again
