"""How often does ``draftsmith-adapt`` promote a challenger that learnt nothing of the traffic it is judged on,
and how often one that learnt more of it?

Per seed: a tiny target (its weights drawn from the seed, scaled so that its text is repetitive and
heads accept) and an EAGLE-3 head trained briefly on its own replies serve 16 requests; one round
runs at the default margin and confidence, judged on the newest half of the requests, for the
positive control of ``tests/test_adapt.py`` (a challenger trained on the older half as served) and
each negative control (trained on unrelated traffic, or on the older half with shuffled or permuted
targets). Prints each verdict and the promotion rate per control with its 95% Wilson interval, then
the false-promotion rate over the clean nulls (unrelated, permuted targets: they teach nothing of the
domain's tokens; per verdict, and one trial per seed since a seed's verdicts share its target and
head) and over all negative controls, each with its one-sided Clopper-Pearson upper bound at
confidence 0.9 (the issue's target: at most 5%, which with no false promotion takes 45 trials). A
judge that never promotes has no false promotions, so the positive control's rate is half of the result.

``--out FILE`` appends one JSON line per verdict as it comes (a run stopped early keeps what it did)
and the tables count every verdict in the file, so chunks resume with ``--first-seed``. CPU-sized:
about a minute per seed on one thread.

    python bench/adapt_false_promotion.py --seeds 25 --out runs/false_promotion.jsonl
    python bench/adapt_false_promotion.py --first-seed 25 --seeds 25 --out runs/false_promotion.jsonl
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from scipy.stats import beta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_adapt import CONTROLS, NULLS, POSITIVE, control_round, deploy  # noqa: E402

from draftsmith.errors import ArgumentParser, UsageError, report_user_errors  # noqa: E402

CONFIDENCE = 0.9  # the issue's: false promotion at most TARGET at this confidence
TARGET = 0.05


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of ``hits`` in ``n``."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def upper_bound(hits: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided Clopper-Pearson (exact binomial) upper bound at ``confidence`` of a rate of
    ``hits`` in ``n``: ``1 - (1 - confidence) ** (1 / n)`` at no hits."""
    return 1.0 if hits == n else float(beta.ppf(confidence, hits + 1, n - hits))


def run_seeds(first: int, count: int, out: Path | None) -> list[dict]:
    """The verdicts of seeds ``first`` .. ``first + count - 1``, each printed and appended to ``out``
    (flushed) as it comes."""
    verdicts = []
    sink = out.open("a") if out else None
    try:
        with tempfile.TemporaryDirectory(prefix="draftsmith-false-promotion-") as tmp:
            for seed in range(first, first + count):
                deployed = deploy(Path(tmp) / f"seed-{seed}", seed)
                for control in (POSITIVE, *CONTROLS):
                    folder = Path(tmp) / f"seed-{seed}" / control.replace(" ", "-")
                    verdict = control_round(deployed, folder, control, seed).verdict
                    record = {"seed": seed, "control": control}
                    record |= {k: verdict[k] for k in ("tau_serving", "tau_challenger", "gain", "low", "promoted")}
                    verdicts.append(record)
                    print(
                        f"seed {seed} {control}: tau {record['tau_serving']} -> {record['tau_challenger']}, "
                        f"gain {record['gain']:+.4f}, low {record['low']:+.4f}: "
                        f"{'PROMOTED' if record['promoted'] else 'kept out'}",
                        flush=True,
                    )
                    if sink:
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
    finally:
        if sink:
            sink.close()
    return verdicts


def summary(verdicts: list[dict]) -> str:
    """The Markdown table of promotion rates per control and of false promotions over the clean nulls
    (per verdict and per seed) and over all negative controls (a seed's later verdict for a control
    replaces an earlier one)."""
    latest = {(v["seed"], v["control"]): bool(v["promoted"]) for v in verdicts}
    groups = [(control, (control,)) for control in (POSITIVE, *CONTROLS)]
    groups += [(f"clean nulls ({' + '.join(NULLS)})", NULLS), ("all negative controls", CONTROLS)]
    lines = [
        f"| challenger | should be | verdicts | promoted | rate | 95% Wilson interval | "
        f"{CONFIDENCE} upper bound (Clopper-Pearson) |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [
        (name, [promoted for (_, control), promoted in latest.items() if control in members])
        for name, members in groups
    ]
    # A seed's null verdicts share its target, head and judged requests, so they are not independent
    # trials: the conservative count takes one per seed (promoted if any of its clean nulls was).
    per_seed: dict[int, bool] = {}
    for (seed, control), promoted in latest.items():
        if control in NULLS:
            per_seed[seed] = per_seed.get(seed, False) or promoted
    rows.append(("clean nulls, one trial per seed (any promoted)", list(per_seed.values())))
    for name, outcomes in rows:
        if not outcomes:
            continue
        n, hits = len(outcomes), sum(outcomes)
        low, high = wilson(hits, n)
        should = "promoted" if name == POSITIVE else "kept out"
        bound = "" if name == POSITIVE else f"{upper_bound(hits, n):.3f}"
        lines.append(f"| {name} | {should} | {n} | {hits} | {hits / n:.3f} | {low:.3f}-{high:.3f} | {bound} |")
    return "\n".join(lines)


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=5, help="tiny targets and heads drawn (default 5; 0: tables only)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed drawn (default 0), to resume a run")
    parser.add_argument("--out", type=Path, help="JSONL of verdicts, appended; the tables count all of its lines")
    args = parser.parse_args(argv)
    if args.seeds < 0 or args.first_seed < 0:
        raise UsageError(f"--seeds and --first-seed must be at least 0 (got {args.seeds} and {args.first_seed})")
    if args.out and args.out.exists() and not args.out.is_file():
        raise UsageError(f"--out {args.out}: not a file")
    if args.seeds == 0 and not (args.out and args.out.is_file()):
        raise UsageError("--seeds 0 summarises an --out file of earlier verdicts: give one that exists")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    verdicts = run_seeds(args.first_seed, args.seeds, args.out)
    if args.out:
        verdicts = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    print("\n" + summary(verdicts))


if __name__ == "__main__":
    main()
