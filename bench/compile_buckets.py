"""``torch.compile`` of the target's decoder with and without tree-size bucketing, against eager.

The overhead probe of ``bench/overhead.py`` (random-weight Llama, 2 layers, hidden 64, the
bundled tokenizer's vocabulary) decoding with trees of a random size every step (1 to 16 nodes,
like a dynamic drafter's), greedy. Three copies of the same target: eager, compiled
(``compile_decoder``, dynamic shapes) and compiled with :data:`~draftsmith.eval.engine.target_runner.TREE_BUCKETS`
(tree forwards padded to 1, 4, 8, 16, ... rows). Reports the median microseconds per step,
methods interleaved in one process once all are compiled, and for each compiled variant the
first generation's seconds (compilation included) and the graphs it compiled, each measured in
a fresh process with an empty inductor cache (in one process, the second copy reuses the first's graphs).

    OMP_NUM_THREADS=1 taskset -c 1 python bench/compile_buckets.py --out results/compile-buckets
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch._dynamo.utils
from overhead import StepTimer, tiny_target

from draftsmith.errors import ArgumentParser, at_least, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters.base import DraftContext, Drafter
from draftsmith.eval.engine.target_runner import TREE_BUCKETS, compile_decoder
from draftsmith.eval.engine.tree import ROOT, TokenTree, TreeBuilder
from draftsmith.target import load_tokenizer
from draftsmith.timing import clock


class VariableTreeDrafter(Drafter):
    """Trees of 1 to ``largest`` random nodes, up to 3 wide and 4 deep, the same sequence every run."""

    name = "variable_tree"

    def __init__(self, vocab: int, largest: int = 16):
        self.vocab, self.largest = vocab, largest
        self.rng = random.Random(0)

    def prepare(self, prompt: list[int], max_new_tokens: int) -> None:
        self.rng = random.Random(0)

    def propose(self, context: DraftContext) -> TokenTree:
        size = self.rng.randint(1, self.largest)
        builder, frontier = TreeBuilder(), [ROOT]
        while len(builder) < size and frontier:
            parent = frontier.pop(0)
            depth = 0 if parent == ROOT else builder.depths[parent]
            if depth >= min(4, context.max_tokens):
                continue
            width = min(3, size - len(builder))
            frontier += builder.add(parent, [self.rng.randrange(self.vocab) for _ in range(width)])
        return builder.build()


VARIANTS = ("eager", "compiled", "compiled_buckets")


def variant(name: str, vocab: int, device: torch.device):
    """The probe target, eager or compiled (with or without bucketing)."""
    model = tiny_target(vocab, device)
    if name != "eager":
        compile_decoder(model, TREE_BUCKETS if name == "compiled_buckets" else None)
    return model


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=at_least(1), default=200)
    parser.add_argument("--new-tokens", type=at_least(2), default=96)
    parser.add_argument("--repeats", type=at_least(1), default=4, help="timed generations per method (interleaved)")
    parser.add_argument("--out", default="results/compile-buckets")
    parser.add_argument("--first-only", choices=VARIANTS, help=argparse.SUPPRESS)  # the fresh-process probe
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    vocab = len(load_tokenizer())
    prompt = torch.randint(vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    drafter = VariableTreeDrafter(vocab)
    if args.first_only:
        decoder = SpeculativeDecoder(variant(args.first_only, vocab, device), drafter, eos_ids=set())
        start = clock(device)
        with torch.no_grad():
            decoder.generate(prompt, args.new_tokens)
        print(
            json.dumps(
                {"seconds": clock(device) - start, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
            )
        )
        return {}
    first = {}
    for name in VARIANTS[1:]:
        with tempfile.TemporaryDirectory() as cache:
            probe = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--first-only",
                    name,
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--new-tokens",
                    str(args.new_tokens),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
            )
        first[name] = json.loads(probe.stdout.strip().splitlines()[-1])
    decoders = {name: SpeculativeDecoder(variant(name, vocab, device), drafter, eos_ids=set()) for name in VARIANTS}
    steps: dict[str, list[float]] = {name: [] for name in decoders}
    with torch.no_grad():
        outputs = {name: decoder.generate(prompt, args.new_tokens).tokens for name, decoder in decoders.items()}
        for _ in range(args.repeats):
            for name, decoder in decoders.items():
                timer = StepTimer(device)
                decoder.generate(prompt, args.new_tokens, streamer=timer)
                steps[name] += timer.deltas()
    report = {f"{name}_us": round(statistics.median(values) * 1e6, 1) for name, values in steps.items()}
    for name, probe in first.items():
        report[f"{name}_first_generation_s"] = round(probe["seconds"], 1)
        report[f"{name}_graphs_compiled"] = probe["graphs"]
    report["compiled_vs_eager"] = round(report["compiled_us"] / report["eager_us"], 2)
    report["compiled_buckets_vs_eager"] = round(report["compiled_buckets_us"] / report["eager_us"], 2)
    report["same_tokens"] = len({tuple(tokens) for tokens in outputs.values()}) == 1
    report["setup"] = {
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "buckets": TREE_BUCKETS,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
