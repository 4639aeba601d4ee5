"""Our speculative step against vLLM's: the same head, chain and prompts, one run.

vLLM (one request in flight) decodes plainly, with the export's head drafting a chain of
``--depth`` tokens, and with its ``suffix`` method; draftsmith's engine decodes the same prompts
plainly, with the source checkpoint drafting the same chain (``depth=D&top_k=1&budget=D``) and
with our ``suffix`` drafter, each once with the CPU linears prepacked (the default, ``auto``) and
once without (``--no-prepack-arm`` drops that arm), interleaved prompt by prompt. Rows: tok/s
(prefill included, as vLLM's wall time is), speedup over the same engine's plain decoding,
acceptance length (new tokens per target pass, the prefill counted as one), the share of steps
that drafted, accepted draft tokens per drafted step (vLLM's own acceptance figure) and
milliseconds per target pass. The suffix rows double as a gate: our acceptance against vLLM's
for the same library and settings. Each arm of ours has its own drafters, so a suffix cache
never holds the other arm's output of the same prompt.

    python bench/vllm_step.py EXPORT --checkpoint CKPT --depth 2 --per-category 1 --max-new-tokens 128
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter
from draftsmith.eval.engine.prepack import prepack_linears, unpack_linears
from draftsmith.export.serve_check import export_metadata, prompt_ids, served_as, speculative_config
from draftsmith.target import load_target
from draftsmith.vllm_engine import engine_args, run_job

SUFFIX_TOKENS = 24  # vLLM's default draft cap for suffix (its tree depth)


def _row(tokens: int, seconds: float, accepted: int, drafted_steps: int, outputs) -> dict:
    """One method's figures, defined alike for both engines: a step is a target pass (the prefill
    too, as vLLM's wall time holds it), so steps = new tokens - accepted draft tokens."""
    steps = tokens - accepted
    return {
        "tok_s": tokens / seconds,
        "acceptance_length": tokens / steps,
        "accepted_per_drafted_step": accepted / drafted_steps if drafted_steps else 0.0,
        "drafted_steps": drafted_steps / steps,
        "ms_per_step": 1e3 * seconds / steps,
        "tokens": outputs,
    }


def vllm_rows(target: str, dtype: str, ids, max_new_tokens: int, config: dict) -> dict:
    job = {"task": "generate", "prompts": ids, "max_new_tokens": max_new_tokens}
    rows = {}
    for name, spec in (
        ("plain", None),
        ("head", config),
        ("suffix", {"method": "suffix", "num_speculative_tokens": SUFFIX_TOKENS}),
    ):
        run = run_job({**job, "engine": engine_args(target, dtype, speculative_config=spec)}, f"vLLM {name}")
        counters = run["spec"] if spec else {"num_accepted_tokens": 0, "num_drafts": 0}
        outputs = [o["tokens"] for o in run["outputs"]]
        rows[name] = _row(
            run["new_tokens"], run["seconds"], counters["num_accepted_tokens"], counters["num_drafts"], outputs
        )
    return rows


def our_rows(target: str, dtype: str, ids, max_new_tokens: int, methods: dict, arms: tuple[str, ...]) -> dict:
    """Rows by arm, then method. Each arm has its own decoders (a suffix drafter's cache of earlier
    outputs stays within its arm)."""
    model, tokenizer = load_target(target, dtype)
    decoders = {
        (arm, name): SpeculativeDecoder(model, build_drafter(spec, model) if spec else None, tokenizer)
        for arm in arms
        for name, spec in methods.items()
    }
    modules = [model] + [d.drafter.head for d in decoders.values() if hasattr(d.drafter, "head")]
    totals = {key: [0, 0.0, 0, 0, []] for key in decoders}
    for prompt in ids:
        for arm in arms:
            for module in modules:
                unpack_linears(module) if arm == "unpacked" else prepack_linears(module, "auto")
            for name in methods:
                gen = decoders[(arm, name)].generate(prompt, max_new_tokens)
                total = totals[(arm, name)]
                total[0] += len(gen.tokens)
                total[1] += gen.seconds
                total[2] += len(gen.tokens) - 1 - gen.steps  # accepted draft tokens
                total[3] += sum(d > 0 for d in gen.drafted)
                total[4].append(gen.tokens)
    return {arm: {name: _row(*totals[(arm, name)]) for name in methods} for arm in arms}


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="a speculators export of the head (draftsmith-export --format speculators)")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint the export was made from")
    parser.add_argument("--depth", type=int, default=2, help="chain length both engines draft")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-prepack-arm", action="store_true", help="skip our unpacked arm")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    folder = Path(args.export).resolve()
    meta = export_metadata(folder)
    target = meta["target_folder"]
    ids = prompt_ids(target, None, None, args.per_category)
    config = speculative_config(served_as(meta, folder, args.depth), folder)
    theirs = vllm_rows(target, args.dtype, ids, args.max_new_tokens, config)
    kind = meta["kind"]
    methods = {
        "plain": None,
        "head": f"{kind}:{args.checkpoint}?depth={args.depth}&top_k=1&budget={args.depth}",
        "suffix": f"suffix?num_tokens={SUFFIX_TOKENS}",
    }
    arms = ("prepacked",) if args.no_prepack_arm else ("prepacked", "unpacked")
    ours = our_rows(target, args.dtype, ids, args.max_new_tokens, methods, arms)
    plain_tokens = theirs["plain"]["tokens"]
    print(
        f"{len(ids)} MT-bench prompts x {args.max_new_tokens} tokens, {args.dtype}, chain of {args.depth}, "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print(
        "| engine | method | tok/s | speedup | acceptance length | drafted steps | accepted per drafted step "
        "| ms per step | same output as vLLM plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    result = {"prompts": len(ids), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "rows": []}
    groups = [("vLLM", "", theirs)] + [("draftsmith", f" ({arm})", rows) for arm, rows in ours.items()]
    for engine, arm, rows in groups:
        for method, row in rows.items():
            name, base = method + arm, rows["plain"]
            same = sum(a == b for a, b in zip(row["tokens"], plain_tokens)) / len(plain_tokens)
            speedup = row["tok_s"] / base["tok_s"]
            print(
                f"| {engine} | {name} | {row['tok_s']:.1f} | {speedup:.2f}x | {row['acceptance_length']:.2f} | "
                f"{row['drafted_steps']:.0%} | {row['accepted_per_drafted_step']:.2f} | {row['ms_per_step']:.1f} | "
                f"{same:.0%} |"
            )
            result["rows"].append(
                {
                    "engine": engine,
                    "method": name,
                    "speedup": speedup,
                    "same_output": same,
                    **{k: v for k, v in row.items() if k != "tokens"},
                }
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
