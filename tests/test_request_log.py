"""Serving request logs as training data (data_prep/request_log.py): a gateway's chat JSONL and
``vllm serve --enable-log-requests --enable-log-outputs`` logs, written here by vLLM's own
RequestLogger and log formatters in the order its chat server calls them."""

import json
import logging
from contextlib import contextmanager

import pytest

from draftsmith.data_prep.chat import render_prompt
from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.sharegpt import DataError, load_conversations
from draftsmith.recipe import DataConfig
from draftsmith.target import load_tokenizer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
END_OF_TURN = "<|im_end|>\n"  # SmolLM2's template after a reply
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
SYSTEM = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime."}]
FOLLOW_UP = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _choice(content, finish="stop", **extra):
    return {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish, **extra}


def _gateway(messages, *choices, model=MODEL, id="chatcmpl-1"):
    response = {"id": id, "object": "chat.completion", "model": model, "choices": list(choices)}
    return {"request": {"model": model, "messages": messages, "max_tokens": 64}, "response": response}


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_gateway_log_gives_the_request_messages_and_choice_zero(tmp_path):
    path = _write_jsonl(
        tmp_path / "gateway.jsonl",
        [
            _gateway(ASK, _choice("4."), _choice("Four.") | {"index": 1}, id="chatcmpl-a"),
            # the flat variants: messages at the top, with the response or its choices beside them
            {"model": MODEL, "messages": SYSTEM, "response": {"id": "chatcmpl-b", "choices": [_choice("7")]}},
            {"model": MODEL, "messages": FOLLOW_UP, "choices": [_choice("Rome.")]},
        ],
    )
    conversations, summary = load_conversations(path, verbose=False, expected_model=MODEL)
    assert conversations == [
        {"id": "chatcmpl-a", "messages": ASK + [{"role": "assistant", "content": "4."}]},
        {"id": "chatcmpl-b", "messages": SYSTEM + [{"role": "assistant", "content": "7"}]},
        {"id": "line 3", "messages": FOLLOW_UP + [{"role": "assistant", "content": "Rome."}]},
    ]
    assert summary.records == 3 and not summary.dropped and not summary.repaired


def test_gateway_log_counts_each_bad_record_under_its_reason(tmp_path, capsys):
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "t", "type": "function"}]}
    path = _write_jsonl(
        tmp_path / "gateway.jsonl",
        [
            _gateway(ASK, _choice("4."), id="good"),
            '{"request": {"messages": [',  # not JSON
            {"prompt": "not a chat"},
            {"request": {"model": MODEL, "messages": ASK}, "response": {"error": {"message": "bad", "code": 400}}},
            _gateway(ASK),  # no choice
            _gateway(ASK, _choice("")),  # an empty reply
            _gateway(ASK, _choice("4."), model="other/model"),
            _gateway(ASK, _choice("2 + 2 is", finish="length")),
            _gateway(ASK, _choice("2 + 2 is", finish="length", token_ids=[17, 1232, 314]), id="open"),
            _gateway(ASK, {"index": 0, "message": tool_call, "finish_reason": "tool_calls"}),
            _gateway(ASK, {"index": 0, "message": {"role": "assistant", "content": "4"}}, id="no-finish"),
        ],
    )
    conversations, summary = load_conversations(path, expected_model=MODEL)
    assert [c["id"] for c in conversations] == ["good", "open", "no-finish"]
    # A reply cut at max_tokens keeps its own ids and stays open (no end-of-turn is added).
    assert conversations[1]["messages"][-1] == {
        "role": "assistant",
        "content": "2 + 2 is",
        "token_ids": [17, 1232, 314],
        "finished": False,
    }
    other = f"other_model 'other/model' (expected {MODEL!r})"
    assert dict(summary.dropped) == {
        "malformed_json": 1,
        "not_a_chat": 1,
        "error_response": 1,
        "no_assistant_reply": 2,
        other: 1,
        "unfinished_reply_without_token_ids": 1,
        "tool_call_reply": 1,
    }
    assert summary.examples["malformed_json"][0].startswith("line 2 ")
    assert summary.examples["not_a_chat"] == ["line 3"]
    assert summary.examples["no_assistant_reply"] == ["line 5", "line 6"]
    assert summary.examples[other] == ["line 7"]
    assert summary.repaired == {"finish_reason_not_logged_taken_as_stop": 1}
    assert summary.records == 10  # every line but the one that is not JSON
    assert f"dropped      1 {other} (e.g. line 7)" in capsys.readouterr().out

    # A log served by another model entirely: an error naming both.
    only_other = _write_jsonl(tmp_path / "other.jsonl", [_gateway(ASK, _choice("4."), model="other/model")])
    with pytest.raises(DataError, match=r"1 dropped as other_model 'other/model' \(expected 'HuggingFaceTB/"):
        load_conversations(only_other, verbose=False, expected_model=MODEL)


def test_gateway_log_tokenises_with_the_loss_on_the_assistant_turns(tokenizer, tmp_path):
    cut_ids = tokenizer("The answer is", add_special_tokens=False)["input_ids"]
    path = _write_jsonl(
        tmp_path / "gateway.jsonl",
        [
            _gateway(ASK, _choice("2 + 2 = 4."), id="a"),
            _gateway(SYSTEM, _choice("Seven is prime."), id="b"),
            _gateway(FOLLOW_UP, _choice("Rome is the capital of Italy."), id="c"),
            _gateway(ASK, _choice("The answer is", finish="length", token_ids=cut_ids), id="d"),
        ],
    )
    cfg = DataConfig(path=path, held_out_fraction=0.0, max_length=512, cache_dir=str(tmp_path / "cache"))
    data, summary = build_dataset(cfg, tokenizer, verbose=False)
    rows = {row["id"]: row for row in data["train"]}
    assert sorted(rows) == ["a", "b", "c", "d"] and summary.conversations["train"] == 4
    for id, messages, reply in [
        ("a", ASK, "2 + 2 = 4."),
        ("b", SYSTEM, "Seven is prime."),
        ("c", FOLLOW_UP, "Rome is the capital of Italy."),
    ]:
        ids, mask = rows[id]["input_ids"], rows[id]["loss_mask"]
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": reply}], tokenize=False
        )
        prompt = render_prompt(tokenizer, messages)
        assert ids[: len(prompt)] == prompt and all(mask[len(prompt) :])  # the reply and its end of turn
        # Under the loss: the assistant turns (the reply, and an earlier one the request carried), nothing else.
        earlier = [m["content"] + END_OF_TURN for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "".join(earlier + [reply + END_OF_TURN])
    # The cut-off reply ends with its own ids, under the loss, and nothing after them.
    prompt = render_prompt(tokenizer, ASK)
    assert rows["d"]["input_ids"] == prompt + cut_ids
    assert rows["d"]["loss_mask"] == [0] * len(prompt) + [1] * len(cut_ids)


# ---- vLLM's request log -------------------------------------------------------------------------


class Server:
    """The RequestLogger calls of vLLM 0.32's chat server (vllm/entrypoints/openai/chat_completion/
    serving.py), in its order: the JSON body (in ``_check_model``), the rendered prompt and
    params, then each choice's output (or a stream's deltas and its whole text)."""

    def __init__(self, tokenizer, max_log_len=None):
        from vllm.entrypoints.serve.utils.request_logger import RequestLogger

        self.logger = RequestLogger(max_log_len=max_log_len)
        self.tokenizer = tokenizer

    def receive(self, messages, model=MODEL, stream=False, header_id=None) -> str:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model=model, messages=messages, stream=stream, max_tokens=64)
        self.logger.log_request_body(request)
        request_id = f"chatcmpl-{header_id or request.request_id}"  # header_id: an X-Request-Id header
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        params = request.to_sampling_params(64, {})
        self.logger.log_inputs(request_id, prompt, ids, None, params=params, lora_request=None)
        return request_id

    def ids(self, text, finish="stop"):
        """The output's token ids: the end-of-turn token included when the target stopped on it."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")] if finish == "stop" else ids

    def reply(self, request_id, text, finish="stop"):
        self.logger.log_outputs(request_id, text, self.ids(text, finish), finish_reason=finish)

    def stream(self, request_id, text):
        for word in text.split(" "):  # the end-of-turn token's delta has no text: it is not logged
            self.logger.log_outputs(request_id, word, self.ids(word, None), None, is_streaming=True, delta=True)
        self.logger.log_outputs(request_id, text, None, "streaming_complete", is_streaming=True)


@pytest.fixture(scope="module")
def vllm_logging():
    return pytest.importorskip("vllm.logger")


def _process_name(record):
    # vLLM's log record factory adds it (vllm/logger.py); the API server's process is "APIServer".
    record.vllm_process_name = getattr(record, "vllm_process_name", "APIServer")
    return True


@contextmanager
def vllm_log(vllm_logging, path, level="DEBUG", style="text"):
    """Write what the ``vllm`` logger logs at ``level`` to ``path`` as ``vllm serve`` writes it: in
    its text format, plain or coloured (preceded by a line printed before logging is set up), or
    its JSON format (vllm/logger.py)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    if style == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(vllm_logging._JSON_FORMAT))
    else:
        from vllm.logging_utils import ColoredFormatter, NewLineFormatter

        path.write_text("Triton is installed, but doesn't include CPU backend. Disabling Triton.\n")
        spec = vllm_logging.DEFAULT_LOGGING_CONFIG["formatters"]["vllm"]
        formatter = ColoredFormatter if style == "colour" else NewLineFormatter
        handler.setFormatter(formatter(spec["format"], spec["datefmt"], log_level=level))
    handler.addFilter(_process_name)
    logger = logging.getLogger("vllm")
    old_level = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        vllm_logging.init_logger("vllm.entrypoints.openai.api_server").info("vLLM API server version 0.32.0")
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)


