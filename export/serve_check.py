"""The export gate: serve an exported drafter in vLLM and compare it with draftsmith's own engine.

``draftsmith-serve-check DIR --engine vllm [--prompts FILE] [--limit N]`` (and
``draftsmith-export ... --check vllm``) decodes the same prompts, greedily, one request at a time,
four ways: vLLM plain, vLLM with the exported drafter, draftsmith plain, and draftsmith with the
*training checkpoint the export came from*, drafting a chain of the export's depth. A converter
that drops, permutes or mislabels weights leaves draftsmith's figures unchanged and moves vLLM's,
so the gate compares, per draft position, the drafts vLLM accepted with ours, as counts
(:mod:`draftsmith.export.gate_stats` gives the verdict: passed, failed or inconclusive), and checks
that vLLM's speculative output is token-identical to its plain output. It writes
``DIR/serve_check.json`` and ``DIR/serve_check.md`` and exits 0 when it passes, 1 when it fails,
3 when the counts cannot tell the export from a broken one, and 2 on bad input.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.errors import ArgumentParser, CheckpointError, UsageError, at_least, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import DrafterSpec, build_drafter
from draftsmith.eval.engine.sampling import SamplingConfig
from draftsmith.export.common import EXPORT_SIDECAR
from draftsmith.export.gate_stats import ALPHA, FAILED, INCONCLUSIVE, PASSED, PositionCounts, judge, overall
from draftsmith.heads.exported import EXPORT_KEY
from draftsmith.kinds import Served, get
from draftsmith.target import eos_token_ids, load_tokenizer
from draftsmith.vllm_engine import EngineError, engine_args, run_job, vllm_version

DEFAULT_LIMIT = 8  # MT-bench: the first question of each category
DEFAULT_MAX_NEW_TOKENS = 128
REPORT = "serve_check.json"
TABLE = "serve_check.md"
ENGINES = ("vllm",)
EXIT_CODES = {PASSED: 0, FAILED: 1, INCONCLUSIVE: 3}  # 2: bad input (draftsmith.errors)


@dataclass
class CheckResult:
    """``serve_check.json``."""

    verdict: str  # passed, failed or inconclusive (draftsmith.export.gate_stats)
    passed: bool
    engine: str
    version: str
    num_speculative_tokens: int
    # per draft position: drafts and accepted drafts in each engine, rates, margin, Fisher p-value, verdict
    positions: list[dict]
    same_output: bool  # vLLM's speculative output equals its plain output on every prompt
    vllm_tok_s: float
    vllm_plain_tok_s: float
    ours_tok_s: float
    ours_plain_tok_s: float
    vllm_acceptance_length: float
    ours_acceptance_length: float
    same_as_ours: float  # share of prompts where vLLM's plain output equals draftsmith's plain output
    prompts: int
    max_new_tokens: int
    alpha: float = ALPHA
    reasons: list[str] = field(default_factory=list)  # why it did not pass, one line each
    export: str = ""
    source: str = ""
    target: str = ""


def export_metadata(folder: Path) -> dict:
    """draftsmith's record of an export (format, kind, source checkpoint, target folder, depth)."""
    config_file, sidecar = folder / "config.json", folder / EXPORT_SIDECAR
    if sidecar.is_file():
        return json.loads(sidecar.read_text())
    if config_file.is_file():
        block = json.loads(config_file.read_text()).get(EXPORT_KEY)
        if block:
            return block
    raise CheckpointError(
        f"{folder} is not a draftsmith export (no {EXPORT_SIDECAR} and no '{EXPORT_KEY}' in "
        "config.json); export a training checkpoint with draftsmith-export first"
    )


def served_as(meta: dict, folder: Path, draft_tokens: int | None) -> Served:
    """How vLLM serves this export (its kind's declaration says), or a one-line refusal saying why
    it cannot and what to use. The depth is ``draft_tokens``, else the export's own, at most what
    the checkpoint drafts (``DrafterKind.max_depth``)."""
    fmt = meta.get("format")
    kind = get(meta.get("kind"), f"{folder}: kind")
    depth = draft_tokens or meta.get("num_speculative_tokens") or 3
    if kind.max_depth is not None:
        most = kind.max_depth(meta["config"])
        if draft_tokens is not None and depth > most:
            raise UsageError(f"--draft-tokens {depth}: this {kind.name} drafter drafts at most {most} tokens per step")
        depth = min(depth, most)
    served = kind.serve(fmt, folder, depth) if kind.serve else None
    if served is None:
        raise UsageError(f"{folder}: vLLM serves no {fmt!r} export of {kind.name} drafters")
    return served


