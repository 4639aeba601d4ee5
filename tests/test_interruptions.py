"""Every long stage survives SIGKILL at a random point: the same command run again resumes or
restarts and leaves exactly what an uninterrupted run leaves, byte for byte (a safetensors header
as a dict: its metadata order varies between writers; training's wall time aside), with no staging
debris (half-written temporary files or folders) beside it.

One helper drives every stage: run the command uninterrupted (in this process) and snapshot its
outputs, clear them, start the command in a subprocess and SIGKILL it once it has made a random
amount of progress on disk (files written, lines appended, checkpoints started) plus a random
delay, so the kill lands inside a write or between two; run the command again (in this process)
and compare snapshots. The kill point and the seed that drew it are in every failure message
(``DRAFTSMITH_KILL_SEED=N`` replays one). Tiny random-weight target, one thread: a few seconds
per stage, most of it the killed subprocess's imports.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prepare_stages import main as prepare
from training_helpers import REPO, save_tiny_target, write_recipe

from draftsmith.atomic import SUFFIX, staged
from draftsmith.data_prep.regenerate import main as regenerate_main
from draftsmith.export.cli import main as export_main
from draftsmith.target import load_tokenizer
from draftsmith.train.checkpoints import checkpoints
from draftsmith.train.eagle import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6  # training steps (two epochs of 3); a checkpoint after each


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny target that says something (weights x 8), with the bundled tokenizer."""
    return save_tiny_target(tmp_path_factory.mktemp("target") / "tiny", load_tokenizer("default"), scale=8.0)


@pytest.fixture
def rng(request) -> random.Random:
    """The kill points' source; its seed is reported so a failure can be replayed."""
    seed = int(os.environ.get("DRAFTSMITH_KILL_SEED", time.time_ns() % 2**32))
    request.node.kill_seed = seed
    return random.Random(seed)


# ---------------------------------------------------------------------------------------------
# Run, kill at a random point, rerun, compare


def _content(path: Path):
    """A file's bytes; a safetensors file's header as a dict and its tensor bytes (safetensors
    writes metadata from a hash map, in an order that varies between writers). A file still in its
    stage (a kill's debris, maybe half written) is its bytes."""
    raw = path.read_bytes()
    if path.suffix != ".safetensors" or path.parent.name.endswith(SUFFIX):
        return raw
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def files(roots: list[Path]) -> dict[str, object]:
    """Every file under ``roots``, hidden ones included (a leftover temporary file is a difference)."""
    return {
        str(p.relative_to(root.parent)): _content(p) for root in roots for p in sorted(root.rglob("*")) if p.is_file()
    }


def count_files(root: Path) -> int:
    """Files under ``root`` while a writer renames folders in it (``os.walk`` skips a vanished one)."""
    return sum(len(names) for _, _, names in os.walk(root))


