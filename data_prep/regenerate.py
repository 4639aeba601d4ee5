"""Self-distillation data: the target rewrites the assistant turns of the training conversations.

A drafter learns the distribution it will be verified against, not ShareGPT's (Medusa-2 needs
this to keep a LoRA-tuned target faithful; every recipe may use it via ``data.regenerate``).
User turns are kept; assistant turn j is regenerated from the conversation so far, with earlier
assistant turns already replaced. Generation is batched (left padding, one ``generate`` call per
batch and turn) and the output is a JSONL file in the ``messages`` layout the loader reads.

Resumable: each finished batch is appended in one write and flushed; a restart skips the
conversations already in the file and first cuts off a half-written last line. Batches and their
seeds do not depend on where a run stopped (a batch cut short is generated whole again), so a
resumed file equals an uninterrupted one, sampled or not.

    python data_prep/regenerate.py --target default --limit 400 --max-new-tokens 256 --out regen.jsonl
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.assets import cache_root
from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.dataset import _source_identity, _tokenizer_identity
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.errors import ArgumentParser, report_user_errors
from draftsmith.precision import DTYPE_CHOICES
from draftsmith.recipe import DataConfig, RegenerateConfig
from draftsmith.target import load_target


def _done_ids(path: Path) -> set[str]:
    """Ids already written; a half-written last line (an interrupted append) is cut off first."""
    if not path.is_file():
        return set()
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        with path.open("r+b") as handle:
            handle.truncate(len(keep))
    return {json.loads(line)["id"] for line in keep.decode("utf-8").splitlines() if line.strip()}


def _through_first_user(messages: list[dict]) -> list[dict]:
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first + 1]


@torch.no_grad()
def _generate(target, tokenizer, histories: list[list[dict]], cfg: RegenerateConfig) -> list[str]:
    texts = [tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    sampling = {"do_sample": False} if cfg.temperature == 0 else {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
    out = target.generate(**batch, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, batch["input_ids"].shape[1]:]]


def regenerate(target, tokenizer, conversations: list[dict], out: str | Path, cfg: RegenerateConfig,
               show: bool = True) -> dict:
    """Write ``conversations`` with target-written assistant turns to ``out`` (JSONL); resumable.

    Returns counts: ``written`` (this call), ``skipped`` (already in the file), ``turns`` regenerated,
    ``empty`` (replies that came out empty: the conversation is cut before that turn and counted),
    ``prompt_too_long`` (first prompt over ``cfg.max_prompt_tokens``: left out, listed when shown).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out)
    todo = list(conversations)  # done ones too: the batches are those of an uninterrupted run
    stats = {"written": 0, "skipped": sum(c["id"] in done for c in todo), "turns": 0, "empty": 0, "prompt_too_long": 0}
    # Longest first prompt per conversation: batches of similar lengths waste little on padding.
    first_prompt = {c["id"]: len(render_prompt(tokenizer, _through_first_user(c["messages"]))) for c in todo}
    if cfg.max_prompt_tokens:
        long = [c for c in todo if first_prompt[c["id"]] > cfg.max_prompt_tokens]
        stats["prompt_too_long"] = len(long)
        if long and show:
            print(f"regenerate: {len(long)} conversations whose first prompt exceeds {cfg.max_prompt_tokens} "
                  f"tokens are left out (e.g. {', '.join(c['id'] for c in long[:3])})")
        todo = [c for c in todo if first_prompt[c["id"]] <= cfg.max_prompt_tokens]
    todo.sort(key=lambda c: first_prompt[c["id"]])
    bar = tqdm(total=len(todo) - stats["skipped"], desc="regenerate", disable=not show)
    for start in range(0, len(todo), cfg.batch_size):
        chunk = todo[start:start + cfg.batch_size]
        if all(c["id"] in done for c in chunk):
            continue
        # A batch half written before an interruption is generated whole again (its rows then
        # come out as they did), and seeded by its place: a resumed run samples what an
        # uninterrupted one did.
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed + start)
        # Per conversation: its messages up to (and excluding) each assistant turn to rewrite.
        results = [[m for m in c["messages"] if m["role"] == "system"] for c in chunk]
        users = [[m for m in c["messages"] if m["role"] == "user"] for c in chunk]
        live = list(range(len(chunk)))
        for turn in range(cfg.max_turns or max(len(u) for u in users)):
            live = [i for i in live if turn < len(users[i])]
            if not live:
                break
            for i in live:
                results[i].append(users[i][turn])
            replies = _generate(target, tokenizer, [results[i] for i in live], cfg)
            still = []
            for i, reply in zip(live, replies):
                if reply:
                    results[i].append({"role": "assistant", "content": reply})
                    stats["turns"] += 1
                    still.append(i)
                else:  # nothing to learn from an empty reply: end this conversation before it
                    results[i].pop()
                    stats["empty"] += 1
            live = still
        # Every conversation is written, even one left without a reply, so a restart does not
        # redo it; the loader then drops it under its own counted reason.
        new = [(c, r) for c, r in zip(chunk, results) if c["id"] not in done]
        lines = "".join(json.dumps({"id": c["id"], "messages": r}) + "\n" for c, r in new)
        with out.open("a", encoding="utf-8") as handle:
            handle.write(lines)
            handle.flush()
            os.fsync(handle.fileno())
        stats["written"] += len(new)
        bar.update(len(new))
    bar.close()
    return stats


