"""The prepared GPU run: the engine's device checks, an EAGLE-3 head trained on the device at the
scale the method needs, and the MT-bench table measured there, in stages that each keep to a time
budget and record what they did as they finish.

    python bench/gpu_suite.py --out OUT [--work DIR] [--stages identity,train,table,profile] \
        [--data CONVERSATIONS.jsonl[.xz]] [--train-minutes 3] [--table-minutes 1] [--cuda-graphs auto]

Stages (docs/gpu_runbook.md gives the device calls and their timing):

- ``identity``: every drafter kind's greedy output, and plain decoding's, with static shapes and
  CUDA graphs equals plain decoding's without them, on tiny random-weight models on the device,
  with the graphs captured and host syncs per step, and the training-side equalities
  (``bench/cuda_check.py``);
- ``train``: an EAGLE-3 head for the bundled SmolLM2 target (``recipes/smollm2-eagle3-gpu.yaml``),
  features computed online on the device, from conversations carried as text; the learning curve
  and held-out top-1 per draft depth; the head is cut into files of at most 16 MiB for the way back
  (``bench/gpu_parts.py join`` puts it together);
- ``table``: MT-bench in bf16 at temperature 0 and 1, each within its budget: plain decoding, prompt
  lookup, suffix decoding (where arctic-inference is installed), the trained head with its planned
  tree, the hybrid of the head and the lookup, Hugging Face ``generate`` plain and with prompt
  lookup (``--cuda-graphs`` as ``eval/run.py``'s; the results are written after each temperature);
- ``profile``: the planner's pass-cost curve measured on the device, and milliseconds per step
  split by engine phase under ``torch.profiler`` (``bench/profile_decode.py``) for plain decoding
  and each drafter of the table, with CUDA graphs off and on: what the graphs save.

State lives under ``--work`` (on a warm machine a rerun skips the stages already done; ``--force``
reruns them); ``OUT`` receives ``suite.json``, ``suite.md`` and ``head/`` after every stage, so a
run cut short still returns what finished. On a CPU, ``--tiny`` runs every stage at toy size on a
small target (the test suite does, so the run cannot rot between devices).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
import traceback
from pathlib import Path

import torch
import transformers

from draftsmith.timing import clock

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2-eagle3-gpu.yaml"
STAGES = ("identity", "train", "table", "profile")
PART_BYTES = 16 * 2**20 - 4096  # what comes back from the device: files of at most 16 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="results: suite.json, suite.md, head/ (parts)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/draftsmith-gpu/work"), help="state kept between calls")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--force", action="store_true", help="rerun stages already done")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--target", default="default", help="target of the train and table stages")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="EAGLE-3 training recipe")
    parser.add_argument("--data", default=None, help="training conversations (.jsonl, or .jsonl.xz as packed)")
    parser.add_argument("--train-minutes", type=float, default=3.0, help="training budget (training.max_minutes)")
    parser.add_argument("--table-minutes", type=float, default=1.0, help="decoding budget per temperature")
    parser.add_argument("--profile-tokens", type=int, default=96, help="new tokens of each profiled generation")
    parser.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="the table's decoding (eval/run.py --cuda-graphs); the profile stage runs both off and on",
    )
    parser.add_argument(
        "--call-minutes",
        type=float,
        default=9.5,
        help="this call's limit (the device's: 10 minutes a command): the table's budget shrinks to what is left",
    )
    parser.add_argument("--per-category", type=int, default=2, help="MT-bench questions per category")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="target dtype in training and the table")
    parser.add_argument(
        "--parts",
        type=Path,
        default=None,
        help="bundled assets carried in parts (bench/gpu_pack.py): joined and placed in the draftsmith cache "
        "once every part has arrived; until then the stages that need the target wait",
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes, for a CPU (the test suite)")
    # any other --section.field VALUE is a training recipe override
    args, args.train_overrides = parser.parse_known_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    return args


def stage_identity(args, work: Path, results: dict) -> dict:
    """bench/cuda_check.py's decoding and training checks on ``args.device``."""
    from cuda_check import check_decoding, check_training, passed, tiny_target

    target = tiny_target(args.device)
    decoding, training = check_decoding(target, args.device), check_training(target, args.device)
    return {"ok": passed(decoding, training), "decoding": decoding, "training": training}


