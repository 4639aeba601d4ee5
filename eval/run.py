"""Benchmark drafters with the shared speculative decoding engine and print the acceptance table.

    python eval/run.py --target default --drafter prompt_lookup --drafter oracle \
        --bench mt_bench --limit 10 --max-new-tokens 256 --temperature 0 --out results/

``--drafter`` repeats; trained drafters are ``KIND:PATH`` (``draft_lm:PATH_OR_HUB_ID``,
``eagle:runs/x/checkpoint-final``, ``medusa:...``) with options after ``?`` (see
``draftsmith.eval.engine.drafters``). Writes results.json, results.csv, table.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.online import adapt_stream, window_table
from draftsmith.adapt.rounds import adaptable_kind
from draftsmith.config import field_ranges, from_dict, ranged, read_recipe_file
from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.data_prep.traffic import TrafficStore
from draftsmith.errors import ArgumentParser, UsageError, at_least, report_user_errors
from draftsmith.eval.cost_model import cost_model_lines
from draftsmith.eval.engine.drafters import build_drafter, kinds_help, parse_spec
from draftsmith.eval.engine.pass_cost import measure_pass_cost
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.eval.engine.target_runner import CUDA_GRAPHS, CausalLMRunner, compile_decoder, use_cuda_graphs
from draftsmith.eval.measure import HF_BASELINES, run_bench
from draftsmith.eval.report import captions, depth_table, markdown_table, summarise, write_results
from draftsmith.kinds import registered
from draftsmith.precision import DTYPE_CHOICES, dtype_name
from draftsmith.recipe import EvalConfig, TargetConfig
from draftsmith.target import load_target
from draftsmith.timing import stage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its ``--help`` listing every registered drafter kind."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=kinds_help())
    parser.add_argument(
        "--recipe",
        default=None,
        help="a training recipe: its target (name, dtype, chat template) and eval section (bench or prompt file, "
        "limit, max_new_tokens, temperature) are the defaults; flags given here win",
    )
    parser.add_argument(
        "--target", default="default", help="'default' (bundled SmolLM2-135M-Instruct), hub id, folder or .gguf"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto: bf16 where it is fast on this device (measured), else fp32",
    )
    parser.add_argument(
        "--chat-template", default=None, help="Jinja file or text, for targets that ship none (e.g. Vicuna)"
    )
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: the first accelerator)")
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="SPEC",
        help="KIND[:PATH][?key=value&...]; repeat to compare several",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bench", default=MT_BENCH, help="'mt_bench' (bundled, 80 questions)")
    source.add_argument("--prompts", help="JSONL prompt set: a 'turns' list or a 'prompt' string per line")
    parser.add_argument("--limit", type=at_least(1), default=None, help="first N prompts")
    parser.add_argument("--per-category", type=at_least(1), default=None, help="first N prompts of each category")
    parser.add_argument("--category", default=None, help="only the prompts of this category (e.g. coding)")
    parser.add_argument(
        "--turns", type=at_least(1), default=1, help="turns per prompt (MT-bench has 2; turn 2 follows turn 1's answer)"
    )
    parser.add_argument("--max-new-tokens", type=at_least(1), default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-baseline",
        action="append",
        default=[],
        choices=HF_BASELINES,
        help="also time Hugging Face generate: plain, prompt lookup (10 tokens), assisted "
        "(with each draft LM drafter's model, at its depth), assisted_dynamic (the same "
        "models with HF's dynamic draft length)",
    )
    parser.add_argument(
        "--hf-assistant",
        action="append",
        default=[],
        metavar="NAME",
        help="with --hf-baseline hf_assisted(_dynamic): only these draft LM drafters (by name) as "
        "assistants; repeatable (default: every draft LM drafter)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target's decoder (dynamic shapes); off by default: on a CPU it "
        "costs ~1.5 min of compilation and slowed tree passes 2x (BENCHMARKS.md)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=CUDA_GRAPHS,
        default="auto",
        help="static shapes for one-token and tree passes, replayed from one CUDA graph per tree-size "
        "bucket (auto: on CUDA devices unless --compile; on: also on a CPU, eagerly: how tests check "
        "that path; off: shapes as they come)",
    )
    parser.add_argument(
        "--cost-model",
        action="store_true",
        help="also time each step's drafting, measure the target's pass-cost curve, and print each "
        "method's speedup predicted from those costs next to the measured one, with the best "
        "fixed depth and break-even acceptance they imply (eval/cost_model.py); timing the "
        "drafting synchronises the device around each proposal, which slows GPU runs a little",
    )
    parser.add_argument(
        "--capture",
        default=None,
        metavar="DIR",
        help="record every prompt's generation with the target's states into a traffic store at DIR "
        "(training data for draftsmith-adapt), at the layers of the first --drafter that reads them: that "
        "drafter's generations, with which of its drafts the target rejected (adapt.rejected_weight)",
    )
    parser.add_argument(
        "--capture-max-gb", type=float, default=None, help="--capture: keep the store under this size (oldest go)"
    )
    parser.add_argument(
        "--capture-max-days",
        type=float,
        default=None,
        help="--capture: drop the store's requests older than this (users' data kept no longer than needed)",
    )
    parser.add_argument(
        "--adapt",
        type=at_least(1),
        default=None,
        metavar="EVERY",
        help="run the prompts as a stream with one --drafter head learning from them: after every EVERY "
        "requests it trains on what the stream captured so far (draftsmith.adapt.online); prints the "
        "acceptance length per window of EVERY requests",
    )
    parser.add_argument(
        "--adapt-steps",
        type=at_least(0),
        default=20,
        help="--adapt: optimiser steps per round (0: the frozen head's curve)",
    )
    adapt_ranges = field_ranges(AdaptConfig)  # the flags below set these fields: they take what the fields take
    parser.add_argument(
        "--adapt-lr",
        type=ranged(adapt_ranges["learning_rate"]),
        default=AdaptConfig.learning_rate,
        help="--adapt: learning rate",
    )
    parser.add_argument(
        "--adapt-rejected-weight",
        type=ranged(adapt_ranges["rejected_weight"]),
        default=AdaptConfig.rejected_weight,
        help="--adapt: loss weight of the positions where the head's draft was rejected "
        "(adapt.rejected_weight; 1: uniform)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no prompt that, at the mean prompt time so far, would end after this many minutes of "
        "decoding (every method runs on each prompt that starts; the first always runs); the table says "
        "how many prompts ran",
    )
    parser.add_argument("--out", default="results", help="output folder")
    known, _ = parser.parse_known_args(argv)
    if known.recipe is not None:
        parser.set_defaults(**recipe_defaults(known.recipe))
    args = parser.parse_args(argv)
    if args.max_minutes is not None and args.max_minutes <= 0:
        parser.error(f"--max-minutes must be > 0, got {args.max_minutes}")
    for flag in ("capture_max_gb", "capture_max_days"):  # a bound of 0 or less would delete every request
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {value}")
        if value is not None and not args.capture:
            parser.error(f"--{flag.replace('_', '-')} bounds the --capture store: give --capture DIR too")
    if args.capture and Path(args.capture).exists() and not Path(args.capture).is_dir():  # before a model load
        parser.error(f"--capture {args.capture} is a file: give a folder (it holds the captured requests)")
    if args.adapt and (len(args.drafter) != 1 or args.hf_baseline):
        parser.error("--adapt runs one --drafter (a trained head) and no --hf-baseline")
    if not args.drafter:
        parser.error("give at least one --drafter (e.g. --drafter prompt_lookup)")
    try:
        args.sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        parser.error(f"--{str(err).replace('_', '-')}")
    return args


@dataclass
class RecipeSections:
    """What this command reads of a training recipe (the trainer reads the rest)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def recipe_defaults(path: str) -> dict:
    """The flags a training recipe's ``target`` and ``eval`` sections stand for, each validated as
    training validates it."""
    sections = read_recipe_file(path)
    recipe = from_dict(RecipeSections, {key: sections[key] for key in ("target", "eval") if key in sections}, path)
    target, evaluation = recipe.target, recipe.eval
    prompts = {"bench": evaluation.bench} if evaluation.bench == MT_BENCH else {"prompts": evaluation.bench}
    return {
        "target": target.name,
        "dtype": target.dtype,
        "chat_template": target.chat_template,
        "limit": evaluation.limit,
        "max_new_tokens": evaluation.max_new_tokens,
        "temperature": evaluation.temperature,
        **prompts,
    }


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # Everything the user typed is checked before the target loads: a typo should not cost a model load.
    specs = [parse_spec(s) for s in args.drafter]
    lossy = [s.name for s in specs if s.policy.lossy]
    if lossy and args.sampling.greedy:
        raise UsageError(
            f"--drafter {lossy[0]}: lenience relaxes sampling verification; use --temperature > 0 or drop lenience="
        )
    # Drafters whose kind can be generate's assistant_model (the draft LMs).
    assisting = [kind.name for kind in registered().values() if kind.hf_assistant]
    draft_lms = [s.name for s in specs if s.kind in assisting]
    unknown = sorted(set(args.hf_assistant) - set(draft_lms))
    if unknown:
        raise UsageError(
            f"--hf-assistant {', '.join(unknown)}: no {' or '.join(assisting)} drafter of that name "
            f"({' or '.join(assisting)} drafters: {', '.join(draft_lms) or 'none'})"
        )
    prompts = load_prompts(args.prompts or args.bench, args.limit, args.per_category, args.category)
    if not prompts:
        raise UsageError(f"{args.prompts or args.bench}: no prompts to run")
    short = [p.id for p in prompts if len(p.turns) < args.turns]
    if len(short) == len(prompts):  # prompts with fewer turns run the turns they have
        raise UsageError(
            f"--turns {args.turns}: all {len(short)} prompt(s) have fewer turns (e.g. id {short[0]}); lower --turns"
        )
    if args.adapt:  # before the target loads: a drafter with nothing to train is refused at once
        if specs[0].path is None:
            raise UsageError(
                f"--adapt: --drafter {args.drafter[0]} has no trained head to adapt: give a head checkpoint "
                "(e.g. eagle3:runs/x/checkpoint-final)"
            )
        adaptable_kind(specs[0].path, "--adapt: --drafter")
    use_cuda_graphs(args.cuda_graphs)  # every runner: the decoders', the drafters', the tree planners'
    with stage("eval: load target and drafters"):
        target, tokenizer = load_target(args.target, args.dtype, args.device, args.chat_template, field="--target")
        drafters = [build_drafter(spec, target) for spec in specs]
        if args.compile:
            compile_decoder(target)
    sampling = args.sampling
    if args.adapt:
        return _stream(args, target, tokenizer, drafters[0], specs[0], prompts)
    capture = None
    if args.capture:
        layers = next((d.feature_layers for d in drafters if d.feature_layers), None)
        limit = int(args.capture_max_gb * 2**30) if args.capture_max_gb else None
        age = args.capture_max_days * 86400 if args.capture_max_days else None
        capture = TrafficStore.for_target(
            args.capture, target, tokenizer, args.target, layers, max_bytes=limit, max_age=age
        )
    assistants = {d.name: d.assistant() for d in drafters if d.assistant() is not None}
    if args.hf_assistant:
        assistants = {name: assistants[name] for name in args.hf_assistant}
    try:
        with stage(f"eval: decode {len(prompts)} prompts x {len(drafters) + 1 + len(args.hf_baseline)} methods"):
            runs = run_bench(
                target,
                tokenizer,
                drafters,
                prompts,
                args.max_new_tokens,
                sampling,
                args.turns,
                tuple(args.hf_baseline),
                assistants,
                args.seed,
                time_drafting=args.cost_model,
                capture=capture,
                max_seconds=args.max_minutes * 60 if args.max_minutes else None,
            )
    finally:  # the requests served before an interruption are traffic too: written, the store released
        if capture is not None:
            capture.close()
    ran = len({r.prompt_id for r in runs})
    meta = {
        "argv": sys.argv if argv is None else ["eval/run.py", *argv],
        "target": args.target,
        "dtype": dtype_name(next(target.parameters()).dtype),
        "device": str(next(target.parameters()).device),
        "bench": args.prompts or args.bench,
        "per_category": args.per_category,
        "prompts": ran,
        "prompts_asked": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "turns": args.turns,
        "drafters": args.drafter,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "compile": args.compile,
        "cuda_graphs": args.cuda_graphs,
        # what the run kept of users' requests, and for how long
        "capture": args.capture,
        "capture_max_gb": args.capture_max_gb,
        "capture_max_days": args.capture_max_days,
        "verified_by": {d.name: d.verifier_label or f"target {args.target}" for d in drafters},
        "trees": {d.name: d.tree_label for d in drafters if d.tree_label},
    }
    model_lines = []
    if args.cost_model:
        with stage("eval: pass-cost curve for the cost model"):
            largest = max((n for r in runs for n in r.drafted), default=0) + 1
            costs = measure_pass_cost(CausalLMRunner(target), sizes=tuple(range(1, max(largest, 9) + 1)))
        meta["pass_cost_seconds"] = {str(n): c for n, c in costs.items()}
    summary = summarise(runs, meta)
    if args.cost_model:
        model_lines = cost_model_lines(summary, runs, costs)
    write_results(runs, args.out, summary=summary)
    cut = f" (of {len(prompts)}: --max-minutes {args.max_minutes} spent)" if ran < len(prompts) else ""
    print(
        f"\n{ran} prompts{cut} x {args.turns} turn(s), {args.max_new_tokens} new tokens, "
        f"temperature {args.temperature}, target {args.target} ({meta['dtype']})\n"
    )
    print(markdown_table(summary))
    if depth_table(summary):
        print(f"\nsteps accepting at least d draft tokens:\n\n{depth_table(summary)}")
    for line in captions(summary) + model_lines:
        print(f"\n{line}")
    for drafter in drafters:
        if drafter.verifier_label:
            print(f"{drafter.name} is verified by its own target: {drafter.verifier_label}")
    print(f"\nwrote {args.out}/results.json, results.csv, table.md and plots")
    return summary


