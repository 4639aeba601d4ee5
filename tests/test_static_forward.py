"""The static-shape forwards that CUDA graphs replay (``cuda_graphs="on"``), checked on a CPU where
the same path runs eagerly: rows padded to a bucket, written at device slots, attending over the
cache's whole capacity with the unfilled rows masked.

The dynamic path (shapes as they come) is the reference: the same sequence of chain, tree, commit
and rollback calls must give the same hidden states and leave the same cache, also when the cache
grows mid-sequence (the static forwards are then made again for the new buffer).
"""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, Qwen3MoeConfig
from tree_drafters import RandomTreeDrafter

from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters.eagle import EagleDrafter
from draftsmith.eval.engine.static_forward import StaticForward
from draftsmith.eval.engine.target_runner import (
    STATIC_CAPACITY,
    TREE_BUCKETS,
    CausalLMRunner,
    graph_blocker,
    use_cuda_graphs,
)
from draftsmith.eval.engine.tree import ROOT
from draftsmith.heads.eagle import EagleHead


def _script(runner: CausalLMRunner, prompt: list[int], seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill, then steps of one-token chains and trees grown over one or two forwards, each
    committing the path to a random row (rows gathered out of order) or nothing; returns every
    forward's hidden states and the committed cache. Rows are addressed as drafters do, from
    ``runner.pending`` before each forward (padding rows count there)."""
    rng = random.Random(seed)
    runner.reset()
    outs = [runner.forward(prompt)]
    for step in range(12):
        if step % 3 == 0:
            outs.append(runner.forward([rng.randrange(64)]))
            continue
        parent_of: dict[int, int] = {}  # runner row -> parent runner row (ROOT: the committed prefix)
        depth_of: dict[int, int] = {}
        for size in [rng.choice([2, 3, 5, 9])] + ([rng.choice([1, 4])] if step % 2 else []):
            base = runner.pending
            parents, depths = [], []
            for i in range(size):
                parent = rng.choice([ROOT, *parent_of, *range(base, base + i)])
                parents.append(parent)
                above = -1 if parent == ROOT else depth_of[parent] if parent < base else depths[parent - base]
                depths.append(above + 1)
            outs.append(runner.forward([rng.randrange(64) for _ in range(size)], parents, depths))
            for i in range(size):
                parent_of[base + i], depth_of[base + i] = parents[i], depths[i]
        row, path = rng.choice(list(parent_of)), []
        while row != ROOT:
            path.append(row)
            row = parent_of[row]
        runner.commit(sorted(path) if step % 4 else [])
    return outs, runner.cache.buffer[..., : runner.length, :].clone()


def test_static_forwards_equal_dynamic_ones_across_chains_trees_and_commits(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=8.0)
    prompt = list(range(2, 30))
    dynamic = CausalLMRunner(model, cuda_graphs="off")
    static = CausalLMRunner(model, cuda_graphs="on")
    want, want_cache = _script(dynamic, prompt)
    got, got_cache = _script(static, prompt)
    assert [o.shape for o in got] == [o.shape for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache[..., : got_cache.shape[-2], :], rtol=1e-5, atol=1e-5)
    assert static.cache.capacity >= STATIC_CAPACITY and dynamic.cache.capacity < STATIC_CAPACITY
    # one static forward per bucket the script used, reused across steps
    assert set(k[0] for k in static.static.entries) <= set(TREE_BUCKETS) and len(static.static.entries) >= 3


def test_static_forwards_survive_the_cache_growing(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=8.0)
    model.config.max_position_embeddings = 4 * STATIC_CAPACITY
    prompt = [random.Random(1).randrange(2, 64) for _ in range(STATIC_CAPACITY - 20)]
    drafter = RandomTreeDrafter(64, seed=1)
    want = SpeculativeDecoder(model, None, eos_ids=set(), cuda_graphs="off").generate(prompt, 60).tokens
    decoder = SpeculativeDecoder(model, drafter, eos_ids=set(), cuda_graphs="on")
    buffers = []
    original = decoder.runner.static.clear

    def clear():
        buffers.append(decoder.runner.cache.buffer.shape[-2])
        original()

    decoder.runner.static.clear = clear
    decoder.generate(prompt[:20], 8)  # the static forwards made for a buffer of the least capacity
    made = len(decoder.runner.static.entries)
    assert decoder.generate(prompt, 60).tokens == want  # a request that outgrows it
    assert made and buffers == [STATIC_CAPACITY, 2 * STATIC_CAPACITY]
    assert decoder.runner.cache.capacity == 2 * STATIC_CAPACITY


def test_unfilled_cache_rows_are_masked_and_a_mask_that_shows_them_is_caught(make_tiny_llama):
    """The static path attends over the whole capacity: rows past the filled ones hold stale or
    zero keys. Filled with large numbers they change nothing; a mask that lets a row see them
    (the negative control) changes the output, so the equality above could fail."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=8.0)
    prompt = list(range(2, 30))
    want = SpeculativeDecoder(model, None, eos_ids=set(), cuda_graphs="off").generate(prompt, 20).tokens
    decoder = SpeculativeDecoder(model, RandomTreeDrafter(64, seed=2), eos_ids=set(), cuda_graphs="on")
    decoder.generate(prompt, 4)
    with torch.inference_mode():
        decoder.runner.cache.buffer[..., 64:, :] = 50.0  # stale rows, far from the filled ones
    assert decoder.generate(prompt, 20).tokens == want
    runner = decoder.runner
    honest = runner._mask

    def leaky(n, depths, width=None):
        mask = honest(n, depths, width)
        if width is not None:
            mask[..., runner.length + runner.pending :] = 0.0  # the unfilled rows become visible
        return mask

    runner._mask = leaky
    assert decoder.generate(prompt, 20).tokens != want


def test_a_static_forward_reuses_its_buffers_and_reads_the_new_inputs():
    calls = []

    def body(x, y):
        calls.append(x.data_ptr())
        return (x * 2 + y,)

    forward = StaticForward(body)  # a CPU: no graph, the body runs on the buffers
    first = forward(("a",), {"x": torch.ones(3), "y": torch.zeros(3)})[0]
    second = forward(("a",), {"x": torch.full((3,), 5.0), "y": torch.ones(3)})[0]
    assert first.tolist() == [2.0] * 3 and second.tolist() == [11.0] * 3
    assert calls[0] == calls[1] and len(forward.entries) == 1 and forward.captured == 0
    forward(("b",), {"x": torch.ones(3), "y": torch.ones(3)})
    assert len(forward.entries) == 2 and calls[2] != calls[0]


def test_capture_buckets_runs_every_bucket_for_every_input_set_and_keeps_nothing(make_tiny_llama):
    """Before timing, every runner's forwards of every bucket size are made (on CUDA: captured),
    the EAGLE head's with its extra inputs (zeros of the shapes it was seen with); decoding after
    it is unchanged."""
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3, scale=8.0)
    prompt = list(range(2, 30))
    want = SpeculativeDecoder(model, None, eos_ids=set(), cuda_graphs="off").generate(prompt, 24).tokens
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleHead.for_target(model, "tiny", init="random"), depth=3, top_k=2, budget=6)
    decoder = SpeculativeDecoder(model, drafter, eos_ids=set(), cuda_graphs="on")
    decoder.generate(prompt, 8)
    decoder.capture_buckets()
    assert {(size,) for size in TREE_BUCKETS} <= set(decoder.runner.static.entries)
    head = drafter.runner.static.entries
    for names in drafter.runner._extra_shapes:
        assert {(size, *names) for size in TREE_BUCKETS} <= set(head), names
    assert decoder.runner.pending == drafter.runner.pending == 0
    assert decoder.generate(prompt, 24).tokens == want


def test_models_that_read_device_values_on_the_host_are_not_captured(make_tiny_llama):
    """Dynamic RoPE and routed experts read a device value on the host inside their forward, which
    a CUDA graph cannot hold: their runners keep the static shapes and run them eagerly, saying why."""
    assert graph_blocker(LlamaConfig()) is None
    assert "dynamic" in graph_blocker(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert "num_experts" in graph_blocker(Qwen3MoeConfig())
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    runner = CausalLMRunner(model, cuda_graphs="on")
    assert runner.static is not None and not runner.static.graphs and "dynamic" in runner.static.failure


def test_the_process_default_reaches_runners_made_without_a_mode(make_tiny_llama):
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=3)
    assert CausalLMRunner(model).static is None  # auto, on a CPU
    use_cuda_graphs("on")
    try:
        assert CausalLMRunner(model).static is not None
        assert CausalLMRunner(model, cuda_graphs="off").static is None  # an explicit mode wins
    finally:
        use_cuda_graphs("auto")