def regenerated_path(data: DataConfig, target_name: str, tokenizer) -> Path:
    """Where the regenerated copy of ``data`` for ``target_name`` lives (keyed by everything it depends on)."""
    if data.regenerate.output:
        return Path(data.regenerate.output)
    key = hashlib.sha256(json.dumps([
        _source_identity(data.path), data.split, data.limit, target_name, _tokenizer_identity(tokenizer),
        asdict(data.regenerate),
    ]).encode()).hexdigest()[:16]
    return cache_root() / "regenerated" / f"{key}.jsonl"


def prepare_data_config(data: DataConfig, target, target_name: str, tokenizer) -> DataConfig:
    """``data`` itself, or (with ``data.regenerate.enabled``) a copy pointing at its regenerated file."""
    if not data.regenerate.enabled:
        return data
    if data.regenerate.max_prompt_tokens is None:  # a prompt longer than max_length leaves nothing to train on
        data = replace(data, regenerate=replace(data.regenerate, max_prompt_tokens=data.max_length))
    path = regenerated_path(data, target_name, tokenizer)
    conversations, _ = load_conversations(data.path, data.split, data.limit, verbose=False)
    stats = regenerate(target, tokenizer, conversations, path, data.regenerate)
    print(f"regenerated assistant turns in {path}: {stats}")
    return replace(data, path=str(path), split="train")


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32")
    parser.add_argument("--data", default="sharegpt", help="'sharegpt' (bundled), a .json/.jsonl file or a hub id")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=RegenerateConfig.max_new_tokens)
    parser.add_argument("--max-turns", type=int, default=RegenerateConfig.max_turns)
    parser.add_argument("--temperature", type=float, default=RegenerateConfig.temperature)
    parser.add_argument("--batch-size", type=int, default=RegenerateConfig.batch_size)
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="leave out longer first prompts (counted)")
    parser.add_argument("--out", required=True, help="output JSONL (appended to and resumed)")
    args = parser.parse_args(argv)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                           temperature=args.temperature, batch_size=args.batch_size,
                           max_prompt_tokens=args.max_prompt_tokens)
    cfg.validate()
    target, tokenizer = load_target(args.target, args.dtype)
    conversations, _ = load_conversations(args.data, limit=args.limit)
    stats = regenerate(target, tokenizer, conversations, args.out, cfg)
    print(stats)
    return stats


if __name__ == "__main__":
    main()
