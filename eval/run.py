"""Benchmark drafters with the shared speculative decoding engine and print the acceptance table.

    python eval/run.py --target default --drafter prompt_lookup --drafter oracle \
        --bench mt_bench --limit 10 --max-new-tokens 256 --temperature 0 --out results/

``--drafter`` repeats; trained drafters are ``KIND:PATH`` (``draft_lm:PATH_OR_HUB_ID``,
``eagle:runs/x/checkpoint-final``, ``medusa:...``) with options after ``?`` (see
``draftsmith.eval.drafters``). Writes results.json, results.csv, table.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys

import torch

from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.eval.bench import HF_BASELINES, run_bench
from draftsmith.eval.drafters import build_drafter, parse_spec
from draftsmith.eval.drafters.draft_lm import DraftLMDrafter
from draftsmith.eval.report import markdown_table, write_results
from draftsmith.eval.runner import ContextLengthError, UnsupportedTargetError
from draftsmith.eval.sampling import SamplingConfig
from draftsmith.target import load_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default", help="'default' (bundled SmolLM2-135M-Instruct), hub id, folder or .gguf")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--chat-template", default=None, help="Jinja file or text, for targets that ship none (e.g. Vicuna)")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: the first accelerator)")
    parser.add_argument("--drafter", action="append", default=[], metavar="SPEC",
                        help="KIND[:PATH][?key=value&...]; repeat to compare several")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bench", default=MT_BENCH, help="'mt_bench' (bundled, 80 questions)")
    source.add_argument("--prompts", help="JSONL prompt set: a 'turns' list or a 'prompt' string per line")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts")
    parser.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    parser.add_argument("--turns", type=int, default=1, help="turns per prompt (MT-bench has 2; turn 2 follows turn 1's answer)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-baseline", action="append", default=[], choices=HF_BASELINES,
                        help="also time Hugging Face generate: plain, prompt lookup (10 tokens), assisted "
                             "(with each draft_lm drafter's model, at its depth)")
    parser.add_argument("--hf-assistant", action="append", default=[], metavar="NAME",
                        help="with --hf-baseline hf_assisted: only these draft_lm drafters (by name) as "
                             "assistants; repeatable (default: every draft_lm drafter)")
    parser.add_argument("--out", default="results", help="output folder")
    args = parser.parse_args(argv)
    if not args.drafter:
        parser.error("give at least one --drafter (e.g. --drafter prompt_lookup)")
    return args


def _user_errors(run):
    """A target or request the engine cannot serve exits 2 with its one-line reason, no traceback."""
    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except (ContextLengthError, UnsupportedTargetError) as err:
            print(f"eval/run.py: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    return wrapped


@_user_errors
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    specs = [parse_spec(s) for s in args.drafter]
    draft_lms = [s.name for s in specs if s.kind == "draft_lm"]
    unknown = sorted(set(args.hf_assistant) - set(draft_lms))
    if unknown:  # before the target loads: a typo should not cost a model load
        raise SystemExit(f"--hf-assistant {', '.join(unknown)}: no draft_lm drafter of that name "
                         f"(draft_lm drafters: {', '.join(draft_lms) or 'none'})")
    target, tokenizer = load_target(args.target, args.dtype, args.device, args.chat_template)
    drafters = [build_drafter(spec, target) for spec in specs]
    prompts = load_prompts(args.prompts or args.bench, args.limit, args.per_category)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    assistants = {d.name: (d.runner.model, d.depth) for d in drafters if isinstance(d, DraftLMDrafter)}
    if args.hf_assistant:
        assistants = {name: assistants[name] for name in args.hf_assistant}
    runs = run_bench(target, tokenizer, drafters, prompts, args.max_new_tokens, sampling, args.turns,
                     tuple(args.hf_baseline), assistants, args.seed)
    meta = {
        "argv": sys.argv if argv is None else ["eval/run.py", *argv],
        "target": args.target, "dtype": args.dtype, "device": str(next(target.parameters()).device),
        "bench": args.prompts or args.bench, "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "turns": args.turns,
        "drafters": args.drafter, "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "verified_by": {d.name: d.verifier_label or f"target {args.target}" for d in drafters},
    }
    summary = write_results(runs, args.out, meta)
    print(f"\n{len(prompts)} prompts x {args.turns} turn(s), {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, target {args.target} ({args.dtype})\n")
    print(markdown_table(summary))
    for drafter in drafters:
        if drafter.verifier_label:
            print(f"{drafter.name} is verified by its own target: {drafter.verifier_label}")
    print(f"\nwrote {args.out}/results.json, results.csv, table.md and plots")
    return summary


if __name__ == "__main__":
    main()
