"""Throughput of batched decoding (tokens/s over all rows) at batch 1, 4 and 16, where the model is tiny.

The overhead probe of ``bench/overhead.py`` (random-weight Llama, 2 layers, hidden 64, the bundled
tokenizer's vocabulary): plain greedy decoding and the fixed 12-node EAGLE-style tree (nothing is
accepted on a random target, so every step is a full tree pass and produces one token per row),
with :class:`~draftsmith.eval.engine.batch_decode.BatchDecoder`, prompts of different lengths (200 tokens
minus 3 per row). The single-prompt :class:`~draftsmith.eval.engine.decode.SpeculativeDecoder` runs in
the same run as the baseline; methods interleaved, medians over repeats.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/batch_throughput.py --out results/batch
"""

from __future__ import annotations

import statistics

import torch
from overhead import FixedTreeDrafter, save_report, setup, tiny_target

from draftsmith.errors import ArgumentParser, at_least, report_user_errors
from draftsmith.eval.engine.batch_decode import BatchDecoder
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.target import load_tokenizer
from draftsmith.timing import clock


def tokens_per_second(run, device) -> float:
    """New tokens over all rows per second of one call of ``run`` (prefill included)."""
    start = clock(device)
    generations = run()
    return sum(len(g.tokens) for g in generations) / (clock(device) - start)


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=at_least(48), default=200)
    parser.add_argument("--new-tokens", type=at_least(1), default=64)
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="runs per method (interleaved)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="results/batch")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    vocab = len(load_tokenizer())
    model = tiny_target(vocab, device)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(vocab, (args.prompt_tokens - 3 * i,), generator=generator).tolist() for i in range(max(batches))
    ]
    tree, n = FixedTreeDrafter(), args.new_tokens
    batch_decoder = BatchDecoder(model, eos_ids=set())
    methods = {
        "single_plain": lambda: [SpeculativeDecoder(model, None, eos_ids=set()).generate(prompts[0], n)],
        "single_tree12": lambda: [SpeculativeDecoder(model, tree, eos_ids=set()).generate(prompts[0], n)],
    }
    for b in batches:
        methods[f"batch{b}_plain"] = lambda b=b: batch_decoder.generate(prompts[:b], n)
        methods[f"batch{b}_tree12"] = lambda b=b: batch_decoder.generate(prompts[:b], n, [tree] * b)
    rates: dict[str, list[float]] = {name: [] for name in methods}
    with torch.no_grad():
        for run in methods.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in methods.items():
                rates[name].append(tokens_per_second(run, device))
    report = {f"{name}_tok_s": round(statistics.median(values), 1) for name, values in rates.items()}
    for kind in ("plain", "tree12"):
        for b in batches:
            report[f"batch{b}_{kind}_vs_single"] = round(
                report[f"batch{b}_{kind}_tok_s"] / report[f"single_{kind}_tok_s"], 2
            )
    report["setup"] = setup(args, device, vocab)
    return save_report(report, args.out, "batch.json")


if __name__ == "__main__":
    main()