def _assistant(content):
    return {"role": "assistant", "content": content}


@pytest.mark.parametrize("style", ["text", "colour", "json"])
def test_vllm_log_pairs_bodies_prompts_and_outputs_by_request_id(vllm_logging, tokenizer, tmp_path, style):
    path, cut_text = tmp_path / "vllm.log", "Two is the only even"
    with vllm_log(vllm_logging, path, style=style):
        server = Server(tokenizer)
        a = server.receive(ASK)
        b = server.receive(SYSTEM, stream=True)
        c = server.receive(FOLLOW_UP)
        server.receive(ASK)  # an error response: nothing is logged after its prompt
        cut = server.receive(SYSTEM)
        tool = server.receive(ASK)
        two = server.receive(FOLLOW_UP)
        header = server.receive(ASK, header_id="client-7")  # its body is logged under another id
        server.stream(b, "Seven is prime.")
        server.reply(c, "Rome.")
        server.reply(a, "4.")
        server.reply(cut, cut_text, finish="length")
        server.reply(tool, "[tool_calls: add({'a': 2, 'b': 2})]", finish="tool_calls")
        server.reply(two, "Rome.")
        server.reply(two, "It is Rome.")  # the second choice of n=2
        server.reply(header, "4.")
    last = path.read_text().splitlines()[-1]
    if style == "json":
        assert json.loads(last)["name"] == "vllm.entrypoints.serve.utils.request_logger"
    else:
        assert ("\x1b[" in last) == (style == "colour") and "[entrypoints/.../utils/request_logger.py:" in last

    conversations, summary = load_conversations(str(path), verbose=False, expected_model=MODEL)
    cut_ids = server.ids(cut_text, None)  # a reply cut at max_tokens keeps its own ids, open
    assert conversations == [
        {"id": a, "messages": ASK + [_assistant("4.")]},
        {"id": b, "messages": SYSTEM + [_assistant("Seven is prime.")]},
        {"id": c, "messages": FOLLOW_UP + [_assistant("Rome.")]},
        {"id": cut, "messages": SYSTEM + [_assistant(cut_text) | {"token_ids": cut_ids, "finished": False}]},
        {"id": two, "messages": FOLLOW_UP + [_assistant("Rome.")]},
    ]
    # The stream's finish reason was not logged (its last delta had no text): taken as a stop.
    assert summary.repaired == {"finish_reason_not_logged_taken_as_stop": 1}
    assert dict(summary.dropped) == {"no_assistant_reply": 2, "tool_call_reply": 1, "messages_not_logged": 1}
    assert summary.examples["messages_not_logged"][0].startswith("chatcmpl-client-7 (line ")
    assert summary.records == 9  # 8 requests, the header's counted twice: its body and the rest apart


