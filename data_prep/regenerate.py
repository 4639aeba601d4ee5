"""Self-distillation data: the target rewrites the assistant turns of the training conversations.

A drafter learns the distribution it will be verified against, not ShareGPT's (Medusa-2 needs
this to keep a LoRA-tuned target faithful; every recipe may use it via ``data.regenerate``).
User turns are kept; assistant turn j is regenerated from the conversation so far, with earlier
assistant turns already replaced. Two engines write the replies: ``vllm`` (the serving engine,
continuous batching, tensor/data parallel on GPUs; run in a child process, see
:mod:`draftsmith.vllm_engine`) and ``hf`` (batched ``generate``, left padding); ``auto`` takes
vLLM where it is importable. The output is a JSONL file in the ``messages`` layout the loader reads;
each regenerated reply keeps the target's own token ids (``token_ids``, tokenised exactly as
generated, no decode and re-encode) and whether it ended with an end-of-turn token (``finished``).
A reply cut off at ``max_new_tokens`` is kept open (no end-of-turn token is appended, and the
conversation ends there) or, with ``on_length: drop``, dropped with the rest of its conversation.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from draftsmith.assets import cache_root
from draftsmith.config import check_ranges, from_dict
from draftsmith.data_prep.chat import render_prompt, reply_message
from draftsmith.data_prep.dataset import source_identity, tokenizer_identity
from draftsmith.data_prep.sharegpt import load_conversations
from draftsmith.errors import ArgumentParser, UsageError, at_least, report_user_errors
from draftsmith.precision import DTYPE_CHOICES, dtype_name, resolve_dtype
from draftsmith.recipe import DataConfig, RegenerateConfig
from draftsmith.target import (
    eos_token_ids,
    load_target,
    load_tokenizer,
    resolve_target,
    stop_token_ids,
    target_record,
)
from draftsmith.vllm_engine import engine_args, run_job, why_unavailable


@dataclass
class Reply:
    """One generated assistant reply: its token ids (up to, not including, the end-of-turn token)
    and whether the target ended it (``False``: cut off at ``max_new_tokens``)."""

    token_ids: list[int]
    finished: bool


# Writes the replies to a batch of histories (each ends with a user turn), seeded by ``seeds``.
Generate = Callable[[list[list[dict]], list[int]], list[Reply]]


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


def _reply(tokens: list[int], eos: set[int]) -> Reply:
    """The reply up to its first end-of-turn token (padding after it dropped)."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return Reply(tokens if end is None else tokens[:end], end is not None)


def hf_generator(target, tokenizer, cfg: RegenerateConfig) -> Generate:
    """Replies from Hugging Face ``generate`` (batched, left padding)."""
    eos = eos_token_ids(target, tokenizer)

    @torch.no_grad()
    def generate(histories: list[list[dict]], seeds: list[int]) -> list[Reply]:
        prompts = [render_prompt(tokenizer, h) for h in histories]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
        sampling = (
            {"do_sample": False}
            if cfg.temperature == 0
            else {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
        )
        if seeds:  # one seed per batch: HF samples a batch from one generator
            torch.manual_seed(seeds[0])
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=sorted(eos),
            **sampling,
        )
        return [_reply(row.tolist(), eos) for row in out[:, width:]]

    return generate