def training_data(args, work: Path) -> str:
    """The conversations file the recipe reads (a packed ``.xz`` is unpacked once into ``work``)."""
    if args.data is None:
        return "sharegpt"
    data = Path(args.data)
    if data.suffix != ".xz":
        return str(data)
    plain = work / data.name.removesuffix(".xz")
    if not plain.is_file():
        with lzma.open(data) as packed, open(f"{plain}.tmp", "wb") as out:
            shutil.copyfileobj(packed, out)
        Path(f"{plain}.tmp").replace(plain)
    return str(plain)


def stage_train(args, work: Path, results: dict) -> dict:
    """Train the EAGLE-3 head on the device; its curve, held-out accuracy per depth and throughput."""
    from draftsmith.train.eagle3 import main as train_eagle3

    run = work / "train"
    argv = [
        str(args.recipe),
        "--target.name",
        args.target,
        "--target.dtype",
        args.dtype,
        "--data.path",
        training_data(args, work),
        "--training.output_dir",
        str(run),
        "--training.max_minutes",
        str(args.train_minutes),
        *args.train_overrides,
    ]
    if (run / "checkpoint-final").is_dir():
        shutil.rmtree(run)  # a finished run of another call: train afresh
    resume = run.is_dir() and any(run.glob("checkpoint-*"))
    started = clock(args.device)
    trainer = train_eagle3(argv + (["--resume"] if resume else []))
    seconds = clock(args.device) - started
    head = Path(trainer.last_checkpoint)
    config = json.loads((head / "config.json").read_text())
    evals = [e for e in trainer.history if any(k.startswith("eval/") for k in e)]
    curve = ("step", "seconds", "train/loss", "train/top1@1", "train/tokens_per_second", "train/tokens_seen")
    return {
        "head": str(head),
        "argv": argv,
        "resumed": resume,
        "steps": trainer.state.step,
        "seconds": round(seconds, 1),
        "training_seconds": round(trainer.state.seconds, 1),
        "supervised_tokens": trainer.state.tokens,
        "held_out_top1_per_depth": config.get("depth_accuracy"),
        "learning_curve": [{k: e[k] for k in curve if k in e} for e in trainer.history if "train/loss" in e],
        "evals": evals,
    }


def _methods(head: str | None, suffix: bool) -> list[str]:
    """The table's drafters: the training-free ones, and the head and its hybrid (with suffix
    decoding where it is available, else prompt lookup) when one was trained."""
    lookup = "suffix" if suffix else "prompt_lookup"
    methods = ["prompt_lookup", "suffix"] if suffix else ["prompt_lookup"]
    if head:
        methods += [f"eagle3:{head}?name=eagle3", f"hybrid:eagle3:{head}+{lookup}?name=hybrid"]
    return methods


class NoTimeLeft(Exception):
    """Too little of the call's time is left for a stage: a later call on the warm machine runs it."""


# Minutes a table temperature costs beyond its decoding budget (loading the target and the
# drafters, warm-up and graph capture; on the H200, eager: ~0.3) and what the profile stage needs
# (the pass-cost curve, two profiled generations per method; eager, ~10 s a generation there).
TABLE_FIXED_MINUTES = 0.4
PROFILE_MINUTES = 1.5


def _minutes_left(args) -> float:
    return (args.deadline - clock(args.device)) / 60


def _head(results: dict) -> str | None:
    train = results.get("train", {})
    return train.get("head") if train.get("done") and Path(train.get("head", "")).is_dir() else None


