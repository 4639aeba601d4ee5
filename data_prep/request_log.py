"""Serving request logs as training data: a gateway's chat JSONL and vLLM's request log.

:func:`is_request_log` tells either from a file's first lines and :func:`read_request_log` turns
it into the loader's ``{"id", "messages"}`` records, the reply last; every request is kept or
counted in the :class:`~draftsmith.data_prep.sharegpt.LoadSummary` under a named reason.

**Gateway JSONL**: one object per line in OpenAI's chat-completions shapes, ``{"request": {"model",
"messages"}, "response": {"id", "model", "choices": [{"message": {"role", "content"},
"finish_reason"}]}}`` or flat (``messages`` at the top beside ``response`` or ``choices``). The
conversation is the request's messages plus choice 0's reply.

**vLLM 0.32** ``vllm serve --enable-log-requests --enable-log-outputs --log-level DEBUG``, in its
text format (coloured or not) or ``--logging-config.formatter json``. Its ``RequestLogger``
(vllm/entrypoints/serve/utils/request_logger.py), called by the chat server
(vllm/entrypoints/openai/chat_completion/serving.py), writes per request:

- DEBUG ``Request {request_id} JSON body: {request JSON}``: the messages and model, under the
  body's own ``request_id``; the chat server's id is ``chatcmpl-{request_id}`` unless an
  ``X-Request-Id`` header replaced it (such a body pairs with nothing);
- DEBUG ``Request chatcmpl-{id} details: prompt: {rendered prompt!r}, prompt_token_ids: [...]``;
- INFO ``Received request chatcmpl-{id}: params: ...``;
- DEBUG ``Generated response chatcmpl-{id} details: output_token_ids: [...]`` and INFO
  ``Generated response chatcmpl-{id}: output: {reply!r}, finish_reason: ...`` per choice with
  text; a stream logs ``(streaming delta)`` lines, then its whole text ``(streaming complete)``
  with finish reason ``streaming_complete`` (the real one only if a delta line carried it).

What is recovered: the messages of the JSON body and the reply text (its token ids only for a
reply cut off before its end, which stays open as a regenerated reply does). The rendered prompt
only counts towards the longest field (below): the tokeniser renders messages with the target's
template itself, and a rendered prompt cannot be split back into turns without that template.
So a log written at INFO, with no bodies, is an error, and a request whose body is missing counts
as ``messages_not_logged``.

``--max-log-len N`` cuts every logged string to N characters and id list to N ids, unmarked. A cut
body no longer parses (``messages_cut_by_max_log_len``); cut fields are all exactly N long, the
longest of the file, so a reply as long as the longest field logged is taken as cut
(``reply_cut_by_max_log_len``): in a log written without the flag, that can drop the one request
whose reply is the longest thing logged.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from draftsmith.data_prep.sharegpt import DataError, LoadSummary, iter_json_lines

_HEAD_LINES = 100  # a server log may open with lines printed before vLLM's logging is set up
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's text format (vllm/logger.py _FORMAT, _DATE_FORMAT) from the level on.
_VLLM_LINE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] ")
_PY_STR = r"""'[^'\\]*(?:\\.[^'\\]*)*'|"[^"\\]*(?:\\.[^"\\]*)*\""""  # a str's repr (%r)
_IDS = r"\[[\d, ]*\]|None"  # a list of ids (%s)
_STREAM = r" \(streaming (?:delta|complete)\)"
# The RequestLogger's messages, searched leftmost: a log prefix comes before them and quoted
# user text only inside them. Ids hold no spaces (vLLM's are ``chatcmpl-`` + a uuid).
_EVENT = re.compile(
    r"Request (?P<body_id>\S+) JSON body: (?P<body>.*)"
    rf"|Request (?P<prompt_id>\S+) details: prompt: (?P<prompt>{_PY_STR}|None), "
    rf"prompt_token_ids: (?P<prompt_ids>{_IDS}),"
    r"|Received request (?P<received_id>\S+): params: "
    rf"|Generated response (?P<ids_id>\S+?)(?P<ids_stream>{_STREAM})? details: "
    rf"output_token_ids: (?P<ids>{_IDS})"
    rf"|Generated response (?P<out_id>\S+?)(?P<stream>{_STREAM})?: "
    rf"output: (?P<out>{_PY_STR}), finish_reason: (?P<finish>\S+)"
)
_GATEWAY, _VLLM_LOG = "gateway", "vllm_log"


def is_request_log(path: Path) -> bool:
    """Whether ``path`` is a gateway chat log or a vLLM server log (from its first lines)."""
    return _kind(path) is not None


def read_request_log(path: Path, summary: LoadSummary, expected_model: str | None = None) -> Iterator[tuple[int, dict]]:
    """The chats of a request log as ``(index, {"id", "messages"})``, the reply the last message.

    ``expected_model``: the served model name the requests must be for; requests for another are
    dropped under a reason naming both (None: any). Requests without a usable reply, or logged
    in part, are counted in ``summary``; a vLLM log with no request lines, bodies or replies at
    all (served without the flags that log them) is a :class:`DataError`.
    """
    if _kind(path) == _GATEWAY:
        return _gateway(path, summary, expected_model)
    return _vllm(path, summary, expected_model)


def _kind(path: Path) -> str | None:
    with path.open(encoding="utf-8", errors="replace") as handle:
        head = list(islice(handle, _HEAD_LINES))
    for line in head:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if _VLLM_LINE.search(_ANSI.sub("", line)):
                return _VLLM_LOG
            continue  # a broken first record, or a line printed before vLLM's logging started
        if not isinstance(record, dict):
            return None
        if "request" in record or ("messages" in record and ("response" in record or "choices" in record)):
            return _GATEWAY
        return _VLLM_LOG if {"levelname", "message"} <= record.keys() else None
    return None


def _drop(summary: LoadSummary, reason: str, example: str) -> None:
    """Count a request dropped here: the loader counts only the records it is given."""
    summary.records += 1
    summary.drop(reason, example)


def _other_model(model: Any, expected: str | None) -> str | None:
    """The drop reason of a request for another model than ``expected``, else None."""
    if expected is None or not model or model == expected:
        return None
    return f"other_model {model!r} (expected {expected!r})"


def _reply(content: Any, finish_reason: str | None, token_ids: Any, summary: LoadSummary, example: str) -> dict | None:
    """The assistant message of a logged reply, or None with the reason counted."""
    if finish_reason == "tool_calls":  # the logged text is a summary of the calls, not what was generated
        _drop(summary, "tool_call_reply", example)
        return None
    if not isinstance(content, str) or not content.strip():
        _drop(summary, "no_assistant_reply", example)
        return None
    reply = {"role": "assistant", "content": content}
    if finish_reason is None:
        summary.repaired["finish_reason_not_logged_taken_as_stop"] += 1
    elif finish_reason != "stop":
        # Cut off (length, abort): its text would be closed with an end-of-turn token it never had;
        # its own ids keep it open (data_prep/chat.py), and only they can.
        if not token_ids:
            _drop(summary, "unfinished_reply_without_token_ids", example)
            return None
        reply.update(token_ids=token_ids, finished=False)
    return reply


def _gateway(path: Path, summary: LoadSummary, expected_model: str | None) -> Iterator[tuple[int, dict]]:
    for index, record in iter_json_lines(path, summary):
        where = f"line {index + 1}"
        request = record.get("request", record) if isinstance(record, dict) else None
        messages = request.get("messages") if isinstance(request, dict) else None
        if not isinstance(messages, list):
            _drop(summary, "not_a_chat", where)
            continue
        response = record.get("response", record if "choices" in record else None)
        if not isinstance(response, dict) or "error" in response:
            _drop(summary, "error_response" if isinstance(response, dict) else "no_assistant_reply", where)
            continue
        model = response.get("model") or request.get("model")
        if reason := _other_model(model, expected_model):
            _drop(summary, reason, where)
            continue
        choices = response.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        finish = "tool_calls" if message.get("tool_calls") else choice.get("finish_reason")
        # token_ids: vLLM's choices carry them when asked (return_token_ids).
        reply = _reply(message.get("content"), finish, choice.get("token_ids"), summary, where)
        if reply is not None:
            yield index, {"id": str(response.get("id") or where), "messages": [*messages, reply]}


@dataclass
class _Request:
    """What a vLLM log says about one request."""

    request_id: str
    line: int
    body: str | None = None
    reply: str | None = None
    reply_ids: list[int] | None = None
    finish_reason: str | None = None


def _ids(text: str) -> list[int] | None:
    return None if text == "None" else json.loads(text)


def _message(line: str) -> str:
    """A log line's message: the ``message`` of a JSON-format line, else the line without colours."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return line
        return record.get("message", "") if isinstance(record, dict) else line
    return _ANSI.sub("", line)


def _parse_log(path: Path) -> tuple[list[_Request], int]:
    """The requests of a vLLM log in order of appearance, and the longest field it logged."""
    requests: list[_Request] = []
    current: dict[str, _Request] = {}  # by the id the JSON body is logged under
    longest = 0

    def request(request_id: str, lineno: int, key: str | None = None) -> _Request:
        key = key or request_id.split("-", 1)[-1]  # chatcmpl-{body id}
        found = current.get(key)
        if found is None:
            found = current[key] = _Request(request_id, lineno)
            requests.append(found)
        return found

    with path.open(encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, start=1):
            event = _EVENT.search(_message(line.rstrip("\r\n")))
            if event is None:
                continue
            if body_id := event["body_id"]:
                if body_id in current and current[body_id].reply is not None:
                    del current[body_id]  # an id used again: a new request
                found = request(body_id, lineno, key=body_id)
                found.body = event["body"]
                longest = max(longest, len(found.body))
            elif input_id := event["prompt_id"] or event["received_id"]:
                found = request(input_id, lineno)
                found.request_id = input_id
                if event["prompt_id"]:
                    text = ast.literal_eval(event["prompt"]) or ""
                    longest = max(longest, len(text), len(_ids(event["prompt_ids"]) or ()))
            elif event["ids_id"]:
                ids = _ids(event["ids"])
                found = request(event["ids_id"], lineno)
                longest = max(longest, len(ids or ()))
                if not event["ids_stream"] and found.reply is None:
                    found.reply_ids = ids
            else:
                text = ast.literal_eval(event["out"])
                finish = None if event["finish"] in ("None", "streaming_complete") else event["finish"]
                found = request(event["out_id"], lineno)
                longest = max(longest, len(text))
                if found.reply is not None:
                    continue  # choices after the first
                if "delta" in (event["stream"] or ""):
                    found.finish_reason = finish or found.finish_reason
                else:
                    found.reply, found.finish_reason = text, finish or found.finish_reason
    return requests, longest


def _vllm(path: Path, summary: LoadSummary, expected_model: str | None) -> Iterator[tuple[int, dict]]:
    requests, longest = _parse_log(path)
    missing = [
        what
        for what, logged in (
            ("request lines (--enable-log-requests)", requests),
            ("request bodies (--log-level DEBUG)", any(r.body is not None for r in requests)),
            ("replies (--enable-log-outputs)", any(r.reply is not None for r in requests)),
        )
        if not logged
    ]
    if missing:
        raise DataError(
            f"{path}: this vLLM log has no {missing[0]}; serve with --enable-log-requests "
            "--enable-log-outputs --log-level DEBUG to use its requests as training data"
        )
    for index, found in enumerate(requests):
        where = f"{found.request_id} (line {found.line})"
        if found.reply is None:  # an error, an empty reply or a request still running
            _drop(summary, "no_assistant_reply", where)
            continue
        if found.body is None:
            _drop(summary, "messages_not_logged", where)
            continue
        try:
            body = json.loads(found.body)
        except json.JSONDecodeError:
            _drop(summary, "messages_cut_by_max_log_len", where)
            continue
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            _drop(summary, "not_a_chat", where)
            continue
        if reason := _other_model(body.get("model"), expected_model):
            _drop(summary, reason, where)
            continue
        if len(found.reply) >= longest or len(found.reply_ids or ()) >= longest:
            _drop(summary, "reply_cut_by_max_log_len", where)
            continue
        reply = _reply(found.reply, found.finish_reason, found.reply_ids, summary, where)
        if reply is not None:
            yield index, {"id": found.request_id, "messages": [*body["messages"], reply]}
