"""How often does ``draftsmith-adapt`` promote a challenger that learnt nothing of the traffic it is judged on,
and how often one that learnt more of it?

Per seed: a tiny target (its weights drawn from the seed, scaled so that its text is repetitive and
heads accept) and an EAGLE-3 head trained briefly on its own replies serve 16 requests; one round
runs at the default margin and confidence, judged on the newest half of the requests, for the
positive control of ``tests/test_adapt.py`` (a challenger trained on the older half as served) and
each negative control (trained on unrelated traffic, or on the older half with shuffled targets).
Prints each verdict and the promotion rate per control with its 95% Wilson interval: a judge that
never promotes has no false promotions, so the positive control's rate is half of the result.
CPU-sized: about 30 s per seed on one thread.

    python bench/adapt_false_promotion.py --seeds 5
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_adapt import CONTROLS, POSITIVE, control_round, deploy  # noqa: E402


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of ``hits`` in ``n``."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="tiny targets and heads drawn (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    promoted = {control: 0 for control in (POSITIVE, *CONTROLS)}
    with tempfile.TemporaryDirectory(prefix="draftsmith-false-promotion-") as tmp:
        for seed in range(args.seeds):
            deployed = deploy(Path(tmp) / f"seed-{seed}", seed)
            for control in promoted:
                verdict = control_round(deployed, Path(tmp) / f"seed-{seed}" / control.replace(" ", "-"), control, seed)
                verdict = verdict.verdict
                promoted[control] += verdict["promoted"]
                print(
                    f"seed {seed} {control}: tau {verdict['tau_serving']} -> {verdict['tau_challenger']}, "
                    f"gain {verdict['gain']:+.4f}, low {verdict['low']:+.4f}: "
                    f"{'PROMOTED' if verdict['promoted'] else 'kept out'}"
                )
    print("\n| challenger | should be | seeds | promoted | rate | 95% interval |\n|---|---|---|---|---|---|")
    for control, hits in promoted.items():
        low, high = wilson(hits, args.seeds)
        should = "promoted" if control == POSITIVE else "kept out"
        print(f"| {control} | {should} | {args.seeds} | {hits} | {hits / args.seeds:.2f} | {low:.2f}-{high:.2f} |")


if __name__ == "__main__":
    main()