def stage_table(args, work: Path, results: dict) -> dict:
    """The MT-bench table at temperature 0 and 1 within ``--table-minutes`` each (less when the
    call's time runs short); the results are published after each temperature."""
    from cuda_check import suffix_available

    from draftsmith.eval.run import main as eval_main

    left = _minutes_left(args)
    room = (left - 2 * TABLE_FIXED_MINUTES) / 2  # per temperature
    budget = min(args.table_minutes, room)
    if room <= 0:
        raise NoTimeLeft(f"{left:.1f} of --call-minutes {args.call_minutes} left: run the table in another call")
    suffix = suffix_available()
    methods = _methods(_head(results), suffix)
    out: dict = {"budget_minutes_per_temperature": round(budget, 3), "methods": methods, "suffix": suffix}
    if not suffix:
        out["suffix_missing"] = "arctic-inference is not importable: no suffix rows; the hybrid uses prompt lookup"
    for temperature in (0, 1):
        folder = work / f"table_t{temperature}"
        argv = ["--target", args.target, "--dtype", args.dtype, "--device", args.device, "--bench", "mt_bench"]
        argv += ["--per-category", str(args.per_category), "--max-new-tokens", str(args.max_new_tokens)]
        argv += ["--temperature", str(temperature), "--max-minutes", f"{budget:.3f}", "--out", str(folder)]
        argv += ["--cuda-graphs", args.cuda_graphs, *(w for m in methods for w in ("--drafter", m))]
        argv += ["--hf-baseline", "hf_plain", "--hf-baseline", "hf_prompt_lookup"]
        summary = eval_main(argv + (["--cost-model"] if temperature == 0 else []))
        out[f"t{temperature}"] = {
            "table": (folder / "table.md").read_text(),
            "meta": {k: summary["meta"][k] for k in ("dtype", "device", "prompts", "prompts_asked", "trees")},
            "methods": summary["methods"],
        }
        results["table"] = out  # a call cut during the next temperature still returns this one
        publish(results, work, args.out)
    return out


def stage_profile(args, work: Path, results: dict) -> dict:
    """The device's pass-cost curve and the per-phase step split of plain decoding and each of the
    table's drafters on one MT-bench question, with CUDA graphs off and on."""
    from cuda_check import suffix_available
    from profile_decode import step_phases

    from draftsmith.data_prep.chat import render_prompt
    from draftsmith.data_prep.prompts import load_prompts
    from draftsmith.eval.engine.decode import SpeculativeDecoder
    from draftsmith.eval.engine.drafters import build_drafter
    from draftsmith.eval.engine.pass_cost import measure_pass_cost
    from draftsmith.eval.engine.target_runner import CausalLMRunner
    from draftsmith.eval.engine.tree_plan import monotone
    from draftsmith.target import load_target

    if _minutes_left(args) < PROFILE_MINUTES:
        left = _minutes_left(args)
        raise NoTimeLeft(f"{left:.1f} of --call-minutes {args.call_minutes} left: profile in another call")
    target, tokenizer = load_target(args.target, args.dtype, args.device)
    out: dict = {}
    sizes = range(1, 9 if args.tiny else 33)
    for graphs in ("off", "on"):
        # The verification pass's cost per size as measured, and as the tree planner reads it (isotonic fit).
        measured = measure_pass_cost(CausalLMRunner(target, cuda_graphs=graphs), sizes=sizes)
        for key, costs in (("pass_cost_ms", measured), ("pass_cost_ms_planned", monotone(measured))):
            out[f"{key}_graphs_{graphs}"] = {str(n): round(c * 1e3, 3) for n, c in costs.items()}
    question = load_prompts("mt_bench", limit=1)[0]
    ids = render_prompt(tokenizer, [{"role": "user", "content": question.turns[0]}])
    phases: dict = {}
    for method in ["plain", *_methods(_head(results), suffix_available())]:
        name = method.split("?name=")[-1].split(":")[0]
        for graphs in ("off", "on"):
            drafter = None if method == "plain" else build_drafter(method, target)
            decoder = SpeculativeDecoder(target, drafter, tokenizer, cuda_graphs=graphs)
            decoder.generate(ids, 8)  # warm-up
            decoder.capture_buckets()
            phases[f"{name}_graphs_{graphs}"] = step_phases(decoder, ids, args.profile_tokens)
    out["step_phases"] = phases
    out["training_step"] = training_step_profile(args, work)
    return out


