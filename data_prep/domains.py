"""Split conversations by domain, for training a head without a domain and serving it that domain.

A conversation is *code* when an assistant reply holds a fenced block or a line that opens a
definition in a common language (``def``, ``function``, ``#include``, ``class X {``, ...): on the
bundled ShareGPT that marks about 6,900 of its 17,671 complete conversations. The rule is a
heuristic on purpose: what matters for a domain-shift benchmark is that the head never saw the
domain's replies, not a perfect classifier.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from draftsmith.atomic import staged

_CODE = re.compile(
    r"```|^\s*(def |class \w+.*[:{]\s*$|function\b|#include\b|import \w|public (static )?\w|SELECT\b|const \w+ = )",
    re.MULTILINE,
)


def has_code(conversation: dict) -> bool:
    """True when an assistant reply of ``conversation`` (``{"messages": [{role, content}]}``) holds code."""
    return any(m["role"] == "assistant" and _CODE.search(m["content"]) for m in conversation["messages"])


def write_jsonl(conversations: list[dict], path: str | Path) -> Path:
    """``conversations`` as a JSONL file of ``{"id", "messages"}`` records (written atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for conversation in conversations:
            record = {"id": conversation["id"], "messages": conversation["messages"]}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
