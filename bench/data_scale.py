"""Data at one CPU budget: the target's regenerated replies, ShareGPT's own, or a mix (issue 32 item 4).

    python bench/data_scale.py --out R --minutes 20 --regenerated 200 --own 1000

Each arm gets MINUTES of wall time for data preparation and training together: its data is
prepared first (``draftsmith-features``: vLLM regenerates where the arm does and extracts the
features in the same job, timed), then ``train/eagle3.py`` trains from the store (no target in the
trainer) for what is left of the budget. The arms:

- ``regenerated``: the first REGENERATED conversations, replies rewritten by the target (as the
  recipes do now);
- ``own``: the first OWN conversations with ShareGPT's own replies, features by prefill only; the
  head still learns the target's distribution (its loss is against the target's logits);
- ``mix``: the first REGENERATED / 2 rewritten plus ShareGPT's own replies up to OWN / 2 in all.

Every arm is evaluated on one fixed held-out set (``data.held_out_path``): the target's own replies
to HELD_OUT conversations that no arm trains on, regenerated once by vLLM beforehand (not counted).
Writes ``R/ARM`` runs, ``R/data_scale.png`` (held-out top-1 at depth 1 against wall minutes, data
preparation included, and against supervised tokens seen) and prints the tables for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

from draftsmith.timing import clock  # noqa: E402

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.data_prep.sharegpt import load_conversations  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-eagle3.yaml"


def held_out_set(out: Path, skip: int, count: int, max_new_tokens: int) -> Path:
    """The target's replies to ``count`` ShareGPT conversations after the first ``skip`` (vLLM)."""
    regenerated = out / "held_out.jsonl"
    if regenerated.is_file():
        return regenerated
    conversations, _ = load_conversations("sharegpt", limit=skip + count, verbose=False)
    source = out / "held_out_source.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations[skip:]))
    subprocess.run(
        [sys.executable, str(ROOT / "data_prep" / "regenerate.py"), "--data", str(source), "--engine", "vllm"]
        + ["--max-new-tokens", str(max_new_tokens), "--out", str(regenerated)],
        check=True,
    )
    return regenerated


def run_arm(name: str, words: list[str], out: Path, minutes: float) -> dict:
    """Prepare the arm's store (timed), then train for the rest of ``minutes``."""
    run = out / name
    common = [str(RECIPE), *words, "--output_dir", str(run)]
    began = clock("cpu")
    subprocess.run(["draftsmith-features", *common], check=True)
    prepared = clock("cpu") - began
    left = minutes - prepared / 60
    if left <= 0.5:
        return {"arm": name, "prep_s": prepared, "trained": False}
    subprocess.run(
        [sys.executable, str(ROOT / "train" / "eagle3.py"), *common, "--drafter.features", "offline"]
        + ["--training.max_minutes", f"{left:.2f}"],
        check=True,
    )
    return {"arm": name, "prep_s": prepared, "trained": True}


def curve(run: Path) -> list[dict]:
    """The run's held-out evaluations (step, tokens seen, seconds, top-1 at each depth)."""
    entries = [json.loads(line) for line in (run / "log_history.jsonl").read_text().splitlines()]
    return [e for e in entries if "eval/top1@1" in e]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=20.0, help="per arm, preparation and training together")
    parser.add_argument("--regenerated", type=int, default=200, help="conversations the regenerated arm rewrites")
    parser.add_argument("--own", type=int, default=1000, help="conversations of the own-replies arm")
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--arms", nargs="+", default=["regenerated", "own", "mix"])
    parser.add_argument("--report-only", action="store_true", help="the tables and plot of the runs in --out")
    args = parser.parse_args()
    out = Path(args.out)
    if not args.report_only:
        run(args, out)
    report(json.loads((out / "data_scale.json").read_text()), out, args.minutes)


def run(args, out: Path) -> None:
    """Prepare and train every arm; their preparation times go to ``OUT/data_scale.json``."""
    out.mkdir(parents=True, exist_ok=True)
    held_out = held_out_set(out, max(args.own, args.regenerated), args.held_out, args.max_new_tokens)
    common = [
        "--data.held_out_path",
        str(held_out),
        "--data.regenerate.max_new_tokens",
        str(args.max_new_tokens),
        "--data.regenerate.engine",
        "vllm",
        "--data.features.engine",
        "vllm",
        "--tracking.report_to",
        "none",
        "--training.num_epochs",
        "100",
        "--training.eval_every",
        str(args.eval_every),
    ]
    half = args.regenerated // 2
    arms = {
        "regenerated": ["--data.limit", str(args.regenerated)],
        "own": ["--data.limit", str(args.own), "--data.regenerate.enabled", "false"],
        "mix": ["--data.limit", str(half + args.own // 2), "--data.regenerate.conversations", str(half)],
    }
    results = [run_arm(name, [*common, *arms[name]], out, args.minutes) for name in args.arms]
    (out / "data_scale.json").write_text(json.dumps(results, indent=1))


def report(results: list[dict], out: Path, minutes: float) -> None:
    """Print the arms' table and draw ``OUT/data_scale.png`` from their logs."""
    figure, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4.5))
    print("| arm | data preparation | steps | supervised tokens seen | epochs | held-out top-1 @1 / @2 / @3 |")
    print("|---|---|---|---|---|---|")
    for result in results:
        if not result["trained"]:
            print(f"| {result['arm']} | {result['prep_s'] / 60:.1f} min | (no time left to train) | | | |")
            continue
        points = curve(out / result["arm"])
        wall = [(result["prep_s"] + p["seconds"]) / 60 for p in points]
        by_time.plot(wall, [100 * p["eval/top1@1"] for p in points], marker="o", label=result["arm"])
        by_tokens.plot([p["tokens_seen"] for p in points], [100 * p["eval/top1@1"] for p in points], marker="o")
        last = points[-1]
        epoch = [json.loads(x) for x in (out / result["arm"] / "log_history.jsonl").read_text().splitlines()]
        epochs = max((e.get("train/epoch", 0) for e in epoch), default=0)
        depths = " / ".join(f"{100 * last.get(f'eval/top1@{d}', float('nan')):.1f}" for d in (1, 2, 3))
        print(
            f"| {result['arm']} | {result['prep_s'] / 60:.1f} min | {last['step']} | {last['tokens_seen']:,} "
            f"| {epochs} | {depths}% |"
        )
    by_time.axvline(minutes, color="grey", lw=0.5)
    by_time.set_xlabel("wall minutes (data preparation, then training)")
    by_tokens.set_xlabel("supervised tokens seen")
    for axes in (by_time, by_tokens):
        axes.set_ylabel("held-out top-1 at depth 1 (%)")
        axes.grid(alpha=0.3)
    by_time.legend()
    figure.tight_layout()
    figure.savefig(out / "data_scale.png", dpi=120)


if __name__ == "__main__":
    main()