def training_step_profile(args, work: Path, steps: int = 3) -> dict:
    """Where an optimiser step of the train stage's recipe spends its time on the device: the
    first ``training.batch_size`` conversations padded into one batch (the trainer packs them),
    features online, one warm-up step, then ``steps`` steps under ``torch.profiler``: wall, host
    and device milliseconds per step, host syncs per step and the ops that take the most device
    (on a CPU: host) time."""
    from torch.profiler import ProfilerActivity, profile
    from train_step import first_batch, optimiser_step

    from draftsmith.eval.engine.host_syncs import count_host_syncs
    from draftsmith.train.cli import parse_training_args
    from draftsmith.train.eagle3 import Eagle3Recipe, build

    overrides = ["--target.name", args.target, "--target.dtype", args.dtype, "--data.path", training_data(args, work)]
    overrides += ["--data.limit", "64", "--tracking.report_to", "none", *args.train_overrides]
    recipe, _ = parse_training_args(Eagle3Recipe, [str(args.recipe), *overrides])
    task, train_set, _ = build(recipe)
    batch = {k: v.to(args.device) for k, v in first_batch(train_set, recipe.training.batch_size).items()}
    task.target.to(args.device)
    task.model.to(args.device)
    step = optimiser_step(task, "bf16" if args.dtype == "bfloat16" else "fp32", lr=1e-5)
    cuda = args.device.startswith("cuda")
    step(batch)  # warm-up: allocators, kernel selection
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = clock(args.device)
    with count_host_syncs() as syncs, profile(activities=activities) as prof:
        for _ in range(steps):
            step(batch)
    wall = (clock(args.device) - start) / steps
    averages = prof.key_averages()
    by = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(averages, key=lambda e: getattr(e, by), reverse=True)[:12]
    return {
        "batch": list(batch["input_ids"].shape),
        "real_tokens": int(batch["attention_mask"].sum()),
        "wall_ms_per_step": round(wall * 1e3, 2),
        "device_busy_ms_per_step": round(sum(e.self_device_time_total for e in averages) / 1e3 / steps, 2),
        "host_syncs_per_step": syncs.count / steps,
        "top_ops_ms_per_step": {e.key: round(getattr(e, by) / 1e3 / steps, 3) for e in top},
        "note": "profiled steps run under torch.profiler (slower than unprofiled ones); wall is theirs",
    }


def place_assets(parts: Path) -> str | None:
    """Join the carried parts under ``parts`` and move the bundled assets among them to their places
    in the draftsmith cache; returns why the target is not there yet, or None."""
    from gpu_parts import PartsError, join

    from draftsmith.assets import ASSETS, cached_asset_path

    by_file = {Path(asset.member).name: name for name, asset in ASSETS.items()}
    try:
        joined = join(parts, parts / "joined")
    except PartsError as error:
        return str(error)
    for path in joined:
        if path.name in by_file:
            place = cached_asset_path(by_file[path.name])
            place.parent.mkdir(parents=True, exist_ok=True)
            path.replace(place)
    return None


NEEDS_TARGET = ("train", "table", "profile")
# --tiny: a few steps on short rows, evaluated twice (a learning curve of two points)
TINY_TRAINING = [
    *("--training.max_steps", "4", "--training.batch_size", "2", "--training.eval_every", "2"),
    *("--training.log_every", "1", "--training.save_every", "0", "--training.packing", "false"),
    *("--data.max_length", "192", "--data.held_out_fraction", "0.25", "--data.limit", "24"),
    *("--drafter.ttt_steps", "3"),
    *("--drafter.draft_vocab_size", "512"),
]
RUNNERS = {"identity": stage_identity, "train": stage_train, "table": stage_table, "profile": stage_profile}