def test_vllm_log_cut_by_max_log_len_drops_what_it_cut(vllm_logging, tokenizer, tmp_path):
    long_question = [{"role": "user", "content": "Summarise this: " + "the quick brown fox " * 20}]
    long_answer = "Four. " * 60
    both, reply_only = tmp_path / "both.log", tmp_path / "reply.log"
    with vllm_log(vllm_logging, both):
        server = Server(tokenizer, max_log_len=300)
        for messages, reply in [(long_question, "Foxes."), (ASK, long_answer), (SYSTEM, "Seven.")]:
            server.reply(server.receive(messages), reply)
    # The flag cut only a reply here: no body or prompt reached 300 characters.
    with vllm_log(vllm_logging, reply_only):
        server = Server(tokenizer, max_log_len=300)
        for messages, reply in [(ASK, long_answer), (SYSTEM, "Seven.")]:
            server.reply(server.receive(messages), reply)
    assert f"output: {long_answer[:300]!r}, finish_reason: stop" in reply_only.read_text()

    conversations, summary = load_conversations(str(both), verbose=False)
    assert [c["messages"] for c in conversations] == [SYSTEM + [_assistant("Seven.")]]
    assert dict(summary.dropped) == {"messages_cut_by_max_log_len": 1, "reply_cut_by_max_log_len": 1}
    conversations, summary = load_conversations(str(reply_only), verbose=False)
    assert [c["messages"] for c in conversations] == [SYSTEM + [_assistant("Seven.")]]
    assert dict(summary.dropped) == {"reply_cut_by_max_log_len": 1}


def test_vllm_log_checks_the_model_each_request_was_for(vllm_logging, tokenizer, tmp_path):
    path = tmp_path / "vllm.log"
    with vllm_log(vllm_logging, path):
        server = Server(tokenizer)
        server.reply(server.receive(ASK, model="other-model"), "4.")
        ours = server.receive(SYSTEM)
        server.reply(ours, "Seven.")
    conversations, summary = load_conversations(str(path), verbose=False, expected_model=MODEL)
    assert [c["id"] for c in conversations] == [ours]
    assert dict(summary.dropped) == {f"other_model 'other-model' (expected {MODEL!r})": 1}
    assert len(load_conversations(str(path), verbose=False)[0]) == 2  # no expected model: both
    with pytest.raises(DataError, match=r"other_model 'other-model' \(expected 'my/model'\)"):
        load_conversations(str(path), verbose=False, expected_model="my/model")


@pytest.mark.parametrize(
    "level, outputs, flag",
    [
        ("INFO", True, "request bodies (--log-level DEBUG)"),
        ("DEBUG", False, "replies (--enable-log-outputs)"),
        ("DEBUG", None, "request lines (--enable-log-requests)"),
    ],
)
def test_vllm_log_without_what_it_needs_says_which_flag(vllm_logging, tokenizer, tmp_path, level, outputs, flag):
    path = tmp_path / "vllm.log"
    with vllm_log(vllm_logging, path, level=level):
        if outputs is not None:  # None: served without --enable-log-requests, no request is logged
            server = Server(tokenizer)
            request_id = server.receive(ASK)
            if outputs:
                server.reply(request_id, "4.")
    with pytest.raises(DataError) as error:
        load_conversations(str(path), verbose=False)
    assert str(error.value) == (
        f"{path}: this vLLM log has no {flag}; serve with --enable-log-requests --enable-log-outputs "
        "--log-level DEBUG to use its requests as training data"
    )
