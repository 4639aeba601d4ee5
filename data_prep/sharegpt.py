"""Load ShareGPT-style conversations from the bundled file, a local JSON/JSONL file or the hub.

Every record is either kept or counted under a named reason; nothing is dropped silently. The
bundled ShareGPT V3 file is cut off mid-record at its end: every complete conversation before
the cut is recovered and the cut-off tail is reported.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.assets import asset_path
from draftsmith.errors import UserError
from draftsmith.hub import check_hub_id

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
BUNDLED = "sharegpt"


class DataError(UserError, ValueError):
    """A dataset that cannot be read at all (as opposed to individual bad records)."""


@dataclass
class LoadSummary:
    """What happened to every record of a source."""

    source: str
    records: int = 0  # complete records read
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    repaired: Counter = field(default_factory=Counter)  # repair -> count (record kept)
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first record ids
    truncated_tail_bytes: int = 0  # size of a cut-off final record, 0 if the file is complete

    def drop(self, reason: str, record_id: str) -> None:
        self.dropped[reason] += 1
        ids = self.examples.setdefault(reason, [])
        if len(ids) < 3:
            ids.append(record_id)

    def reasons(self) -> str:
        """The drop reasons and their counts on one line, most frequent first."""
        return ", ".join(f"{n} dropped as {reason}" for reason, n in self.dropped.most_common())

    def __str__(self) -> str:
        lines = [f"{self.source}: {self.records} records read, {self.kept} conversations kept"]
        if self.truncated_tail_bytes:
            lines.append(
                f"  file is truncated: the last {self.truncated_tail_bytes} bytes are an incomplete "
                "record (not used); every complete record before it was recovered"
            )
        for reason, count in sorted(self.dropped.items()):
            lines.append(f"  dropped {count:>6} {reason} (e.g. {', '.join(self.examples[reason])})")
        for repair, count in sorted(self.repaired.items()):
            lines.append(f"  repaired {count:>5} {repair}")
        return "\n".join(lines)


_SEPARATOR = re.compile(r"[\s,]*")


def _iter_json_array(text: str, source: str, summary: LoadSummary) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    start = _SEPARATOR.match(text, 0).end()
    if start >= len(text) or text[start] != "[":
        raise DataError(f"{source}: expected a JSON array of conversations or JSON lines")
    pos, index = start + 1, 0
    complete = text.rstrip().endswith("]")
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if not complete:  # the array never closes: this is the cut-off final record
                summary.truncated_tail_bytes = len(text.encode()) - len(text[:pos].encode())
                summary.drop("truncated_tail", f"record {index} at line {err.lineno}")
                return
            raise DataError(
                f"{source}: record {index} is not valid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
            ) from None
        yield index, record
        index += 1


def iter_json_lines(path: Path, summary: LoadSummary) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield lineno - 1, json.loads(line)
            except json.JSONDecodeError as err:
                reason = "truncated_tail" if not line.endswith("\n") else "malformed_json"
                summary.drop(reason, f"line {lineno} ({err.msg})")


def _normalise(record: Any, record_id: str, summary: LoadSummary) -> dict | None:
    """A clean ``{"id", "messages"}`` conversation, or None with the reason counted."""
    if not isinstance(record, dict):
        summary.drop("not_an_object", record_id)
        return None
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        summary.drop("missing_conversations", record_id)
        return None
    if not turns:
        summary.drop("empty_conversation", record_id)
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            summary.drop("malformed_turn", record_id)
            return None
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in ROLE_ALIASES:
            summary.drop("unknown_role", record_id)
            return None
        if not isinstance(content, str):
            summary.drop("non_string_content", record_id)
            return None
        if not content.strip():
            summary.drop("empty_turn", record_id)
            return None
        message = {"role": ROLE_ALIASES[role], "content": content}
        if "token_ids" in turn:  # a reply regenerated by the target keeps its own ids (data_prep/regenerate.py)
            ids = turn["token_ids"]
            if (
                message["role"] != "assistant"
                or not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and t >= 0 for t in ids)
            ):
                summary.drop("malformed_token_ids", record_id)
                return None
            message.update(token_ids=ids, finished=bool(turn.get("finished", True)))
        messages.append(message)
    # ShareGPT splits long chats into parts; a part may open with the assistant continuing the
    # previous part. That turn has no prompt to condition on, so it is removed (and counted).
    system = [m for m in messages[:1] if m["role"] == "system"]
    body = messages[len(system) :]
    if body and body[0]["role"] == "assistant":
        body = body[1:]
        summary.repaired["leading_assistant_turn_removed"] += 1
    expected = ["user", "assistant"]
    if any(m["role"] != expected[i % 2] for i, m in enumerate(body)):
        summary.drop("bad_turn_order", record_id)
        return None
    if not any(m["role"] == "assistant" for m in body):
        summary.drop("no_assistant_turn", record_id)
        return None
    return {"id": str(record.get("id", record_id)), "messages": system + body}


def _raw_records(
    source: str, split: str, summary: LoadSummary, expected_model: str | None
) -> Iterable[tuple[int, Any]]:
    path = asset_path(BUNDLED) if source == BUNDLED else Path(source)
    if path.is_file():
        with path.open(encoding="utf-8") as handle:
            head = handle.read(4096).lstrip()
        if head.startswith("["):
            return _iter_json_array(path.read_text(encoding="utf-8"), str(path), summary)
        # Imported here: it imports this module's readers.
        from draftsmith.data_prep.request_log import is_request_log, read_request_log

        if is_request_log(path):
            return read_request_log(path, summary, expected_model)
        return iter_json_lines(path, summary)
    if path.exists() or source.endswith((".json", ".jsonl")):
        raise DataError(f"dataset file {source} does not exist or is not a file")
    import datasets  # a hub id

    check_hub_id(source, "data.path", "dataset")
    try:
        return enumerate(datasets.load_dataset(source, split=split))
    except ValueError as err:  # e.g. an unknown split
        raise DataError(f"data.path {source} (split {split!r}): {err}") from None


def load_conversations(
    source: str = BUNDLED,
    split: str = "train",
    limit: int | None = None,
    verbose: bool = True,
    expected_model: str | None = None,
) -> tuple[list[dict], LoadSummary]:
    """Read and validate conversations.

    Args:
        source: ``"sharegpt"`` for the bundled ShareGPT V3 file, a local ``.json`` (array) or
            ``.jsonl`` file, or a ``datasets`` hub id. Records use ShareGPT's
            ``conversations: [{from, value}]`` or the ``messages: [{role, content}]`` layout; a
            serving request log (a gateway's chat JSONL or a vLLM server log) is read by
            :mod:`draftsmith.data_prep.request_log`.
        split: split to read from a hub dataset.
        limit: stop after this many kept conversations.
        verbose: print the summary.
        expected_model: the served model name a request log's requests must be for (requests
            for another are dropped and counted); None: any.

    Returns:
        The kept conversations as ``{"id", "messages": [{"role", "content"}]}`` and a
        :class:`LoadSummary` with a per-reason count of everything dropped or repaired.
    """
    summary = LoadSummary(source=str(asset_path(BUNDLED)) if source == BUNDLED else source)
    kept = []
    for index, record in _raw_records(source, split, summary, expected_model):
        summary.records += 1
        record_id = str(record.get("id", index)) if isinstance(record, dict) else str(index)
        conversation = _normalise(record, record_id, summary)
        if conversation is not None:
            kept.append(conversation)
            if limit is not None and len(kept) >= limit:
                break
    summary.kept = len(kept)
    if verbose:
        print(summary)
    if not kept:
        raise DataError(
            f"{summary.source}: no usable conversation in {summary.records} complete records "
            f"({summary.reasons() or 'the source is empty'}); give a file of ShareGPT-style records "
            "('conversations': [{'from', 'value'}] or 'messages': [{'role', 'content'}])"
        )
    return kept, summary