def report(results: dict) -> str:
    """``suite.md``: each stage's headline figures in Markdown."""
    lines = ["# GPU suite", "", f"device: {results.get('device')}, torch {results.get('torch')}", ""]
    for name in STAGES:
        stage = results.get(name)
        if stage is None:
            continue
        status = "done" if stage.get("done") else "FAILED" if "error" in stage else "waiting"
        lines += [f"## {name}: {status} ({stage.get('wall_seconds', 0):.0f} s)", ""]
        if "error" in stage:
            lines += ["```", stage["error"].strip().splitlines()[-1], "```", ""]
        if "waiting" in stage:
            lines += [stage["waiting"], ""]
        if name == "identity" and "decoding" in stage:
            lines += [
                "| kind | lossless | tokens/step | host syncs/step (max) | CUDA graphs captured |",
                "|---|---|---:|---:|---|",
            ]
            for kind, row in stage["decoding"].items():
                graphs = row.get("cuda_graph_failure") or row.get("cuda_graphs")
                lines.append(
                    f"| {kind} | {row['lossless']} | {row['tokens_per_step']} | {row['host_syncs_per_step_max']} "
                    f"| {graphs} |"
                )
            lines.append("")
        if name == "train" and "steps" in stage:
            lines += [
                f"{stage['steps']} steps in {stage['training_seconds']} s, {stage['supervised_tokens']} supervised "
                f"tokens; held-out top-1 per depth: {stage['held_out_top1_per_depth']}",
                "",
            ]
        if name == "profile" and "step_phases" in stage:
            lines += ["| method, CUDA graphs | tokens/step | wall ms/step | device busy ms/step | device idle |"]
            lines += ["|---|---:|---:|---:|---:|"]
            for method, row in stage["step_phases"].items():
                lines.append(
                    f"| {method.replace('_graphs_', ', ')} | {row['tokens_per_step']} | {row['wall_ms_per_step']} "
                    f"| {row['device_busy_ms_per_step']} | {row['device_idle']} |"
                )
            lines.append("")
        for temperature in (0, 1):
            if f"t{temperature}" in stage:
                table = stage[f"t{temperature}"]
                lines += [f"### temperature {temperature} ({table['meta']['prompts']} prompts)", "", table["table"], ""]
    return "\n".join(lines) + "\n"


def publish(results: dict, work: Path, out: Path) -> None:
    """Write the results into ``work`` and ``out``, the head (if any) cut into parts under ``out/head``."""
    from gpu_parts import cut

    text = json.dumps(results, indent=1, default=str)
    for folder in (work, out):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "suite.json").write_text(text)
        (folder / "suite.md").write_text(report(results))
    head = results.get("train", {}).get("head")
    if head and Path(head).is_dir() and not (out / "head").is_dir():
        for path in sorted(Path(head).iterdir()):
            if path.is_file() and path.name in ("config.json", "model.safetensors"):  # what loads it
                cut(path, out / "head", PART_BYTES)


def main(argv: list[str] | None = None) -> dict:
    """Run the asked stages not yet done; returns the results (also in ``--work`` and ``--out``)."""
    args = parse_args(argv)
    args.deadline = clock(args.device) + args.call_minutes * 60
    if args.tiny:
        args.per_category, args.max_new_tokens = 1, 16
        args.train_overrides = [*TINY_TRAINING, *args.train_overrides]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "suite.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    results.update(device=args.device, torch=torch.__version__, transformers=transformers.__version__)
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    waiting = place_assets(args.parts) if args.parts else None
    for name in args.stages:
        if results.get(name, {}).get("done") and not args.force:
            print(f"gpu suite: {name} already done in {work} (--force reruns it)")
            continue
        if waiting and name in NEEDS_TARGET:
            print(f"gpu suite: {name} waits for the target's parts: {waiting}")
            results[name] = {"waiting": f"the target's parts: {waiting}"}
            publish(results, work, args.out)
            continue
        print(f"gpu suite: stage {name}", flush=True)
        started = clock(args.device)
        try:
            stage = RUNNERS[name](args, work, results)
            stage["done"] = True
        except NoTimeLeft as why:
            print(f"gpu suite: {name} waits for another call: {why}")
            stage = {"waiting": str(why)}
        except Exception:  # every stage runs and reports; the exit code says one failed
            stage = {"error": traceback.format_exc()}
            print(stage["error"], file=sys.stderr)
        stage["wall_seconds"] = round(clock(args.device) - started, 1)
        results[name] = stage
        publish(results, work, args.out)
    print(report(results))
    failed = [n for n in args.stages if "error" in results[n] or results[n].get("ok") is False]
    if failed:
        print(f"gpu suite: {', '.join(failed)} failed (see {args.out}/suite.json)", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
