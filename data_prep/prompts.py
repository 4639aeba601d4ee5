"""Evaluation prompt sets: the bundled MT-bench questions or any JSONL file.

Each JSONL line holds either ``turns`` (a list of user messages: turn 2 follows the model's own
turn-1 answer) or ``prompt`` (one message); ``category`` and ``id``/``question_id`` are optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.assets import asset_path
from draftsmith.data_prep.sharegpt import DataError

MT_BENCH = "mt_bench"


@dataclass
class Prompt:
    """One multi-turn evaluation prompt."""

    id: str
    turns: list[str]
    category: str = "all"


def load_prompts(
    bench: str = MT_BENCH, limit: int | None = None, per_category: int | None = None, category: str | None = None
) -> list[Prompt]:
    """Prompts of ``bench`` (``mt_bench`` or a JSONL path), of ``category`` alone where given: the
    first ``per_category`` of each category (in file order), then the first ``limit`` of those."""
    path = asset_path(MT_BENCH) if bench == MT_BENCH else Path(bench)
    if not path.is_file():
        raise DataError(f"prompt set {bench!r} is neither 'mt_bench' nor an existing .jsonl file")
    prompts = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected an object with 'turns' or 'prompt'")
            turns = record.get("turns", [record["prompt"]] if "prompt" in record else None)
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise DataError(
                    f"{where}: 'turns' must be a non-empty list of non-empty strings (or give one 'prompt' string)"
                )
            prompt_id = str(record.get("question_id", record.get("id", lineno)))
            prompts.append(Prompt(id=prompt_id, turns=turns, category=str(record.get("category", "all"))))
    if category is not None:
        kept = [prompt for prompt in prompts if prompt.category == category]
        if not kept:
            found = ", ".join(sorted({prompt.category for prompt in prompts}))
            raise DataError(f"prompt set {bench!r} has no prompt of category {category!r}; its categories: {found}")
        prompts = kept
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for prompt in prompts:
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
            if seen[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts
