"""Turn benchmark runs into the acceptance table (Markdown), results.json, results.csv and plots.

acceptance_length: tokens produced after prefill / target passes after prefill, pooled over
prompts. speedup: the method's tokens per second over the baseline's, on the same prompts in the
same run (equal to the wall-clock ratio when both produce the same tokens, as greedy does).
per_position_acceptance[d-1]: fraction of steps that accepted at least d draft tokens.
Greedy runs also give same_output (the fraction of prompt turns whose output equals plain
decoding's) and matched_fraction (the tokens before the first difference over all tokens). The
table labels that column by the run's dtype: only float32 decoding is exact (bf16 and fp16 logits
depend on how many tokens a pass feeds), so a low share in bf16 is rounding, not a lossy engine.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from draftsmith.eval.measure import BASELINE, Run, runs_to_dicts


def _pool(runs: list[Run]) -> dict:
    tokens = sum(r.new_tokens for r in runs)
    decoded = sum(max(r.new_tokens - 1, 0) for r in runs)
    steps = sum(r.steps for r in runs)
    seconds = sum(r.seconds for r in runs)
    stats = {
        "acceptance_length": decoded / steps if steps else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "new_tokens": tokens,
        "target_passes": steps,
        "seconds": seconds,
        "num_prompts": len({(r.prompt_id, r.turn) for r in runs}),
    }
    compared = [r for r in runs if r.same_output is not None]
    if compared:
        stats["same_output"] = sum(r.same_output for r in compared) / len(compared)
        stats["matched_fraction"] = sum(r.common_prefix for r in compared) / max(sum(r.new_tokens for r in compared), 1)
    return stats


def summarise(runs: list[Run], meta: dict | None = None) -> dict:
    """Per-method metrics, overall and per category, with speedups against the baseline."""
    by_method: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_method[run.method].append(run)
    baseline = _pool(by_method[BASELINE]) if BASELINE in by_method else None
    categories = sorted({r.category for r in runs})
    methods = {}
    for method, items in by_method.items():
        stats = _pool(items)
        base_tps = baseline["tokens_per_second"] if baseline else 0.0
        stats["baseline_tokens_per_second"] = base_tps
        stats["speedup"] = stats["tokens_per_second"] / base_tps if base_tps else None
        depth = max((a for r in items for a in r.accepted), default=1) - 1
        steps = [a for r in items for a in r.accepted]
        stats["per_position_acceptance"] = (
            [sum(a - 1 >= d for a in steps) / len(steps) for d in range(1, depth + 1)] if steps else []
        )
        stats["accepted_per_step_histogram"] = {str(k): steps.count(k) for k in sorted(set(steps))}
        drafted = [n for r in items for n in r.drafted]
        if drafted:  # what a draft-length policy chose: nodes verified per step, steps drafted at all
            stats["mean_tree_nodes"] = sum(drafted) / len(drafted)
            stats["drafted_steps"] = sum(n > 0 for n in drafted) / len(drafted)
        stats["per_category"] = {}
        for category in categories:
            cat = [r for r in items if r.category == category]
            base_cat = [r for r in by_method.get(BASELINE, []) if r.category == category]
            if not cat:
                continue
            entry = _pool(cat)
            base_entry = _pool(base_cat) if base_cat else None
            entry["speedup"] = (
                entry["tokens_per_second"] / base_entry["tokens_per_second"]
                if base_entry and base_entry["tokens_per_second"]
                else None
            )
            stats["per_category"][category] = entry
        methods[method] = stats
    return {"meta": meta or {}, "methods": methods, "categories": categories}


# Greedy speculative output equals plain greedy output token for token only where a pass over k
# tokens gives the same logits as k one-token passes: float32 here, not bf16/fp16 (design notes).
EXACT_DTYPES = ("float32", "float64")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


def same_output_column(summary: dict) -> tuple[str, str] | None:
    """The same-output column's header and the footnote printed under the table, both saying what
    the column measures at the run's dtype (``summary["meta"]["dtype"]``); None for sampled runs."""
    if not any("same_output" in s for s in summary["methods"].values()):
        return None
    dtype = summary.get("meta", {}).get("dtype")
    if dtype is None:  # runs summarised without their meta: no claim about exactness
        return "same output", (
            "same output: share of prompts whose greedy output equals plain decoding's token for token "
            "(exact only in float32)."
        )
    if dtype in EXACT_DTYPES:
        return "same output", (
            "same output: share of prompts whose greedy output equals plain decoding's token for token; "
            f"in {dtype} the engine is exact, so a method verified by the plain target reads 100%."
        )
    short = SHORT_DTYPE.get(dtype, dtype)
    return f"same as plain ({short}, drift expected)", (
        f"same as plain ({short}, drift expected): share of prompts whose greedy output equals plain "
        "decoding's, and in brackets the share of tokens before the first difference. In "
        f"{dtype} a pass over several tokens rounds otherwise than one-token passes, so near-tied "
        "argmaxes flip and outputs part after a few dozen tokens: rounding, not a lossy engine "
        "(with --dtype float32 every greedy output is identical to plain decoding's)."
    )


def _same_output_cell(stats: dict, exact: bool) -> str:
    if "same_output" not in stats:
        return "-"
    if exact:
        return f"{stats['same_output']:.0%}"
    return f"{stats['same_output']:.0%} ({stats['matched_fraction']:.0%} of tokens)"


