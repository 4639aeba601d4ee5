"""Engine benchmark: our runner vs Hugging Face generate, and the oracle against its ceiling.

Runs eval/run.py's benchmark (baseline, prompt lookup, oracle, plus HF plain / prompt lookup /
assisted) and then, in the same process, measures one verification pass of 1 and K+1 tokens
after a prefix of the prompts' mean length. The oracle's ceiling is tau x t(1) / t(K+1): the
speedup left if verification passes were the only cost. Prints the ratios BENCHMARKS.md records.

    python bench/engine.py --dtype bfloat16 --limit 10 --max-new-tokens 256 --oracle-tokens 8
"""

from __future__ import annotations

import json

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import load_prompts
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.eval.engine.pass_cost import measure_pass_cost
from draftsmith.eval.engine.target_runner import CausalLMRunner
from draftsmith.eval.run import main as run_eval
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.target import load_target


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--oracle-tokens", type=int, default=8)
    parser.add_argument("--lookup", default="prompt_lookup", help="our prompt-lookup spec")
    parser.add_argument("--extra", action="append", default=[], help="more drafter specs to include")
    parser.add_argument("--draft-lm", default="draft_lm?layers=4&depth=3", help="draft LM spec (also HF's assistant)")
    parser.add_argument("--out", default="results/engine")
    args = parser.parse_args(argv)
    k = args.oracle_tokens
    summary = run_eval(
        [
            "--dtype",
            args.dtype,
            "--bench",
            "mt_bench",
            "--limit",
            str(args.limit),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--temperature",
            "0",
            "--drafter",
            args.lookup,
            "--drafter",
            f"oracle?num_tokens={k}",
            "--drafter",
            args.draft_lm,
            *[arg for spec in args.extra for arg in ("--drafter", spec)],
            "--hf-baseline",
            "hf_plain",
            "--hf-baseline",
            "hf_prompt_lookup",
            "--hf-baseline",
            "hf_assisted",
            "--out",
            args.out,
        ]
    )
    m = summary["methods"]
    model, tokenizer = load_target("default", args.dtype)
    prompts = load_prompts("mt_bench", args.limit)
    mean_prompt = sum(len(render_prompt(tokenizer, [{"role": "user", "content": p.turns[0]}])) for p in prompts) / len(
        prompts
    )
    mean_new = m["baseline"]["new_tokens"] / m["baseline"]["num_prompts"]
    context = int(mean_prompt + mean_new / 2)  # the average context a decoding step sees
    costs = measure_pass_cost(CausalLMRunner(model), context, tuple(sorted({1, 2, 4, k + 1, 16, 32})), repeats=20)
    tau = m["oracle"]["acceptance_length"]
    ceiling = tau * costs[1] / costs[k + 1]
    tps = {name: s["tokens_per_second"] for name, s in m.items()}
    report = {
        "pass_cost_ms": {n: round(c * 1e3, 2) for n, c in costs.items()},
        "pass_cost_context_tokens": context,
        "baseline_vs_hf_plain": tps["baseline"] / tps["hf_plain"],
        "prompt_lookup_vs_hf_prompt_lookup": tps["prompt_lookup"] / tps["hf_prompt_lookup"],
        "draft_lm_vs_hf_assisted": tps["draft_lm"] / tps["hf_assisted"],
        "oracle_tau": tau,
        "oracle_speedup": m["oracle"]["speedup"],
        "oracle_ceiling": ceiling,
        "oracle_fraction_of_ceiling": m["oracle"]["speedup"] / ceiling,
    }
    print(json.dumps(report, indent=1))
    with open(f"{args.out}/engine_report.json", "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
