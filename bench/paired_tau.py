"""Acceptance length of two methods of one ``eval/run.py`` results.json, paired over its prompt turns:
each method's pooled tau, the difference and its two-sided 95% paired bootstrap interval.

    python bench/paired_tau.py results/x/results.json --base dflash:dflash --other dspark:dspark

Prints one Markdown row (``--header`` first prints the table's header). The turns both methods ran
are paired by prompt id and turn; a method missing from the file is one line naming the methods it has.
Several results files (the same comparison run on other seeds) pool their turns, each paired within
its own run:

    python bench/paired_tau.py R0/results.json R1/results.json R2/results.json --base dflash --other domino
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.adapt.judge import paired_gain
from draftsmith.errors import ArgumentParser, UsageError, report_user_errors

LOW = 0.975  # one side of a two-sided 95% interval


def counts(runs: list[dict], method: str) -> dict[tuple[str, int], tuple[int, int]]:
    """``(tokens produced after prefill, target passes after prefill)`` of ``method`` per (prompt id,
    turn): the table's acceptance length, pooled (the prefill's token is not a decoding step's)."""
    return {(r["prompt_id"], r["turn"]): (sum(r["accepted"]), r["steps"]) for r in runs if r["method"] == method}


def compare(results: list[dict], base: str, other: str) -> dict:
    """Pooled tau of ``base`` and ``other`` over the turns both ran, the difference and its
    interval; several ``results`` (runs of other seeds) pool their turns, each paired within its own run."""
    pairs_a, pairs_b = [], []
    for one in results:
        runs = one["runs"]
        methods = sorted({r["method"] for r in runs})
        for name in (base, other):
            if name not in methods:
                raise UsageError(f"no runs of method {name!r} in the results; it has: {', '.join(methods)}")
        a, b = counts(runs, base), counts(runs, other)
        keys = sorted(set(a) & set(b))
        pairs_a += [a[k] for k in keys]
        pairs_b += [b[k] for k in keys]
    tau_a, tau_b, gain, low = paired_gain(pairs_a, pairs_b, LOW)
    _, _, _, high = paired_gain(pairs_a, pairs_b, 1 - LOW)
    return {"base": base, "other": other, "turns": len(pairs_a), "tau_base": tau_a, "tau_other": tau_b}, gain, low, high


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", nargs="+", help="an eval/run.py results.json; several (runs of other seeds) pool their turns"
    )
    parser.add_argument("--base", required=True, help="the method compared against (its name in the table)")
    parser.add_argument("--other", required=True, help="the method compared")
    parser.add_argument("--header", action="store_true", help="print the table's header first")
    args = parser.parse_args(argv)
    results = []
    for path in map(Path, args.results):
        if not path.is_file():
            raise UsageError(f"{path}: no such results file (eval/run.py --out DIR writes DIR/results.json)")
        results.append(json.loads(path.read_text()))
    record, gain, low, high = compare(results, args.base, args.other)
    if args.header:
        print("| base | other | turns | tau base | tau other | difference | 95% paired bootstrap interval |")
        print("|---|---|---|---|---|---|---|")
    print(
        f"| {record['base']} | {record['other']} | {record['turns']} | {record['tau_base']:.3f} | "
        f"{record['tau_other']:.3f} | {gain:+.3f} | [{low:+.3f}, {high:+.3f}] |"
    )


if __name__ == "__main__":
    main()
