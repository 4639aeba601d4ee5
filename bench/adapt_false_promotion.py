"""How often does ``draftsmith-adapt`` promote a challenger that learnt nothing of the traffic it is judged on,
and how often one that learnt more of it?

Per seed: a tiny target (its weights drawn from the seed, scaled so that its text is repetitive and
heads accept) and an EAGLE-3 head trained briefly on its own replies serve 16 requests
(``--requests``; 32 judges 16, as many as the recipe's default ``adapt.held_out``); one round
runs at the default margin and confidence, judged on the newest half of the requests, for the
positive control of ``tests/test_adapt.py`` (a challenger trained on the older half as served) and
each negative control (trained on unrelated traffic, or on the older half with shuffled or permuted
targets). Prints each verdict and the promotion rate per control with its 95% Wilson interval, then
the false-promotion rate over the clean nulls (unrelated, permuted targets: they teach nothing of the
domain's tokens; per verdict, and one trial per seed since a seed's verdicts share its target and
head) and over all negative controls, each with its one-sided Clopper-Pearson upper bound at
confidence 0.9 (the issue's target: at most 5%, which with no false promotion takes 45 trials). A
judge that never promotes has no false promotions, so the positive control's rate is half of the result.

A promotion is false when the challenger does not accept more than the serving head on the domain,
not only on the requests judged: on a random tiny target a negative control can learn the target's
next-token map anywhere and win for real. ``--fresh N`` measures each promoted challenger (any control)
and the serving head on N fresh requests of the judged domain (the same request generator, later
numbers: neither trained nor judged on), as the judge measures, and records the gain with its 95%
paired bootstrap interval (``fresh_gain``, ``fresh_low``, ``fresh_high``); the tables then count,
per control and over all challengers, promotions confirmed on fresh requests and false ones (fresh
gain at most 0, or below the judge's margin), each rate over all verdicts with its Clopper-Pearson bound.

``--out FILE`` appends one JSON line per verdict as it comes (a run stopped early keeps what it did)
and the tables count every verdict in the file, so chunks resume with ``--first-seed``; ``--only-seeds``
reruns chosen seeds, and ``--base`` adds an earlier file's verdicts to the tables (the rerun's replace
theirs). CPU-sized: about a minute per seed on one thread, plus the fresh requests.

    python bench/adapt_false_promotion.py --seeds 25 --out runs/false_promotion.jsonl
    python bench/adapt_false_promotion.py --first-seed 25 --seeds 25 --out runs/false_promotion.jsonl
    python bench/adapt_false_promotion.py --only-seeds 3,21 --fresh 64 --out runs/false_promotion_fresh.jsonl \\
        --base runs/false_promotion.jsonl
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

from test_adapt import CONTROLS, NULLS, POSITIVE, REQUESTS, control_adapter, deploy, domain_prompts  # noqa: E402

from draftsmith.adapt.config import AdaptConfig  # noqa: E402
from draftsmith.adapt.judge import acceptance_counts, bootstrap_gains  # noqa: E402
from draftsmith.adapt.rounds import serving_head  # noqa: E402
from draftsmith.errors import ArgumentParser, UsageError, report_user_errors  # noqa: E402

CONFIDENCE = 0.9  # the issue's: false promotion at most TARGET at this confidence
TARGET = 0.05
FRESH_INTERVAL = 0.95  # two-sided, of a promotion's gain on fresh requests


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


def fresh_gain(adapter, challenger: Path, prompts: list[list[int]], seed: int) -> dict:
    """The challenger's acceptance-length gain over the serving head on ``prompts`` (requests the round
    neither trained nor judged on), measured as the judge measures (its drafter and token count),
    with its :data:`FRESH_INTERVAL` paired bootstrap interval."""
    cfg, kind = adapter.cfg, adapter.kind.name

    def counts(head) -> list[tuple[int, int]]:
        spec = f"{kind}:{head}?{cfg.judge_drafter}"
        return acceptance_counts(adapter.target, spec, prompts, cfg.judge_max_new_tokens)

    serving, ours = counts(cfg.head), counts(challenger)
    tail = (1 - FRESH_INTERVAL) / 2
    tau_a, tau_b, gains = bootstrap_gains(serving, ours, seed)
    gain, (low, high) = tau_b - tau_a, torch.quantile(gains, torch.tensor([tail, 1 - tail], dtype=gains.dtype)).tolist()
    return {
        "fresh_requests": len(prompts),
        "fresh_tau_serving": round(tau_a, 4),
        "fresh_tau_challenger": round(tau_b, 4),
        "fresh_gain": round(gain, 4),
        "fresh_low": round(low, 4),
        "fresh_high": round(high, 4),
    }


def run_seeds(seeds: list[int], out: Path | None, fresh: int = 0, requests: int = REQUESTS) -> list[dict]:
    """The verdicts of ``seeds``, each printed and appended to ``out`` (flushed) as it comes, with
    ``requests`` served per seed (the older half trained on, the newer half judged); with ``fresh``,
    each promotion also measured on that many fresh requests of the judged domain (:func:`fresh_gain`)."""
    verdicts = []
    sink = out.open("a") if out else None
    try:
        with tempfile.TemporaryDirectory(prefix="draftsmith-false-promotion-") as tmp:
            for seed in seeds:
                deployed = deploy(Path(tmp) / f"seed-{seed}", seed, requests)
                prompts = domain_prompts(deployed["tokenizer"], range(requests, requests + fresh))
                for control in (POSITIVE, *CONTROLS):
                    folder = Path(tmp) / f"seed-{seed}" / control.replace(" ", "-")
                    adapter = control_adapter(deployed, folder, control, seed)
                    verdict = adapter.run(1)[0].verdict
                    record = {"seed": seed, "control": control}
                    keys = ("requests", "tau_serving", "tau_challenger", "gain", "low", "promoted")
                    record |= {k: verdict[k] for k in keys}
                    line = (
                        f"seed {seed} {control}: tau {record['tau_serving']} -> {record['tau_challenger']}, "
                        f"gain {record['gain']:+.4f}, low {record['low']:+.4f}: "
                        f"{'PROMOTED' if record['promoted'] else 'kept out'}"
                    )
                    if fresh and record["promoted"]:
                        record |= fresh_gain(adapter, serving_head(adapter.out), prompts, seed)
                        line += (
                            f"; on {fresh} fresh requests gain {record['fresh_gain']:+.4f} "
                            f"({record['fresh_low']:+.4f} to {record['fresh_high']:+.4f})"
                        )
                    verdicts.append(record)
                    print(line, flush=True)
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
    replaces an earlier one), then, when some promotions were checked on fresh requests,
    :func:`fresh_summary`'s."""
    latest = {(v["seed"], v["control"]): v for v in verdicts}
    groups = [(control, (control,)) for control in (POSITIVE, *CONTROLS)]
    groups += [(f"clean nulls ({' + '.join(NULLS)})", NULLS), ("all negative controls", CONTROLS)]
    lines = [
        f"| challenger | should be | verdicts | promoted | rate | 95% Wilson interval | "
        f"{CONFIDENCE} upper bound (Clopper-Pearson) |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [
        (name, [v["promoted"] for (_, control), v in latest.items() if control in members]) for name, members in groups
    ]
    # A seed's null verdicts share its target, head and judged requests, so they are not independent
    # trials: the conservative count takes one per seed (promoted if any of its clean nulls was).
    per_seed: dict[int, bool] = {}
    for (seed, control), v in latest.items():
        if control in NULLS:
            per_seed[seed] = per_seed.get(seed, False) or v["promoted"]
    rows.append(("clean nulls, one trial per seed (any promoted)", list(per_seed.values())))
    for name, outcomes in rows:
        if not outcomes:
            continue
        n, hits = len(outcomes), sum(outcomes)
        low, high = wilson(hits, n)
        should = "promoted" if name == POSITIVE else "kept out"
        bound = "" if name == POSITIVE else f"{upper_bound(hits, n):.3f}"
        lines.append(f"| {name} | {should} | {n} | {hits} | {hits / n:.3f} | {low:.3f}-{high:.3f} | {bound} |")
    if any("fresh_gain" in v for v in verdicts):
        lines += ["", fresh_summary(latest, AdaptConfig.margin)]
    return "\n".join(lines)