def markdown_table(summary: dict) -> str:
    """Rows: methods; columns: acceptance length, tokens/s, speedup, then tau/speedup per category;
    under a greedy run's table, the footnote saying what its same-output column measures."""
    categories = summary["categories"] if len(summary["categories"]) > 1 else []
    same = same_output_column(summary)
    greedy = same is not None
    exact = summary.get("meta", {}).get("dtype") in (None, *EXACT_DTYPES)
    predicted = any("predicted_speedup" in s for s in summary["methods"].values())
    head = (
        ["method", "accept len", "tok/s", "speedup"]
        + (["predicted"] if predicted else [])
        + ["nodes / step", "drafted steps"]
        + ([same[0]] if greedy else [])
        + [f"{c} (tau / x)" for c in categories]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for method, s in summary["methods"].items():
        speed = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        cells = [method, f"{s['acceptance_length']:.2f}", f"{s['tokens_per_second']:.1f}", speed]
        if predicted:
            cells.append(f"{s['predicted_speedup']:.2f}x" if "predicted_speedup" in s else "-")
        cells += [f"{s['mean_tree_nodes']:.1f}", f"{s['drafted_steps']:.0%}"] if "mean_tree_nodes" in s else ["-", "-"]
        if greedy:
            cells.append(_same_output_cell(s, exact))
        for c in categories:
            e = s["per_category"].get(c)
            cells.append(f"{e['acceptance_length']:.2f} / {e['speedup']:.2f}x" if e and e["speedup"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if greedy:  # after a blank line: a text line right under a Markdown table is read as a row
        lines += ["", same[1]]
    return "\n".join(lines)


def depth_table(summary: dict, depths: int = 6) -> str:
    """Share of steps that accepted at least d draft tokens, d = 1..``depths``, per drafting method
    (the table EAGLE papers report; empty when no method drafted)."""
    rows = [(m, s["per_position_acceptance"]) for m, s in summary["methods"].items() if m != BASELINE]
    if not rows:
        return ""
    head = ["method"] + [f"P(>={d})" for d in range(1, depths + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for method, shares in rows:
        cells = [f"{shares[d]:.2f}" if d < len(shares) else "0.00" for d in range(depths)]
        lines.append("| " + " | ".join([method] + cells) + " |")
    return "\n".join(lines)


def captions(summary: dict) -> list[str]:
    """One line per method slower than the baseline, saying why from its own measurements: the
    tokens it gains per target pass against what one of its steps costs in plain decoding steps
    (tau / speedup, prefill included), which is the acceptance length it needs to break even."""
    lines = []
    for method, s in summary["methods"].items():
        speedup, tau = s.get("speedup"), s["acceptance_length"]
        if method == BASELINE or speedup is None or speedup >= 1.0 or not tau:
            continue
        cost = tau / speedup
        lines.append(
            f"{method} is slower than plain decoding here ({speedup:.2f}x): it produced {tau:.2f} tokens per "
            f"target pass, but one of its steps (drafting plus verifying the draft) took as long as "
            f"{cost:.2f} plain decoding steps on this device, so it needs an acceptance length above "
            f"{cost:.2f} to pay off."
        )
    return lines


def write_results(runs: list[Run], out_dir: str | Path, meta: dict | None = None, summary: dict | None = None) -> dict:
    """Write results.json (summary + every run), results.csv, table.md and PNG plots; return the
    summary (``summary``: one already made from ``runs``, e.g. with cost-model predictions added)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary if summary is not None else summarise(runs, meta)
    (out / "results.json").write_text(json.dumps({**summary, "runs": runs_to_dicts(runs)}, indent=1))
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "method",
                "category",
                "acceptance_length",
                "tokens_per_second",
                "speedup",
                "new_tokens",
                "target_passes",
                "seconds",
                "num_prompts",
            ]
        )
        for method, s in summary["methods"].items():
            for category, e in [("all", s)] + list(s["per_category"].items()):
                writer.writerow(
                    [
                        method,
                        category,
                        round(e["acceptance_length"], 4),
                        round(e["tokens_per_second"], 3),
                        round(e["speedup"], 4) if e["speedup"] is not None else "",
                        e["new_tokens"],
                        e["target_passes"],
                        round(e["seconds"], 3),
                        e["num_prompts"],
                    ]
                )
    (out / "table.md").write_text(
        "\n".join([markdown_table(summary), "", depth_table(summary), "", *captions(summary)]).rstrip() + "\n"
    )
    _plots(summary, out)
    return summary


def _plots(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in summary["methods"] if m != BASELINE]
    categories = summary["categories"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) + 2), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [summary["methods"][method]["per_category"].get(c, {}).get("acceptance_length", 0) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.set_xticks(
        [x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30, ha="right"
    )
    ax.set_ylabel("acceptance length (tokens / target pass)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_category.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        hist = summary["methods"][method]["accepted_per_step_histogram"]
        total = sum(hist.values()) or 1
        ax.plot([int(k) for k in hist], [v / total for v in hist.values()], marker="o", label=method)
    ax.set_xlabel("tokens accepted per step (incl. the target's own)")
    ax.set_ylabel("fraction of steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accepted_per_step.png", dpi=120)
    plt.close(fig)
