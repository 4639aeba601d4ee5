"""Learning curves: held-out top-1 at draft depths against training tokens, from training runs' logs.

    python bench/learning_curve.py --run eagle3=runs/smollm2-eagle3 --depths 1 3 --out BENCH_DIR/eagle3_curve.png

Reads each run's ``log_history.jsonl`` (written by every training run), plots held-out ``top1@d``
for the depths asked against the loss tokens seen, one line per run and depth, writes the PNG and
prints the points as a markdown table (for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.train.loop import LOG_HISTORY  # noqa: E402


def held_out_points(run: Path) -> list[dict]:
    """The run's held-out evaluations in step order (a resumed run's repeated steps: the last wins)."""
    by_step = {}
    for line in (run / LOG_HISTORY).read_text().splitlines():
        entry = json.loads(line)
        if any(key.startswith("eval/") for key in entry):
            by_step[entry["step"]] = entry
    return [by_step[step] for step in sorted(by_step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (repeatable)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    rows = []
    for spec in args.run:
        label, _, folder = spec.partition("=")
        points = held_out_points(Path(folder))
        for depth in args.depths:
            key = f"eval/top1@{depth}"
            xs = [p["tokens_seen"] for p in points if key in p]
            axes.plot(xs, [100 * p[key] for p in points if key in p], marker="o", label=f"{label}, depth {depth}")
        rows += [
            f"| {label} | {p['step']} | {p['tokens_seen']:,} | "
            + " | ".join(f"{100 * p.get(f'eval/top1@{d}', float('nan')):.1f}" for d in args.depths)
            + " |"
            for p in points
        ]
    axes.set_xlabel("training loss tokens seen")
    axes.set_ylabel("held-out top-1 (%)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print("| run | step | tokens seen | " + " | ".join(f"top-1 @{d} (%)" for d in args.depths) + " |")
    print("|---|---|---|" + "---|" * len(args.depths))
    print("\n".join(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
