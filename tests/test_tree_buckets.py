"""Tree-size bucketing (for compiled decoders): padding a tree forward to a fixed row count
changes no output (greedy, fp32) and the forward really sees only bucket sizes."""

from __future__ import annotations

import pytest
from tree_drafters import GreedyPrefixDrafter

from draftsmith.eval.engine.decode import SpeculativeDecoder, autoregressive_greedy
from draftsmith.eval.engine.target_runner import TREE_BUCKETS, CausalLMRunner, compile_decoder

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 3, 17, 22, 8, 40, 41, 5, 9]


def test_bucketed_trees_decode_the_same_tokens(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=6, scale=10.0)
    reference = autoregressive_greedy(CausalLMRunner(model), PROMPT, 40)
    runs, sizes = [], []
    for buckets in (None, TREE_BUCKETS):
        decoder = SpeculativeDecoder(model, GreedyPrefixDrafter(PROMPT, reference, 64, seed=1), eos_ids=set())
        decoder.runner.buckets = buckets
        hook = model.get_decoder().register_forward_pre_hook(
            lambda module, args, kwargs, buckets=buckets: sizes.append((buckets, kwargs["input_ids"].shape[1])),
            with_kwargs=True,
        )
        runs.append(decoder.generate(PROMPT, 40))
        hook.remove()
    assert runs[0].tokens == runs[1].tokens == reference
    assert runs[0].accepted == runs[1].accepted and max(runs[0].accepted) > 2
    padded = {n for b, n in sizes if b is not None} - {len(PROMPT)}  # the prefill is a chain: never padded
    unpadded = {n for b, n in sizes if b is None} - {len(PROMPT)}
    assert padded and padded <= set(TREE_BUCKETS) and len(unpadded - set(TREE_BUCKETS)) > 0


def test_compile_decoder_passes_its_buckets_to_new_runners(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=1, seed=0)
    assert CausalLMRunner(model).buckets is None
    compile_decoder(model, TREE_BUCKETS)  # lazy: nothing compiles until a forward
    assert CausalLMRunner(model).buckets == TREE_BUCKETS