def fresh_summary(latest: dict[tuple[int, str], dict], margin: float) -> str:
    """The Markdown table of promotions checked on fresh requests (:func:`fresh_gain`) per control,
    over all negative controls and over all challengers (whoever the challenger, a promotion that
    fresh requests do not bear out is a false one): confirmed (fresh gain above 0), false (at most 0)
    and short of ``margin`` (the gain the judge asks for), each rate over all verdicts of its row with
    its one-sided Clopper-Pearson upper bound. A promotion not measured on fresh requests counts as
    false."""
    # A verdict's fresh gain: -inf for a promotion not measured, None for one not promoted.
    gains = {key: (v.get("fresh_gain", -math.inf) if v["promoted"] else None) for key, v in latest.items()}
    groups = [(control, (control,)) for control in (POSITIVE, *CONTROLS)]
    groups += [("all negative controls", CONTROLS), ("all challengers", (POSITIVE, *CONTROLS))]
    lines = [
        f"| challenger | verdicts | promoted | not measured | confirmed: fresh gain > 0 (interval above 0) | "
        f"false: fresh gain <= 0 | rate | {CONFIDENCE} upper bound | fresh gain < {margin} | rate | "
        f"{CONFIDENCE} upper bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, members in groups:
        keys = [key for key in latest if key[1] in members]
        if not keys:
            continue
        promoted = [key for key in keys if gains[key] is not None]
        unmeasured = sum(gains[key] == -math.inf for key in promoted)
        confirmed = [key for key in promoted if gains[key] > 0]
        above = sum(latest[key]["fresh_low"] > 0 for key in confirmed)
        false = sum(gains[key] <= 0 for key in promoted)
        short = sum(gains[key] < margin for key in promoted)
        lines.append(
            f"| {name} | {len(keys)} | {len(promoted)} | {unmeasured} | {len(confirmed)} ({above}) | "
            f"{false} | {bounds(false, len(keys))} | {short} | {bounds(short, len(keys))} |"
        )
    # Verdicts of one seed share its target, head and judged requests: the conservative count takes
    # one trial per seed, false if any of its promotions was.
    seeds = sorted({seed for seed, _ in latest})
    false = sum(any(g is not None and g <= 0 for (s, _), g in gains.items() if s == seed) for seed in seeds)
    short = sum(any(g is not None and g < margin for (s, _), g in gains.items() if s == seed) for seed in seeds)
    lines.append(
        f"| all challengers, one trial per seed (any false) | {len(seeds)} | | | | {false} | "
        f"{bounds(false, len(seeds))} | {short} | {bounds(short, len(seeds))} |"
    )
    return "\n".join(lines)


def bounds(hits: int, n: int) -> str:
    """The ``rate | upper bound`` cells of a row: ``hits`` in ``n`` and its one-sided Clopper-Pearson
    bound at :data:`CONFIDENCE`."""
    return f"{hits / n:.3f} | {upper_bound(hits, n):.3f}"


def seed_list(text: str) -> list[int]:
    """The seeds of ``--only-seeds`` (comma-separated, each at least 0)."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise UsageError(f"--only-seeds {text!r}: give seeds of at least 0 separated by commas, e.g. 3,21,27")
    return seeds


def read_verdicts(path: Path, flag: str) -> list[dict]:
    """The verdicts of a JSONL file the bench wrote."""
    if not path.is_file():
        raise UsageError(f"{flag} {path}: not a file of verdicts")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=5, help="tiny targets and heads drawn (default 5; 0: tables only)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed drawn (default 0), to resume a run")
    parser.add_argument("--only-seeds", help="these seeds (comma-separated) instead of --first-seed and --seeds")
    parser.add_argument(
        "--requests",
        type=int,
        default=REQUESTS,
        help=f"requests served per seed: the older half trained on, the newer half judged (default {REQUESTS}; "
        "32 judges 16, the recipe's adapt.held_out)",
    )
    parser.add_argument(
        "--fresh", type=int, default=0, help="measure each promotion on this many fresh requests of the domain (0: off)"
    )
    parser.add_argument("--out", type=Path, help="JSONL of verdicts, appended; the tables count all of its lines")
    parser.add_argument(
        "--base", type=Path, help="JSONL of earlier verdicts the tables count too (--out's replace theirs)"
    )
    args = parser.parse_args(argv)
    if args.seeds < 0 or args.first_seed < 0 or args.fresh < 0:
        raise UsageError(
            f"--seeds, --first-seed and --fresh must be at least 0 (got {args.seeds}, {args.first_seed}, {args.fresh})"
        )
    if args.requests < 4 or args.requests % 2:
        raise UsageError(f"--requests {args.requests}: give an even number of at least 4 (half trained, half judged)")
    if args.out and args.out.exists() and not args.out.is_file():
        raise UsageError(f"--out {args.out}: not a file")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.only_seeds:
        seeds = seed_list(args.only_seeds)
    if not seeds and not (args.out and args.out.is_file()):
        raise UsageError("--seeds 0 summarises an --out file of earlier verdicts: give one that exists")
    base = read_verdicts(args.base, "--base") if args.base else []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    verdicts = run_seeds(seeds, args.out, args.fresh, args.requests)
    if args.out:
        verdicts = read_verdicts(args.out, "--out")
    print("\n" + summary(base + verdicts))


if __name__ == "__main__":
    main()