def _kill_at(command: list[str], progress: Callable[[], int], point: int, delay: float, log: Path) -> bool:
    """Start ``command``; once ``progress() >= point``, wait ``delay`` seconds and SIGKILL it (and
    its children). True if it was killed, False if it finished first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # the numerics of this process's one thread
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if progress() >= point:
                time.sleep(delay)
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.0005)
        else:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"{command} made no progress to {point} in 120 s:\n{log.read_text()[-3000:]}")
    finally:
        proc.wait()
    if proc.returncode not in (0, -signal.SIGKILL):
        pytest.fail(f"{command} failed before the kill:\n{log.read_text()[-3000:]}")
    return proc.returncode == -signal.SIGKILL


def interrupted_run_equals_uninterrupted(
    request,
    rng: random.Random,
    command: list[str],
    run: Callable[[], object],
    outputs: list[Path],
    progress: Callable[[], int],
    max_delay: float,
    snapshot: Callable[[list[Path]], dict] = files,
) -> str:
    """Run ``run`` (``command`` in this process) uninterrupted and snapshot ``outputs``; clear them;
    start ``command`` and SIGKILL it at a random ``progress()`` short of the uninterrupted run's
    final value, plus a random delay of up to ``max_delay`` s; run ``run`` again and assert the
    snapshot is the uninterrupted one. Returns where the kill landed."""
    run()
    want, final = snapshot(outputs), progress()
    assert final >= 2, f"the stage made too little progress ({final}) to be killed midway"
    log = request.getfixturevalue("tmp_path") / "killed.log"
    for attempt in range(3):  # a kill point the process ran past (it finished) is drawn again
        for root in outputs:
            shutil.rmtree(root, ignore_errors=True)
        point, delay = rng.randint(1, final - 1), rng.uniform(0, max_delay)
        where = f"killed at progress {point} + {delay * 1000:.0f} ms (seed {request.node.kill_seed}, attempt {attempt})"
        if _kill_at(command, progress, point, delay, log):
            break
    else:
        pytest.fail(f"the process finished before every kill: {where}")
    interrupted = snapshot(outputs)
    run()
    got = snapshot(outputs)
    assert sorted(got) == sorted(want), f"{where}; left after the kill: {sorted(interrupted)}"
    assert [name for name in want if got[name] != want[name]] == [], where
    return where


# ---------------------------------------------------------------------------------------------
# The stages

WRITER = """
import sys, time
from draftsmith.atomic import staged
with staged(sys.argv[1]) as stage:
    stage.write_text("half")
    (stage.parent / ".tmpAbC123").write_text("a library's own temporary, as safetensors leaves one")
    print(stage, flush=True)
    time.sleep(60)
"""


def test_a_killed_writers_stage_is_removed_and_a_live_ones_kept(tmp_path):
    """Two writers stage the same file; one is killed mid-write: the next writer removes its
    stage (SIGKILL ran no clean-up), temporaries a library made beside the file included, leaves
    the live one's alone, and its own rename wins."""
    path = tmp_path / "shard.safetensors"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        killed, live = (Path(w.stdout.readline().strip()) for w in writers)
        writers[0].kill()
        writers[0].wait()
        with staged(path) as stage:
            stage.write_text("whole")
        assert path.read_text() == "whole"
        # The killed writer's stage went whole, what its library wrote beside the file with it.
        assert not killed.parent.exists() and live.read_text() == "half"
        assert sorted(tmp_path.iterdir()) == sorted([path, live.parent])
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()


def test_tokenising(request, rng, target, tmp_path):
    cache = tmp_path / "data"
    argv = [str(target), str(cache), "48"]
    interrupted_run_equals_uninterrupted(
        request,
        rng,
        [sys.executable, "tests/prepare_stages.py", *argv],
        lambda: prepare(argv),
        [cache],
        lambda: count_files(cache),
        max_delay=0.005,
    )


def test_feature_extraction(request, rng, target, tmp_path):
    cache, features = tmp_path / "data", tmp_path / "features"
    prepare([str(target), str(cache), "24"])  # tokenised once: the kill lands in the extraction
    argv = [str(target), str(cache), "24", str(features)]
    where = interrupted_run_equals_uninterrupted(
        request,
        rng,
        [sys.executable, "tests/prepare_stages.py", *argv],
        lambda: prepare(argv),
        [features],
        lambda: count_files(features),
        max_delay=0.005,
    )
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["splits"]["train"]["shards"] >= 5, (manifest, where)


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory) -> Path:
    """A tiny target vLLM's CPU attention takes (head size 32)."""
    from draftsmith.vllm_engine import why_unavailable

    if why_unavailable():
        pytest.skip(why_unavailable())
    return save_tiny_target(
        tmp_path_factory.mktemp("target") / "tiny128", load_tokenizer("default"), hidden_size=128, scale=8.0
    )


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_regeneration(request, rng, engine, tmp_path):
    """Sampled (temperature 1, seeded), batches of 2: resumed batches draw what uninterrupted ones
    did. vLLM runs in a child process of the killed one: the whole process group is killed."""
    target = request.getfixturevalue("target" if engine == "hf" else "vllm_target")
    out = tmp_path / "regen" / "regen.jsonl"
    argv = [
        "--target",
        str(target),
        "--dtype",
        "float32",
        "--limit",
        "12",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--temperature",
        "1",
        "--engine",
        engine,
        "--out",
        str(out),
    ]

    def lines() -> int:
        return out.read_bytes().count(b"\n") if out.exists() else 0

    interrupted_run_equals_uninterrupted(
        request,
        rng,
        [sys.executable, "data_prep/regenerate.py", *argv],
        lambda: regenerate_main(argv),
        [out.parent],
        lines,
        max_delay=0.05,
    )