def speculative_config(served: Served, folder: str | Path) -> dict:
    """vLLM's ``speculative_config`` for the export in ``folder``, served as ``served``."""
    return {
        "method": served.method,
        "model": str(folder),
        "num_speculative_tokens": served.num_speculative_tokens,
        **({"parallel_drafting": True} if served.parallel_drafting else {}),
    }


def _our_spec(kind: str, source: str, depth: int) -> DrafterSpec:
    """The drafter spec that makes draftsmith draft the chain vLLM drafts: ``depth`` tokens, top-1 each."""
    return DrafterSpec(kind, source, get(kind).chain(depth), "ours")


def position_counts(
    accepted_per_step: list[list[int]], drafted_per_step: list[list[int]], depth: int
) -> tuple[list[int], list[int]]:
    """Per draft position, the drafts reaching that position and those accepted that far (as vLLM's
    ``num_accepted_tokens_per_pos`` and ``num_drafts`` count them); ``accepted`` counts the target's
    bonus token. A chain shorter than ``depth`` counts at the positions it reached only."""
    hits, drafts = [0] * depth, [0] * depth
    for accepted, drafted in zip(accepted_per_step, drafted_per_step):
        for tokens, nodes in zip(accepted, drafted):
            for position in range(min(nodes, depth)):
                drafts[position] += 1
                hits[position] += tokens - 1 > position
    return hits, drafts


def steps_started_before(accepted: list[int], limit: int) -> int:
    """How many of a generation's steps began with fewer than ``limit`` new tokens out (the first
    comes from the prompt's pass; step i adds ``accepted[i]``): the steps an engine capped at
    ``limit`` new tokens runs."""
    out = 1
    for step, tokens in enumerate(accepted):
        if out >= limit:
            return step
        out += tokens
    return len(accepted)


