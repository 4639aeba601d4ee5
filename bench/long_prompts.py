"""MT-bench questions as long prompts: each first turn after a few thousand tokens of ShareGPT context.

    python bench/long_prompts.py --out runs/eagle31/prompts --context-tokens 2000 --per-category 2

Writes ``short.jsonl`` (the questions alone) and ``long.jsonl`` (the same questions, ids and
categories, each after ``--context-tokens`` tokens of other ShareGPT conversations, counted with the
bundled target's tokenizer), so ``bench/paired_tau.py`` pairs a method's turns across the two sets.
The context comes from conversations past the first ``--skip`` (those the bench's heads trained on),
a different stretch for each question.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data_prep.prompts import load_prompts
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.target import load_tokenizer


def context_blocks(tokenizer, conversations: list[dict], tokens: int, count: int) -> list[str]:
    """``count`` transcripts of consecutive ``conversations``, each cut to ``tokens`` tokens, none sharing one."""
    blocks, pending = [], iter(conversations)
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            messages = next(pending)["messages"]
            text = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\n\n"
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        blocks.append(tokenizer.decode(ids[:tokens]))
    return blocks


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    """Write the short and long prompt sets."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for short.jsonl and long.jsonl")
    parser.add_argument("--context-tokens", type=int, default=2000, help="tokens of context before each question")
    parser.add_argument("--per-category", type=int, default=1, help="MT-bench questions per category")
    parser.add_argument("--skip", type=int, default=1000, help="ShareGPT conversations left out of the context")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer("default")
    questions = load_prompts(per_category=args.per_category)
    conversations, _ = load_conversations(limit=args.skip + 50 * len(questions), verbose=False)
    blocks = context_blocks(tokenizer, conversations[args.skip :], args.context_tokens, len(questions))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "short.jsonl").open("w") as short, (out / "long.jsonl").open("w") as long:
        for question, block in zip(questions, blocks, strict=True):
            record = {"id": question.id, "category": question.category}
            short.write(json.dumps({**record, "prompt": question.turns[0]}) + "\n")
            prompt = f"Earlier conversations, for context:\n\n{block}\n\nNow answer this: {question.turns[0]}"
            long.write(json.dumps({**record, "prompt": prompt}) + "\n")
    print(f"{len(questions)} questions: {out}/short.jsonl, {out}/long.jsonl (+{args.context_tokens} tokens each)")


if __name__ == "__main__":
    main()
