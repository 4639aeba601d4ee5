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
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from draftsmith.data_prep.domains import has_code, write_jsonl
from draftsmith.data_prep.prompts import MT_BENCH, load_prompts
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.errors import ArgumentParser, at_least, report_user_errors


def _first_turn(conversation: dict) -> str:
    return next(m["content"] for m in conversation["messages"] if m["role"] == "user")


def _prompts(conversations: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for c in conversations:
            record = {"id": c["id"], "prompt": _first_turn(c), "category": "code"}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def split(out: Path, stream: int, held_out: int, seed: int, max_chars: int) -> None:
    """Write the benchmark's data files under ``out`` (see the module docstring)."""
    conversations, _ = load_conversations(verbose=False)
    code = [c for c in conversations if has_code(c)]
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
    args = parser.parse_args(argv)
    split(Path(args.out), args.stream, args.held_out, args.seed, args.max_chars)


if __name__ == "__main__":
    main()