def _ours(target_folder: str, spec, prompts: list[list[int]], max_new_tokens: int, depth: int) -> dict:
    """draftsmith's engine, plain and with the drafter, fp32 on the first accelerator (or CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).to(device).eval()
    tokenizer = load_tokenizer(target_folder)
    eos = eos_token_ids(target, tokenizer)
    drafter = build_drafter(spec, target)
    plain = SpeculativeDecoder(target, None, tokenizer, SamplingConfig(), eos)
    speculative = SpeculativeDecoder(target, drafter, tokenizer, SamplingConfig(), eos)
    for decoder in (plain, speculative):  # first calls pay one-off allocation costs
        decoder.generate(prompts[0], 8)
    result = {"plain": [], "spec": [], "accepted": [], "drafted": [], "plain_s": 0.0, "spec_s": 0.0, "eos": sorted(eos)}
    for ids in prompts:
        base = plain.generate(ids, max_new_tokens)
        # vLLM starts a step while fewer than max_new_tokens tokens are out and drafts its full depth
        # even then (verifying past the limit, then cutting the output); our engine caps a draft at
        # the budget. So we decode `depth` tokens further and count the steps vLLM would run: its
        # last steps' drafts (all counted) alone moved a position's rate by the gate's margin.
        gen = speculative.generate(ids, max_new_tokens + depth)
        steps = steps_started_before(gen.accepted, max_new_tokens)
        result["plain"].append(base.tokens)
        result["spec"].append(gen.tokens)
        result["accepted"].append(gen.accepted[:steps])
        result["drafted"].append(gen.drafted[:steps])
        result["plain_s"] += base.prefill_seconds + base.decode_seconds
        result["spec_s"] += gen.prefill_seconds + gen.decode_seconds
    result["hits"], result["drafts"] = position_counts(result["accepted"], result["drafted"], depth)
    steps = sum(len(a) for a in result["accepted"])
    result["tau"] = sum(map(sum, result["accepted"])) / steps if steps else 0.0
    return result


def prompt_ids(
    target_folder: str, prompts: str | None, limit: int | None, per_category: int | None = None
) -> list[list[int]]:
    """The first turns of ``prompts`` (a JSONL file; default MT-bench, one per category), rendered
    with the target's chat template: the first ``per_category`` of each category, then ``limit``."""
    tokenizer = load_tokenizer(target_folder)
    if prompts:
        chosen = load_prompts(prompts, limit or (None if per_category else DEFAULT_LIMIT), per_category)
    else:
        chosen = load_prompts(MT_BENCH, limit, per_category=per_category or (None if limit else 1))
    if not chosen:
        raise UsageError(f"{prompts or MT_BENCH}: no prompts to check with")
    return [render_prompt(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in chosen]


_PLAIN_RUNS: dict[str, dict] = {}


def _plain_vllm(job: dict, what: str) -> dict:
    """vLLM's plain decoding of ``job``, run once per process: checks of several exports of one
    target on the same prompts share it."""
    key = json.dumps(job, sort_keys=True)
    if key not in _PLAIN_RUNS:
        _PLAIN_RUNS[key] = run_job(job, what)
    return _PLAIN_RUNS[key]


def _tok_s(outputs: list[list[int]], seconds: float) -> float:
    return sum(map(len, outputs)) / seconds if seconds else 0.0


def serve_check(
    folder: str | Path,
    engine: str = "vllm",
    prompts: str | None = None,
    limit: int | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    source: str | Path | None = None,
    draft_tokens: int | None = None,
) -> CheckResult:
    """Serve the export in ``folder`` with ``engine`` and compare it with draftsmith's engine; writes
    ``serve_check.json`` and ``serve_check.md`` into ``folder`` and returns the result.

    ``source``: the training checkpoint the export came from (default: the one the export records).
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: choose from {', '.join(ENGINES)}")
    folder = Path(folder).expanduser().resolve()
    meta = export_metadata(folder)
    served = served_as(meta, folder, draft_tokens)
    source = Path(source or meta.get("source", ""))
    if not (source / "config.json").is_file():
        raise UsageError(
            f"{folder}: the training checkpoint it was exported from ({source}) is not here; the gate "
            "compares the export with it: give it with --source DIR"
        )
    target = meta.get("target_folder")
    if not target or not (Path(target) / "config.json").is_file():
        raise UsageError(f"{folder}: its target's local folder ({target}) is not here; re-export with --target DIR")
    depth = served.num_speculative_tokens
    ids = prompt_ids(target, prompts, limit)
    ours = _ours(target, _our_spec(meta["kind"], str(source), depth), ids, max_new_tokens, depth)
    job = {"task": "generate", "prompts": ids, "max_new_tokens": max_new_tokens, "stop_token_ids": ours["eos"]}
    plain = _plain_vllm({**job, "engine": engine_args(target)}, f"vLLM plain decoding of {target}")
    reasons: list[str] = []
    spec_config = speculative_config(served, folder)
    try:
        spec = run_job({**job, "engine": engine_args(target, speculative_config=spec_config)}, f"vLLM serving {folder}")
    except EngineError as err:  # the export does not load: the gate's purpose is to say so
        reasons.append(f"vLLM could not serve the export: {err}")
        spec = {
            "outputs": [{"tokens": []} for _ in ids],
            "seconds": 0.0,
            "spec": {"num_drafts": 0, "per_position": [0] * depth, "num_draft_tokens": 0, "num_accepted_tokens": 0},
        }
    vllm_plain = [o["tokens"] for o in plain["outputs"]]
    vllm_spec = [o["tokens"] for o in spec["outputs"]]
    drafts = spec["spec"]["num_drafts"]
    vllm_hits = (spec["spec"]["per_position"] + [0] * depth)[:depth]
    counts = [PositionCounts(drafts, v, n, o) for v, n, o in zip(vllm_hits, ours["drafts"], ours["hits"])]
    positions = [judge(c) for c in counts]
    verdict, why = overall(positions, counts[0], len(ids))
    same_output = vllm_spec == vllm_plain
    if not same_output:
        differ = sum(a != b for a, b in zip(vllm_spec, vllm_plain))
        reasons.append(f"vLLM's speculative output differs from its plain output on {differ} of {len(ids)} prompts")
    reasons += why
    if len(reasons) > len(why):  # the export did not load, or changed vLLM's output
        verdict = FAILED
    result = CheckResult(
        verdict=verdict,
        passed=verdict == PASSED,
        engine=engine,
        version=plain.get("version") or vllm_version() or "?",
        num_speculative_tokens=depth,
        positions=[p.as_dict() for p in positions],
        same_output=same_output,
        vllm_tok_s=_tok_s(vllm_spec, spec["seconds"]),
        vllm_plain_tok_s=_tok_s(vllm_plain, plain["seconds"]),
        ours_tok_s=_tok_s(ours["spec"], ours["spec_s"]),
        ours_plain_tok_s=_tok_s(ours["plain"], ours["plain_s"]),
        vllm_acceptance_length=1 + spec["spec"]["num_accepted_tokens"] / drafts if drafts else 1.0,
        ours_acceptance_length=ours["tau"],
        same_as_ours=sum(a == b for a, b in zip(vllm_plain, ours["plain"])) / len(ids),
        prompts=len(ids),
        max_new_tokens=max_new_tokens,
        reasons=reasons,
        export=str(folder),
        source=str(source.resolve()),
        target=str(target),
    )
    (folder / REPORT).write_text(json.dumps(asdict(result), indent=1))
    (folder / TABLE).write_text(table(result) + "\n")
    return result


def table(result: CheckResult) -> str:
    """The gate's result as a Markdown table (per-position acceptance, then throughput)."""
    lines = [
        f"serve check ({result.engine} {result.version}, {result.prompts} prompts x {result.max_new_tokens} "
        f"new tokens, greedy, chain of {result.num_speculative_tokens}): "
        f"{result.verdict.upper()}",
        "",
        "| draft position | vLLM accepted / drafts | draftsmith accepted / drafts | difference | margin | Fisher p "
        "| verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, pos in enumerate(result.positions, start=1):
        lines.append(
            f"| {k} | {pos['vllm_accepted']} / {pos['vllm_drafts']} ({pos['vllm']:.3f}) | {pos['ours_accepted']} / "
            f"{pos['ours_drafts']} ({pos['ours']:.3f}) | {pos['vllm'] - pos['ours']:+.3f} | {pos['margin']:.3f} | "
            f"{pos['p_value']:.2g} | {pos['verdict']} |"
        )
    lines += [
        "",
        "| engine | acceptance length | tok/s with drafter | tok/s plain | speedup |",
        "|---|---|---|---|---|",
        f"| vLLM | {result.vllm_acceptance_length:.2f} | {result.vllm_tok_s:.1f} | {result.vllm_plain_tok_s:.1f} | "
        f"{result.vllm_tok_s / result.vllm_plain_tok_s if result.vllm_plain_tok_s else 0:.2f}x |",
        f"| draftsmith | {result.ours_acceptance_length:.2f} | {result.ours_tok_s:.1f} | "
        f"{result.ours_plain_tok_s:.1f} | "
        f"{result.ours_tok_s / result.ours_plain_tok_s if result.ours_plain_tok_s else 0:.2f}x |",
        "",
        f"vLLM's speculative output equals its plain output: {'yes' if result.same_output else 'NO'}; "
        f"vLLM's plain output equals draftsmith's on {result.same_as_ours:.0%} of prompts.",
    ]
    lines += [f"- {reason}" for reason in result.reasons]
    return "\n".join(lines)


def add_check_arguments(parser: ArgumentParser, prefix: str = "") -> None:
    """The gate's options (``--prompts``/``--limit``, or ``--check-prompts``/``--check-limit`` on the export CLI)."""
    parser.add_argument(
        f"--{prefix}prompts",
        default=None,
        help="JSONL prompt set ('turns' list or 'prompt' string per line; default: MT-bench)",
    )
    parser.add_argument(
        f"--{prefix}limit",
        type=at_least(1),
        default=None,
        help=f"first N prompts (default: {DEFAULT_LIMIT}, MT-bench's first question per category)",
    )
    parser.add_argument(f"--{prefix}max-new-tokens", type=at_least(1), default=DEFAULT_MAX_NEW_TOKENS)


def report(result: CheckResult) -> None:
    """Print the table; exit 1 when the check failed, 3 when it was inconclusive (:data:`EXIT_CODES`)."""
    print(table(result))
    print(f"\nwrote {Path(result.export) / REPORT} and {TABLE}")
    if result.verdict != PASSED:
        sys.exit(EXIT_CODES[result.verdict])


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="draftsmith-serve-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="an exported folder (draftsmith-export --out DIR)")
    parser.add_argument("--engine", default="vllm", choices=ENGINES)
    add_check_arguments(parser)
    parser.add_argument(
        "--source", default=None, help="the training checkpoint the export came from (default: the one it records)"
    )
    parser.add_argument(
        "--draft-tokens", type=at_least(1), default=None, help="tokens drafted per step (default: the export's own)"
    )
    args = parser.parse_args(argv)
    report(
        serve_check(
            args.export, args.engine, args.prompts, args.limit, args.max_new_tokens, args.source, args.draft_tokens
        )
    )


if __name__ == "__main__":
    main()