def regenerate(
    generate: Generate, tokenizer, conversations: list[dict], out: str | Path, cfg: RegenerateConfig, show: bool = True
) -> dict:
    """Write ``conversations`` with assistant turns written by ``generate`` (:func:`hf_generator`, or
    vLLM's in :func:`run_vllm_regeneration`) to ``out`` (JSONL); resumable.

    Returns counts: ``written`` (this call), ``skipped`` (already in the file), ``turns`` regenerated,
    ``empty`` (replies that came out empty: the conversation is cut before that turn and counted),
    ``cut_off`` (replies that hit ``max_new_tokens``: kept open, or dropped with ``on_length: drop``),
    ``prompt_too_long`` (first prompt over ``cfg.max_prompt_tokens``: left out, listed when shown).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out)
    kept = conversations[cfg.conversations :] if cfg.conversations is not None else []
    todo = list(conversations[: cfg.conversations])  # done ones too: the batches are those of an uninterrupted run
    stats = {
        "written": 0,
        "skipped": sum(c["id"] in done for c in todo),
        "turns": 0,
        "empty": 0,
        "cut_off": 0,
        "prompt_too_long": 0,
    }
    # Longest first prompt per conversation: batches of similar lengths waste little on padding.
    first_prompt = {c["id"]: len(render_prompt(tokenizer, _through_first_user(c["messages"]))) for c in todo}
    if cfg.max_prompt_tokens:
        long = [c for c in todo if first_prompt[c["id"]] > cfg.max_prompt_tokens]
        stats["prompt_too_long"] = len(long)
        if long and show:
            print(
                f"regenerate: {len(long)} conversations whose first prompt exceeds {cfg.max_prompt_tokens} "
                f"tokens are left out (e.g. {', '.join(c['id'] for c in long[:3])})"
            )
        todo = [c for c in todo if first_prompt[c["id"]] <= cfg.max_prompt_tokens]
    todo.sort(key=lambda c: first_prompt[c["id"]])
    bar = tqdm(total=len(todo) - stats["skipped"], desc="regenerate", disable=not show)
    for start in range(0, len(todo), cfg.batch_size):
        chunk = todo[start : start + cfg.batch_size]
        if all(c["id"] in done for c in chunk):
            continue
        # A batch half written before an interruption is generated whole again (its rows then
        # come out as they did), and seeded by its place: a resumed run samples what an
        # uninterrupted one did.
        seeds = [] if cfg.seed is None else [cfg.seed + start + i for i in range(len(chunk))]
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
            replies = generate([results[i] for i in live], [seeds[i] for i in live] if seeds else [])
            still = []
            for i, reply in zip(live, replies):
                if not reply.token_ids or (not reply.finished and cfg.on_length == "drop"):
                    # Nothing to learn from an empty reply, and a dropped cut-off one: end the
                    # conversation before it.
                    results[i].pop()
                    stats["empty" if not reply.token_ids else "cut_off"] += 1
                    continue
                results[i].append(reply_message(tokenizer, reply.token_ids, reply.finished))
                stats["turns"] += 1
                if reply.finished:
                    still.append(i)
                else:  # kept open: nothing can follow a reply that never ended
                    stats["cut_off"] += 1
            live = still
        # Every conversation is written, even one left without a reply, so a restart does not
        # redo it; the loader then drops it under its own counted reason.
        new = [(c, r) for c, r in zip(chunk, results) if c["id"] not in done]
        _append(out, [{"id": c["id"], "messages": r} for c, r in new])
        stats["written"] += len(new)
        bar.update(len(new))
    bar.close()
    # The rest of a mix keeps its own replies, appended once the rewritten ones are all in.
    _append(out, [c for c in kept if c["id"] not in done])
    stats["kept"] = len(kept)
    return stats


def _append(out: Path, conversations: list[dict]) -> None:
    """Append ``conversations`` to ``out`` in one flushed write (an interruption loses whole lines only)."""
    with out.open("a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps({"id": c["id"], "messages": c["messages"]}) + "\n" for c in conversations))
        handle.flush()
        os.fsync(handle.fileno())


def resolve_engine(engine: str, field: str = "data.regenerate.engine") -> str:
    """``auto`` is vLLM where it is importable here, else Hugging Face (``hf``: the target in this
    process); ``vllm`` where it is not is a one-line error naming ``field``."""
    if engine == "auto":
        return "hf" if why_unavailable() else "vllm"
    if engine == "vllm" and why_unavailable():
        raise UsageError(f"{field} vllm: {why_unavailable()}; or use engine: hf")
    return engine


def regenerated_path(data: DataConfig, target_name: str, tokenizer, target_identity: list | None = None) -> Path:
    """Where the regenerated copy of ``data`` for ``target_name`` lives (keyed by everything it
    depends on: the data, the target's weights, the engine and every generation option)."""
    if data.regenerate.output:
        return Path(data.regenerate.output)
    key = hashlib.sha256(
        json.dumps(
            [
                source_identity(data.path),
                data.split,
                data.limit,
                target_name,
                target_identity,
                tokenizer_identity(tokenizer),
                asdict(data.regenerate),
            ]
        ).encode()
    ).hexdigest()[:16]
    return cache_root() / "regenerated" / f"{key}.jsonl"


def _identity(target) -> list:
    return target_record(target, "")["embedding_signature"]


def prepare_data_config(
    data: DataConfig,
    target,
    target_name: str,
    tokenizer,
    full_target: Callable | None = None,
    generate: Generate | None = None,
) -> DataConfig:
    """``data`` itself, or (with ``data.regenerate.enabled``) a copy pointing at its regenerated file,
    written first where it is missing or incomplete.

    ``target`` may be head-only (:func:`~draftsmith.target.load_target` with ``head_only``; its embeddings key the
    file): ``full_target()`` loads the whole target where the ``hf`` engine has to generate.
    ``generate``: the replies' writer to use whatever the engine (vLLM's child process passes its own).
    """
    if not data.regenerate.enabled:
        return data
    data, path = _resolved(data, target, target_name, tokenizer)
    cfg = data.regenerate
    conversations, _ = load_conversations(data.path, data.split, data.limit, verbose=False)
    if not _pending(conversations, path, tokenizer, cfg):
        stats = "complete"
    elif generate is not None:
        stats = regenerate(generate, tokenizer, conversations, path, cfg)
    elif cfg.engine == "vllm":
        stats = regenerate_with_vllm(
            resolve_target(target_name), dtype_name(next(target.parameters()).dtype), data, path
        )
    else:
        model = full_target() if full_target is not None else target
        stats = regenerate(hf_generator(model, tokenizer, cfg), tokenizer, conversations, path, cfg)
    print(f"regenerated assistant turns in {path} ({cfg.engine}): {stats}")
    return replace(data, path=str(path), split="train")


def _resolved(data: DataConfig, target, target_name: str, tokenizer) -> tuple[DataConfig, Path]:
    """``data`` with its regeneration engine and prompt limit resolved, and its regenerated file."""
    cfg = replace(data.regenerate, engine=resolve_engine(data.regenerate.engine))
    if cfg.max_prompt_tokens is None:  # a prompt longer than max_length leaves nothing to train on
        cfg = replace(cfg, max_prompt_tokens=data.max_length)
    data = replace(data, regenerate=cfg)
    return data, regenerated_path(data, target_name, tokenizer, _identity(target))


def regeneration_pending(data: DataConfig, target, target_name: str, tokenizer) -> bool:
    """Whether :func:`prepare_data_config` would still have replies to generate for ``data``."""
    if not data.regenerate.enabled:
        return False
    data, path = _resolved(data, target, target_name, tokenizer)
    conversations, _ = load_conversations(data.path, data.split, data.limit, verbose=False)
    return _pending(conversations, path, tokenizer, data.regenerate)


def _pending(conversations: list[dict], path: Path, tokenizer, cfg: RegenerateConfig) -> bool:
    """Whether some conversation still has to be regenerated into ``path`` (those whose first
    prompt is too long are never written)."""
    done = _done_ids(path)
    limit = cfg.max_prompt_tokens or float("inf")
    return any(
        c["id"] not in done and len(render_prompt(tokenizer, _through_first_user(c["messages"]))) <= limit
        for c in conversations
    )


def regenerate_with_vllm(model: str, dtype: str, data: DataConfig, out: Path) -> dict:
    """Regenerate ``data`` into ``out`` with vLLM serving ``model`` (a folder or hub id) in a child process."""
    cfg = data.regenerate
    job = {
        # By its import path, not __name__: this file also runs as a script (__main__).
        "task": "draftsmith.data_prep.regenerate:run_vllm_regeneration",
        "model": model,
        "dtype": dtype,
        "data": asdict(data),
        "out": str(out),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "data_parallel_size": cfg.data_parallel_size,
    }
    return run_job(job, f"regenerating {data.path} with vLLM", echo=True)


def run_vllm_regeneration(job: dict) -> dict:
    """Regeneration's job for :func:`draftsmith.vllm_engine.run_job` (runs in vLLM's child process)."""
    from vllm import LLM

    data = from_dict(DataConfig, job["data"], "job")
    cfg = data.regenerate
    tokenizer = load_tokenizer(job["model"])
    llm = LLM(
        **engine_args(
            job["model"],
            job["dtype"],
            max_model_len=regeneration_context(job["model"], cfg),
            tensor_parallel_size=job["tensor_parallel_size"],
            data_parallel_size=job["data_parallel_size"],
        )
    )
    conversations, _ = load_conversations(data.path, data.split, data.limit, verbose=False)
    return regenerate(vllm_generator(llm, job["model"], tokenizer, cfg), tokenizer, conversations, job["out"], cfg)


def regeneration_context(model: str, cfg: RegenerateConfig) -> int:
    """The context vLLM reserves per sequence: the longest prompt kept plus a reply, within the model's."""
    longest = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None) or 1 << 20
    return min(longest, (cfg.max_prompt_tokens or longest) + cfg.max_new_tokens)


