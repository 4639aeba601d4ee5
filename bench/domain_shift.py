"""The domain-shift benchmark of issue 43: a head trained without code serves code and learns from it.

    python bench/domain_shift.py split --out runs/domain          # the data below, from the bundled files
    python train/eagle3.py recipes/smollm2-eagle3-general.yaml     # the deployed head: ShareGPT without code
    # the stream, served by the frozen head with its traffic captured (--adapt-steps 0: no learning) ...
    python eval/run.py --prompts runs/domain/stream.jsonl --drafter eagle3:HEAD --adapt 16 --adapt-steps 0 \\
        --capture runs/domain/traffic --max-new-tokens 96 --out results/domain-frozen
    # ... and by a head that learns every 16 requests (the online curve)
    python eval/run.py --prompts runs/domain/stream.jsonl --drafter eagle3:HEAD --adapt 16 --max-new-tokens 96 \\
        --out results/domain-online
    # rounds on the captured traffic: train, judge, publish runs/domain/adapt/current
    draftsmith-adapt recipes/smollm2-adapt.yaml --rounds 2
    # judged on held-out code and the MT-bench coding questions
    python eval/run.py --prompts runs/domain/code-held-out.jsonl --drafter prompt_lookup --drafter suffix \\
        --drafter eagle3:HEAD?name=frozen --drafter eagle3:runs/domain/adapt/current/checkpoint?name=adapted \\
        --drafter "hybrid:eagle3:HEAD+suffix?name=hybrid-frozen" \\
        --drafter "hybrid:eagle3:runs/domain/adapt/current/checkpoint+suffix?name=hybrid-adapted"

``split`` writes: ``general.jsonl`` (every bundled ShareGPT conversation without code in a reply,
:func:`~draftsmith.data_prep.domains.has_code`), ``code.jsonl`` (the others), ``stream.jsonl`` (the
first user turns of ``--stream`` code conversations of at most ``--max-chars``, in a fixed shuffled
order), ``code-held-out.jsonl`` (``--held-out`` more, never in the stream) and
``mt-bench-coding.jsonl`` (MT-bench's coding questions).

``rejected`` runs issue 56's measurement in one process, every head judged with one drafter
configuration (vLLM's chain of 3, the judge's default) and greedy decoding:

    python bench/domain_shift.py rejected --head runs/objectives/kl_div/checkpoint-final --out runs/domain56

1. the stream (the split above, leaving out the conversations the head trained on) is served by the
   frozen head and captured with what it drafted (``runs/domain56/traffic``);
2. one ``draftsmith-adapt`` round per weighting on that same traffic with the same seed: uniform
   (``adapt.rejected_weight: 1``) and rejected-weighted (``--weight``; ``--weight 1``: the uniform round
   alone), each judged by the honest judge on the stream's newest conversations (its verdict recorded);
   the challengers are kept, promoted or not;
3. the frozen head and both challengers decode the unseen held-out prompts of the domain
   (``code-held-out.jsonl``); each gain's two-sided 95% paired bootstrap interval over the prompts.

``rounds`` replays a ``rejected`` run's captured stream as a deployment meets it, a round after each
of ``--rounds`` equal slices (each trained from the head then serving, on all traffic so far, and
judged on the slice's newest conversations), then decodes the same unseen prompts with the frozen head,
the head serving after each round and the one round trained on the whole stream (``OUT/rounds.json``):

    python bench/domain_shift.py rounds --source runs/domain56-xxl --out runs/domain56-rounds --rounds 2

By default the head is deployed on the float32 target (``--dtype``: a copy of its checkpoint whose recipe
says so, its weights unchanged; rounds train without bf16 autocast) with one torch thread (``--threads``):
on a busy 2-core CPU, bf16 and 2 threads drafted 5x slower. Both rounds judge the frozen head on the same
requests, which is decoded once. Run again, it reads back the stream and the rounds it finished (their
challengers kept) and goes on. Writes ``OUT/rejected.json`` and prints a Markdown table. Acceptance
lengths are counts: a busy CPU slows the run, it does not bias them.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import yaml

import draftsmith.adapt.judge as judge_module
from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.judge import acceptance_counts, paired_gain
from draftsmith.adapt.rounds import Adapter, adaptable_kind, round_folder
from draftsmith.config import load_recipe
from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.domains import has_code, write_jsonl
from draftsmith.data_prep.features import FeatureDataset
from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.data_prep.traffic import ACCEPTED, REJECTED, SERVED_DRAFT, TrafficStore, shard_files
from draftsmith.errors import ArgumentParser, at_least, report_user_errors
from draftsmith.eval.engine.decode import SpeculativeDecoder
from draftsmith.eval.engine.drafters import build_drafter, parse_spec
from draftsmith.target import load_target
from draftsmith.timing import clock


def _first_turn(conversation: dict) -> str:
    return next(m["content"] for m in conversation["messages"] if m["role"] == "user")


def _prompts(conversations: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for c in conversations:
            record = {"id": c["id"], "prompt": _first_turn(c), "category": "code"}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def split(out: Path, stream: int, held_out: int, seed: int, max_chars: int, exclude: frozenset = frozenset()) -> None:
    """Write the benchmark's data files under ``out`` (see the module docstring); conversations whose
    id is in ``exclude`` (a head's training data) are in neither the stream nor the held-out prompts."""
    conversations, _ = load_conversations(verbose=False)
    code = [c for c in conversations if has_code(c) and c["id"] not in exclude]
    general = [c for c in conversations if not has_code(c)]
    write_jsonl(general, out / "general.jsonl")
    write_jsonl(code, out / "code.jsonl")
    # Requests of at most `max_chars` of prompt: on a 2-core CPU a few pasted files would take most of the stream.
    order = [c for c in random.Random(seed).sample(code, len(code)) if len(_first_turn(c)) <= max_chars]
    _prompts(order[:stream], out / "stream.jsonl")
    _prompts(order[stream : stream + held_out], out / "code-held-out.jsonl")
    with (out / "mt-bench-coding.jsonl").open("w", encoding="utf-8") as handle:
        for p in load_prompts(MT_BENCH):
            if p.category == "coding":
                handle.write(json.dumps({"id": p.id, "turns": p.turns, "category": p.category}) + "\n")
    print(f"{out}: {len(general)} general and {len(code)} code conversations; stream {stream}, held-out {held_out}")


JUDGE = AdaptConfig.judge_drafter  # vLLM's chain of 3: how the stream is served and every head judged
INTERVAL = 0.975  # one side of a two-sided 95% interval


class KeepingAdapter(Adapter):
    """An :class:`Adapter` that also copies each round's challenger to ``keep`` (promoted or not)."""

    def __init__(self, cfg: AdaptConfig, keep: Path):
        super().__init__(cfg)
        self.keep = keep

    def _train(self, serving, train_rows, eval_rows, output_dir):
        head, trainer = super()._train(serving, train_rows, eval_rows, output_dir)
        shutil.rmtree(self.keep, ignore_errors=True)
        shutil.copytree(trainer.last_checkpoint, self.keep)
        return head, trainer


def _read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def _prompt_ids(tokenizer, path: Path) -> list[list[int]]:
    """The prompts of a ``split`` file as the target reads them (one user turn, the chat template's)."""
    return [render_prompt(tokenizer, [{"role": "user", "content": p}]) for p in _read_prompts(path)]


def _trained_on(recipe) -> frozenset:
    """Ids of the bundled ShareGPT conversations a head's recipe trained on (none for other data)."""
    if recipe.data.path != "sharegpt":
        return frozenset()
    conversations, _ = load_conversations(limit=recipe.data.limit, verbose=False)
    return frozenset(c["id"] for c in conversations)


def _capture_stream(target, tokenizer, recipe, head: str, prompts: list[list[int]], root: Path, tokens: int) -> dict:
    """Serve ``prompts`` with the frozen ``head`` (a chain of 3), capturing them and its draft outcomes."""
    drafter = build_drafter(parse_spec(f"eagle3:{head}?{JUDGE}"), target)
    store = TrafficStore.for_target(
        root, target, tokenizer, recipe.target.name, drafter.feature_layers, recipe.data.features.storage_dtype
    )
    decoder = SpeculativeDecoder(target, drafter, tokenizer, capture=store)
    produced = passes = 0
    began = clock(target.device)
    for prompt in prompts:
        gen = decoder.generate(prompt, tokens)
        produced, passes = produced + sum(gen.accepted), passes + gen.steps
    store.close()  # the rounds read it next
    data = FeatureDataset(root / "train")
    outcomes = [
        o for row, (_, mask) in zip(data.per_token(SERVED_DRAFT), data.token_rows()) for o, m in zip(row, mask) if m
    ]
    return {
        "requests": len(prompts),
        "tau": round(produced / max(passes, 1), 4),
        "seconds": round(clock(target.device) - began, 1),
        "reply_tokens": len(outcomes),
        "accepted": outcomes.count(ACCEPTED),
        "rejected": outcomes.count(REJECTED),
    }


def _interval(base: list[tuple[int, int]], other: list[tuple[int, int]]) -> dict:
    tau_a, tau_b, gain, low = paired_gain(base, other, INTERVAL)
    high = paired_gain(base, other, 1 - INTERVAL)[3]
    return {
        "tau_base": round(tau_a, 4),
        "tau_other": round(tau_b, 4),
        "gain": round(gain, 4),
        "low": round(low, 4),
        "high": round(high, 4),
    }


def _deployed(head: str, out: Path, dtype: str | None) -> str:
    """The head to deploy: ``head`` itself, or (``dtype``) a copy whose recipe serves and adapts it on
    the target in that dtype (its weights unchanged; float32: rounds train without bf16 autocast)."""
    if not dtype:
        return head
    copy = out / "head"
    if not copy.is_dir():
        shutil.copytree(head, copy)
        recipe = yaml.safe_load((copy / "recipe.yaml").read_text())
        recipe["target"]["dtype"] = dtype
        if dtype == "float32":
            recipe["training"]["mixed_precision"] = "no"  # bf16 autocast on a CPU: the slow path here
        (copy / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(copy)


def _judge_once() -> None:
    """Both rounds judge the same serving head on the same requests (greedy: the same counts): decode
    those once. Wraps the judge's :func:`~draftsmith.adapt.judge.acceptance_counts`."""
    seen: dict = {}

    def counts(target, spec, prompts, max_new_tokens):
        key = (spec, json.dumps(prompts), max_new_tokens)
        if key not in seen:
            seen[key] = original(target, spec, prompts, max_new_tokens)
        return seen[key]

    original = judge_module.acceptance_counts
    judge_module.acceptance_counts = counts


def _reuse_general(extracted: Path, out_dir: Path) -> None:
    """Start ``out_dir`` (an adapter's) with the replay and forgetting rows already ``extracted`` for
    another adapter of the same flags (the same rows), instead of extracting them again."""
    if extracted.is_dir() and not (out_dir / "general").exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(extracted, out_dir / "general")


def _adapt_config(args, traffic: Path, out_dir: Path, weight: float = 1.0) -> AdaptConfig:
    """The rounds' recipe from the bench's flags (its exports skipped: the bench decodes checkpoints)."""
    cfg = AdaptConfig(
        head=args.head,
        traffic=str(traffic),
        out_dir=str(out_dir),
        replay_limit=args.replay_limit,
        replay_fraction=args.replay_fraction,
        held_out=args.judged,
        min_held_out=min(8, args.judged),
        general_held_out=args.general_held_out,
        round_steps=args.steps,
        learning_rate=args.lr,
        max_length=args.max_length,
        judge_max_new_tokens=args.max_new_tokens,
        export_format="none",
        seed=args.seed,
        rejected_weight=weight,
    )
    cfg.validate()
    return cfg


def _unseen(
    target, heads: dict[str, str], prompts: list[list[int]], tokens: int, record: dict, known: dict | None = None
) -> None:
    """Every head of ``heads`` (name: checkpoint) decodes the unseen ``prompts`` with the judge's
    drafter (greedy: deterministic, so a head whose counts ``known`` holds is not decoded again);
    each pair's gain with its 95% paired interval goes into ``record`` and is printed."""
    # By folder: a round that kept its serving head serves a folder decoded already.
    decoded = {heads[name]: c for name, c in (known or {}).items()}
    counts, seconds = {}, {}
    for name, folder in heads.items():
        if folder not in decoded:
            began = clock(target.device)
            decoded[folder] = acceptance_counts(target, f"eagle3:{folder}?{JUDGE}", prompts, tokens)
            seconds[name] = round(clock(target.device) - began, 1)
        counts[name] = decoded[folder]
    record["unseen"] = {"prompts": len(prompts), "counts": counts, "seconds": seconds}
    record["gains"] = {f"{b} vs {a}": _interval(counts[a], counts[b]) for a, b in itertools.combinations(heads, 2)}
    print("\n| heads | unseen prompts | tau base | tau other | gain | 95% paired bootstrap interval |")
    print("|---|---|---|---|---|---|")
    for pair, g in record["gains"].items():
        print(
            f"| {pair} | {len(prompts)} | {g['tau_base']:.3f} | {g['tau_other']:.3f} | {g['gain']:+.3f} | "
            f"[{g['low']:+.3f}, {g['high']:+.3f}] |"
        )


def rejected(args) -> dict:
    """Issue 56's measurement (see the module docstring); returns what it writes to ``OUT/rejected.json``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)  # a busy 2-core machine: 2 threads ran 2.6x slower than 1
    kind, _ = adaptable_kind(args.head, "--head")
    recipe = load_recipe(kind.training.recipe, Path(args.head) / "recipe.yaml")
    if not (out / "stream.jsonl").is_file():
        split(out, args.stream, args.held_out, args.seed, args.max_chars, _trained_on(recipe))
    args.head = _deployed(args.head, out, args.dtype)
    recipe = load_recipe(kind.training.recipe, Path(args.head) / "recipe.yaml")
    target, tokenizer = load_target(recipe.target.name, recipe.target.dtype, chat_template=recipe.target.chat_template)
    torch.manual_seed(args.seed)
    _judge_once()

    record: dict = {"argv": sys.argv, "head": args.head, "judge_drafter": JUDGE, "dtype": recipe.target.dtype}
    record.update(max_new_tokens=args.max_new_tokens, threads=args.threads)
    traffic = out / "traffic"
    if not (traffic / "train").is_dir():
        stream = _prompt_ids(tokenizer, out / "stream.jsonl")
        record["stream"] = _capture_stream(target, tokenizer, recipe, args.head, stream, traffic, args.max_new_tokens)
        print(f"stream: {record['stream']}")
    heads = {"frozen": args.head}
    record["rounds"] = {}
    for weight in dict.fromkeys((1.0, args.weight)):  # --weight 1: the uniform round alone
        name = "uniform" if weight == 1 else f"rejected x{weight:g}"
        cfg = _adapt_config(args, traffic, out / f"adapt-w{weight:g}", weight)
        _reuse_general(out / "adapt-w1" / "general", Path(cfg.out_dir))
        keep = out / f"challenger-w{weight:g}"
        state = Path(cfg.out_dir) / "state.json"
        if state.is_file() and (keep / "config.json").is_file():  # a rerun: the round ran, its challenger kept
            record["rounds"][name] = json.loads(state.read_text())["rounds"][0]
            heads[name] = str(keep)
            continue
        adapter = KeepingAdapter(cfg, keep)
        rounds = adapter.run(1)
        if not rounds:
            raise SystemExit(f"the {name} round did not run (see the line above)")
        record["rounds"][name] = rounds[0].record()
        heads[name] = str(keep)
        del adapter
    _unseen(target, heads, _prompt_ids(tokenizer, out / "code-held-out.jsonl"), args.max_new_tokens, record)
    (out / "rejected.json").write_text(json.dumps(record, indent=1))
    for name, r in record["rounds"].items():
        v = r["verdict"]
        print(
            f"{name} round: {'promoted' if v['promoted'] else 'kept out'}: {v['reason']}; forgetting "
            f"{v['forgetting']}; train {r['train_seconds']} s, judge {r['judge_seconds']} s"
        )
    return record


def rounds(args) -> dict:
    """Rounds one after another on the stream a ``rejected`` run captured (``--source``): the traffic
    arrives in ``--rounds`` equal slices, in the order it was served, and after each slice one round
    trains from the serving head on everything so far and is judged on that slice's newest
    conversations (a promoted head serves from then on). Then the frozen head, the head serving after
    each round and the source's one-round challenger decode the source's unseen prompts.

    The source's stream was served by the frozen head throughout, so each slice's draft record is the
    frozen head's, not that of the head serving it here: the uniform rounds this runs do not read it,
    and greedy verification makes the replies the target's whichever head drafts (in bf16 up to
    rounding: a reply may part from another drafter's after some tokens)."""
    source, out = Path(args.source), Path(args.out)
    torch.set_num_threads(args.threads)
    made = json.loads((source / "rejected.json").read_text())
    args.head = made["head"]
    traffic = out / "traffic"
    (traffic / "train").mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "traffic" / "identity.json", traffic / "identity.json")
    cfg = _adapt_config(args, traffic, out / "adapt")
    _reuse_general(source / "adapt-w1" / "general", out / "adapt")
    adapter = Adapter(cfg)  # reads the traffic afresh each round; its target decodes the unseen prompts too
    torch.manual_seed(args.seed)
    record: dict = {"argv": sys.argv, "source": str(source), "head": args.head, "judge_drafter": JUDGE, "rounds": []}
    heads, serving, shards = {"frozen": args.head}, args.head, shard_files(source / "traffic")
    for number in range(1, args.rounds + 1):
        for shard in shards[: len(shards) * number // args.rounds]:  # the slice arrives
            if not (traffic / "train" / shard.name).exists():
                os.link(shard, traffic / "train" / shard.name)
        done = adapter.history()[number - 1 : number] or [r.record() for r in adapter.run(1)]  # a rerun reads it
        if not done:
            raise SystemExit(f"round {number} did not run (see the line above)")
        record["rounds"].append(done[0])
        v = done[0]["verdict"]
        if v["promoted"]:
            serving = str(round_folder(cfg.out_dir, number) / "checkpoint")
        heads[f"serving after round {number}"] = serving
        print(f"round {number}: {'promoted' if v['promoted'] else 'kept out'}: {v['reason']}; {v['forgetting']}")
    adapter.release()
    heads["one round on all"] = str(source / "challenger-w1")
    known = {}  # the source decoded the frozen head and its one round on these prompts, the same way
    if made["max_new_tokens"] == args.max_new_tokens and made["judge_drafter"] == JUDGE:
        known = {"frozen": made["unseen"]["counts"]["frozen"], "one round on all": made["unseen"]["counts"]["uniform"]}
    prompts = _prompt_ids(adapter.tokenizer, source / "code-held-out.jsonl")
    _unseen(adapter.target, heads, prompts, args.max_new_tokens, record, known)
    (out / "rounds.json").write_text(json.dumps(record, indent=1))
    return record


def _round_flags(parser) -> None:
    """The flags of the rounds both commands run."""
    parser.add_argument(
        "--judged", type=at_least(2), default=12, help="the stream's newest conversations the round judges on"
    )
    parser.add_argument("--steps", type=at_least(1), default=40, help="optimiser steps per round")
    parser.add_argument("--lr", type=float, default=AdaptConfig.learning_rate)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--max-length", type=at_least(1), default=768)
    parser.add_argument("--replay-limit", type=at_least(0), default=48)
    parser.add_argument("--replay-fraction", type=float, default=AdaptConfig.replay_fraction)
    parser.add_argument("--general-held-out", type=at_least(0), default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads")


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", help="write the benchmark's data files")
    cut.add_argument("--out", default="runs/domain")
    cut.add_argument("--stream", type=at_least(1), default=64)
    cut.add_argument("--held-out", type=at_least(1), default=16)
    cut.add_argument("--seed", type=int, default=0)
    cut.add_argument("--max-chars", type=at_least(1), default=1200, help="longest prompt of the stream and held-out")
    run = commands.add_parser("rejected", help="frozen vs uniform vs rejected-weighted adaptation on one stream")
    run.add_argument("--head", required=True, help="the deployed head's training checkpoint (EAGLE-3 or P-EAGLE)")
    run.add_argument("--out", default="runs/domain56")
    run.add_argument("--stream", type=at_least(2), default=48, help="requests served and captured")
    run.add_argument(
        "--held-out", type=at_least(1), default=24, help="unseen prompts of the domain, never in the stream"
    )
    run.add_argument(
        "--weight", type=float, default=4.0, help="adapt.rejected_weight of the weighted round (1: no such round)"
    )
    run.add_argument("--max-chars", type=at_least(1), default=1200)
    run.add_argument(
        "--dtype", default="float32", help="serve and adapt the head on the target in this dtype ('': its recipe's)"
    )
    _round_flags(run)
    again = commands.add_parser("rounds", help="rounds one after another as a captured stream arrives")
    again.add_argument("--source", required=True, help="a rejected run's --out: its head, stream and unseen prompts")
    again.add_argument("--out", required=True)
    again.add_argument("--rounds", type=at_least(1), default=2, help="equal slices of the stream, a round after each")
    _round_flags(again)
    args = parser.parse_args(argv)
    if args.command in ("rejected", "rounds"):
        (rejected if args.command == "rejected" else rounds)(args)
        return
    split(Path(args.out), args.stream, args.held_out, args.seed, args.max_chars)


if __name__ == "__main__":
    main()