def _stream(args, target, tokenizer, drafter, spec, prompts) -> dict:
    """``--adapt``: the prompts' first turns as a stream with the head learning between requests."""
    cfg = AdaptConfig(
        head=spec.path or "",
        traffic="-",
        learning_rate=args.adapt_lr,
        round_steps=args.adapt_steps,
        seed=args.seed,
        rejected_weight=args.adapt_rejected_weight,
    )
    ids = [render_prompt(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    with stage(f"eval: stream of {len(ids)} requests, the head adapting every {args.adapt}"):
        requests = adapt_stream(
            target,
            args.target,
            tokenizer,
            drafter,
            spec.path,
            ids,
            args.max_new_tokens,
            args.adapt,
            cfg,
            args.capture,
            args.sampling,
            args.seed,
        )
    table = window_table(requests, args.adapt)
    print(f"\n{spec.name} learning from the stream ({args.adapt_steps} steps every {args.adapt} requests):\n\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream.json").write_text(json.dumps([r.__dict__ for r in requests], indent=1))
    (out / "stream.md").write_text(table + "\n")
    print(f"\nwrote {out}/stream.json and stream.md")
    return {"stream": [r.__dict__ for r in requests]}


def cli() -> None:
    """The ``draftsmith-eval`` console script: :func:`main` without its return value (which the
    console-script wrapper would print and turn into exit code 1)."""
    main()


if __name__ == "__main__":
    cli()