def vllm_generator(llm, model: str, tokenizer, cfg: RegenerateConfig) -> Generate:
    """:data:`Generate` by a ``vllm.LLM`` serving ``model`` (in vLLM's child process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eos = set(stop_token_ids(model, tokenizer))

    def generate(histories: list[list[dict]], seeds: list[int]) -> list[Reply]:
        prompts = [TokensPrompt(prompt_token_ids=render_prompt(tokenizer, h)) for h in histories]
        # A seed per request: what a conversation samples does not depend on its batch.
        params = [
            SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_new_tokens,
                stop_token_ids=sorted(eos),
                seed=seeds[i] if seeds else None,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [_reply(list(o.outputs[0].token_ids), eos) for o in outputs]

    return generate


@report_user_errors
def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 where it is fast here (measured), else fp32"
    )
    parser.add_argument(
        "--engine",
        default=RegenerateConfig.engine,
        choices=("auto", "vllm", "hf"),
        help="vllm (the serving engine), hf (transformers generate); auto: vllm where importable",
    )
    parser.add_argument("--data", default="sharegpt", help="'sharegpt' (bundled), a .json/.jsonl file or a hub id")
    parser.add_argument("--limit", type=at_least(1), default=None, help="regenerate the first N conversations")
    parser.add_argument("--max-new-tokens", type=int, default=RegenerateConfig.max_new_tokens)
    parser.add_argument("--max-turns", type=int, default=RegenerateConfig.max_turns)
    parser.add_argument("--temperature", type=float, default=RegenerateConfig.temperature)
    parser.add_argument("--top-p", type=float, default=RegenerateConfig.top_p)
    parser.add_argument("--seed", type=int, default=RegenerateConfig.seed)
    parser.add_argument(
        "--on-length",
        default=RegenerateConfig.on_length,
        choices=("keep", "drop"),
        help="a reply cut off at --max-new-tokens: keep it open (the conversation ends there) or drop it",
    )
    parser.add_argument("--batch-size", type=int, default=RegenerateConfig.batch_size)
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="leave out longer first prompts (counted)")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=RegenerateConfig.tensor_parallel_size, help="vLLM, GPUs"
    )
    parser.add_argument(
        "--data-parallel-size", type=int, default=RegenerateConfig.data_parallel_size, help="vLLM, GPUs"
    )
    parser.add_argument("--out", required=True, help="output JSONL (appended to and resumed)")
    args = parser.parse_args(argv)
    cfg = RegenerateConfig(
        enabled=True,
        engine=resolve_engine(args.engine),
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        on_length=args.on_length,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    try:
        check_ranges(cfg, "data.regenerate")
    except ValueError as err:
        raise UsageError(str(err)) from None
    if cfg.engine == "vllm":
        data = DataConfig(path=args.data, limit=args.limit, regenerate=cfg)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        stats = regenerate_with_vllm(
            resolve_target(args.target), dtype_name(resolve_dtype(args.dtype, device)), data, Path(args.out)
        )
    else:
        target, tokenizer = load_target(args.target, args.dtype)
        conversations, _ = load_conversations(args.data, limit=args.limit)
        stats = regenerate(hf_generator(target, tokenizer, cfg), tokenizer, conversations, args.out, cfg)
    print(stats)
    return stats


if __name__ == "__main__":
    main()
