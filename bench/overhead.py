"""Engine overhead per decode step, where the model costs next to nothing.

A random-weight Llama (2 layers, hidden 64, the bundled tokenizer's vocabulary) makes a forward
pass nearly free, so the time of one decode step is the engine's own host overhead (plus the
LM head over the vocabulary). Measured in one run, methods interleaved, each step timed between
two streamer calls with the device-synchronising clock; medians over steps:

- ours: plain greedy decoding, a fixed 12-node EAGLE-style tree (greedy), the same tree at
  temperature 1 with top-p 0.9, and plain sampling;
- Hugging Face ``generate`` on the same model: plain greedy, plain sampling and assisted by
  prompt lookup (``prompt_lookup_num_tokens``);
- host syncs (device-to-host transfers) per step of ours, counted with
  :func:`draftsmith.eval.engine.host_syncs.count_host_syncs`;
- the model alone on our runner (forward, LM head, argmax) for one token and for the tree, so
  step minus model is the engine's own overhead.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/overhead.py --out results/overhead
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter
from draftsmith.eval.engine.host_syncs import count_host_syncs
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.target_runner import CausalLMRunner, tree_rows
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.target import load_tokenizer
from draftsmith.timing import clock

TOP_P = SamplingConfig(temperature=1.0, top_p=0.9)


def tiny_target(vocab_size: int, device: torch.device, scale: float = 32.0) -> LlamaForCausalLM:
    """The overhead probe: 2 layers, hidden 64, random weights, no EOS (every run is full length).

    ``scale`` multiplies the weights (norms excepted): at the default initialisation the next-token
    distribution is nearly uniform over the vocabulary, nothing like an LM's (top-p 0.9 would keep
    ~90% of it); scaled, it is peaked and context-dependent like a real model's.
    """
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.mul_(scale)
    model.to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class FixedTreeDrafter(Drafter):
    """The same 12-node tree every step, shaped like an EAGLE-2 tree (3 wide, 4 deep)."""

    name = "fixed_tree12"

    def __init__(self):
        builder = TreeBuilder()
        a = builder.add(ROOT, [11, 12, 13])
        b = builder.add(a[0], [21, 22, 23])
        builder.add(a[1], [24, 25])
        c = builder.add(b[0], [31, 32])
        builder.add(c[0], [41, 42])
        self.tree = builder.build()
        assert len(self.tree) == 12

    def propose(self, context: DraftContext) -> TokenTree:
        return self.tree if context.max_tokens >= 4 else TokenTree()


class StepTimer:
    """A streamer (ours: a callable; HF: ``put``/``end``) recording the clock and the sync count at every step."""

    def __init__(self, device, counter=None, skip_first_put: bool = False):
        self.device, self.counter = device, counter
        self.times: list[float] = []
        self.syncs: list[int] = []
        self._skip = skip_first_put  # HF puts the prompt first

    def __call__(self, tokens) -> None:
        self.times.append(clock(self.device))
        if self.counter is not None:
            self.syncs.append(self.counter.count)

    def put(self, value) -> None:
        if self._skip:
            self._skip = False
            return
        self(value)

    def end(self) -> None:
        pass

    def deltas(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]

    def sync_deltas(self) -> list[int]:
        return [b - a for a, b in zip(self.syncs, self.syncs[1:])]


def model_us(model, tree: TokenTree, prompt, device, repeats: int = 200) -> float:
    """Median seconds of the model alone on our runner: a forward over ``[root] + tree`` (or one
    token when ``tree`` is empty), the LM head and the argmax, then discarded."""
    runner = CausalLMRunner(model)
    runner.reset()
    runner.forward(prompt)
    parents, depths = tree_rows(tree.parents, tree.depths)
    times = []
    for _ in range(repeats):
        start = clock(device)
        if len(tree):
            runner.logits(runner.forward([prompt[-1]] + tree.tokens, parents, depths)).argmax(-1)
            runner.commit([])
        else:
            runner.logits(runner.forward([prompt[-1]])).argmax(-1)
            runner.rollback(len(prompt))
        times.append(clock(device) - start)
    return statistics.median(times)


def ours(model, drafter, sampling, prompt, new_tokens, device, seed=0) -> list[float]:
    """Per-step seconds of one generation with our engine."""
    timer = StepTimer(device)
    SpeculativeDecoder(model, drafter, None, sampling, eos_ids=set()).generate(
        prompt, new_tokens, streamer=timer, seed=seed
    )
    return timer.deltas()


def ours_syncs(model, drafter, sampling, prompt, new_tokens, device) -> list[int]:
    """Host syncs of each decode step of one generation with our engine."""
    decoder = SpeculativeDecoder(model, drafter, None, sampling, eos_ids=set())
    with count_host_syncs() as counter:
        timer = StepTimer(device, counter)
        decoder.generate(prompt, new_tokens, streamer=timer, seed=0)
    return timer.sync_deltas()


def hf(model, prompt, new_tokens, device, **kwargs) -> list[float]:
    """Per-step seconds of one Hugging Face ``generate``."""
    timer = StepTimer(device, skip_first_put=True)
    ids = torch.tensor([prompt], device=device)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, streamer=timer, **kwargs)
    return timer.deltas()


def setup(args, device: torch.device, vocab: int, **settings) -> dict:
    """What a probe's figures were measured with: ``args``' prompt and new tokens and repeats, its
    other ``settings``, the device, threads, vocabulary and torch version."""
    return {
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **settings,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "vocab": vocab,
        "torch": torch.__version__,
    }


def save_report(report: dict, out: str, name: str) -> dict:
    """``report``, printed and written as ``name`` into the folder ``out``."""
    print(json.dumps(report, indent=1))
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(report, indent=1))
    return report


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="generations per method (interleaved)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--scale", type=float, default=32.0, help="weight scale of the random target (1: flat distributions)"
    )
    parser.add_argument("--out", default="results/overhead")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    vocab = len(load_tokenizer())
    model = tiny_target(vocab, device, args.scale)
    prompt = torch.randint(vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    n = args.new_tokens
    tree = FixedTreeDrafter()
    methods = {
        "ours_plain_us": lambda seed: ours(model, None, SamplingConfig(), prompt, n, device),
        "ours_tree12_us": lambda seed: ours(model, tree, SamplingConfig(), prompt, n, device),
        "ours_sampling_us": lambda seed: ours(model, tree, TOP_P, prompt, n, device, seed),
        "ours_sampling_plain_us": lambda seed: ours(model, None, TOP_P, prompt, n, device, seed),
        "hf_plain_us": lambda seed: hf(model, prompt, n, device, do_sample=False),
        "hf_sampling_us": lambda seed: hf(
            model, prompt, n, device, do_sample=True, temperature=1.0, top_p=0.9, top_k=0
        ),
        "hf_assisted_us": lambda seed: hf(model, prompt, n, device, do_sample=False, prompt_lookup_num_tokens=10),
    }
    steps: dict[str, list[float]] = {name: [] for name in methods}
    with torch.no_grad():
        for run in methods.values():  # warm-up
            run(0)
        for seed in range(args.repeats):
            for name, run in methods.items():
                steps[name] += run(seed)
        syncs_greedy = ours_syncs(model, tree, SamplingConfig(), prompt, n, device)
        syncs_sampling = ours_syncs(model, tree, TOP_P, prompt, n, device)
        syncs_plain = ours_syncs(model, None, SamplingConfig(), prompt, n, device)
        model_plain = model_us(model, TokenTree(), prompt, device)
        model_tree = model_us(model, tree.tree, prompt, device)
    report = {name: round(statistics.median(values) * 1e6, 1) for name, values in steps.items()}
    report["model_plain_us"] = round(model_plain * 1e6, 1)
    report["model_tree12_us"] = round(model_tree * 1e6, 1)
    report["ours_plain_overhead_us"] = round(report["ours_plain_us"] - report["model_plain_us"], 1)
    report["ours_tree12_overhead_us"] = round(report["ours_tree12_us"] - report["model_tree12_us"], 1)
    report.update(
        {
            "syncs_per_step_greedy": statistics.median(syncs_greedy),
            "syncs_per_step_sampling": statistics.median(syncs_sampling),
            "syncs_per_step_plain": statistics.median(syncs_plain),
            "max_syncs_per_step_greedy": max(syncs_greedy),
            "max_syncs_per_step_sampling": max(syncs_sampling),
            "tree12_vs_plain": round(report["ours_tree12_us"] / report["ours_plain_us"], 2),
            "plain_vs_hf_plain": round(report["ours_plain_us"] / report["hf_plain_us"], 2),
            "steps_per_method": {name: len(values) for name, values in steps.items()},
            "setup": setup(args, device, vocab, scale=args.scale),
        }
    )
    return save_report(report, args.out, "overhead.json")


if __name__ == "__main__":
    main()