def _checkpoint_started(out: Path) -> int:
    """The latest checkpoint being written or written under ``out`` (final: ``STEPS + 1``)."""
    found = [re.fullmatch(r"\.?checkpoint-(\d+|final)(\.tmp)?", p.name) for p in out.glob("*checkpoint-*")]
    return max([0] + [STEPS + 1 if m[1] == "final" else int(m[1]) for m in found if m])


def _training_outputs(roots: list[Path]) -> dict:
    """The files of a run, ``trainer_state.json`` without its wall time and ``log_history.jsonl``
    without its throughputs and wall times (the interrupted run's logs must read as the uninterrupted
    one's)."""
    snapshot = files(roots)
    for name in [n for n in snapshot if n.endswith("trainer_state.json")]:
        state = json.loads(snapshot[name])
        state.pop("seconds")
        snapshot[name] = state
    for name in [n for n in snapshot if n.endswith("log_history.jsonl")]:
        entries = [json.loads(line) for line in snapshot[name].splitlines()]
        timing = ("train/tokens_per_second", "seconds")
        snapshot[name] = [{k: v for k, v in e.items() if k not in timing} for e in entries]
    return snapshot


def test_training(request, rng, target, tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path, target, {"num_layers": 1}, learning_rate=1e-3, max_steps=STEPS, save_every=1, log_every=1
    )
    argv = [str(recipe), "--output_dir", str(out), "--resume"]
    runs = []  # (the newest complete checkpoint's step before the run, the finished trainer)

    def run():
        found = checkpoints(out)
        runs.append((int(found[-1].name.removeprefix("checkpoint-")) if found else 0, train_main(argv)))

    where = interrupted_run_equals_uninterrupted(
        request,
        rng,
        [sys.executable, "train/eagle.py", *argv],
        run,
        [out],
        lambda: _checkpoint_started(out),
        max_delay=0.2,
        snapshot=_training_outputs,
    )
    # No step trained twice or skipped: the rerun trained exactly the steps after the checkpoint it found.
    resumed, trainer = runs[1]
    assert [h["step"] for h in trainer.history if "train/loss" in h] == list(range(resumed + 1, STEPS + 1)), where
    assert trainer.state.step == STEPS and trainer.state.tokens == runs[0][1].state.tokens


def test_export(request, rng, target, tmp_path):
    # No held-out split: a head without recorded accuracy exports the fixed tree, where a planned one
    # would differ between the two runs compared here by its measured timings.
    recipe = write_recipe(
        tmp_path, target, {"num_layers": 1}, data={"held_out_fraction": 0.0}, max_steps=1, save_every=0
    )
    checkpoint = train_main([str(recipe), "--output_dir", str(tmp_path / "run")]).last_checkpoint
    out = tmp_path / "exports" / "sglang"
    argv = [str(checkpoint), "--format", "sglang", "--out", str(out)]

    def run():
        complete = out.exists()  # killed after its rename: the export is whole, and the rerun refuses to overwrite it
        try:
            export_main(argv)
        except SystemExit as refused:
            assert complete and refused.code == 2

    interrupted_run_equals_uninterrupted(
        request,
        rng,
        [sys.executable, "-m", "draftsmith.export.cli", *argv],
        run,
        [out.parent],
        lambda: count_files(out.parent),
        max_delay=0.005,
    )
