"""core/vllm_engine.py's jobs: a child forked from the preloaded fork server computes what a fresh
child does, and a failing job is one error naming its cause either way (and leaves the server able
to run the next job); the ``import vllm`` probe runs once per install, not once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gate_helpers import needs_vllm
from training_helpers import save_tiny_target

import draftsmith.vllm_engine as vllm_engine
from draftsmith.target import load_tokenizer
from draftsmith.vllm_engine import PRELOAD_ENV, EngineError, engine_args, run_job, vllm_version

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    # Hidden 128 and 4 heads: head size 32, which vLLM's CPU attention takes.
    folder = tmp_path_factory.mktemp("target")
    return save_tiny_target(folder, load_tokenizer("default"), hidden_size=128, layers=2, scale=8.0)


@pytest.mark.slow
def test_a_forked_job_generates_what_a_fresh_child_does(tiny_target, monkeypatch):
    prompts = [[1, 422, 1789, 30], [1, 6003, 28, 540, 314, 3619]]
    job = {"task": "generate", "prompts": prompts, "max_new_tokens": 16, "engine": engine_args(str(tiny_target))}
    results = {}
    for preload in ("0", "1"):
        monkeypatch.setenv(PRELOAD_ENV, preload)
        results[preload] = run_job(job, f"preload={preload}")
    tokens = {preload: [o["tokens"] for o in r["outputs"]] for preload, r in results.items()}
    assert tokens["0"] == tokens["1"]
    assert [len(t) for t in tokens["1"]] == [16, 16]  # no stop token given: every reply runs its length
    assert results["1"]["version"] == results["0"]["version"]


@pytest.mark.parametrize("preload", ["0", "1"])
def test_a_failing_job_names_its_cause_and_the_next_job_runs(preload, tiny_target, monkeypatch, capfd):
    monkeypatch.setenv(PRELOAD_ENV, preload)
    with pytest.raises(EngineError) as failed:
        run_job({"task": "draftsmith.no_such_module:job"}, "the broken job")
    message = str(failed.value)
    assert message.startswith("the broken job: vLLM failed (exit code 1): ModuleNotFoundError: ")
    assert "draftsmith.no_such_module" in message
    assert "Traceback" in capfd.readouterr().err  # the child's log, shown because the job failed
    if preload == "1":  # the fork server outlives its failed child and runs the next job
        job = {"task": "generate", "prompts": [[1, 422]], "max_new_tokens": 4, "engine": engine_args(str(tiny_target))}
        assert len(run_job(job, "the next job")["outputs"][0]["tokens"]) == 4


# A fresh process that reads vLLM's version with no way to start a probe (a probe would raise).
NO_PROBE = (
    "import subprocess; subprocess.run = None; from draftsmith.vllm_engine import vllm_version; print(vllm_version())"
)


def test_a_passed_import_probe_is_recorded_and_later_processes_skip_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    vllm_engine._import_failure.cache_clear()  # this process's probe, run again under the new cache
    try:
        version = vllm_version()
    finally:
        vllm_engine._import_failure.cache_clear()
    assert version is not None and len(list((tmp_path / "vllm-import-probes").iterdir())) == 1
    later = subprocess.run([sys.executable, "-c", NO_PROBE], capture_output=True, text=True)
    assert (later.returncode, later.stdout.strip()) == (0, version), later.stderr[-2000:]
