"""bench/gpu_suite.py at toy size on the CPU, run as the GPU machine runs it: two calls, the first
carrying one part of a bundled asset (the stages that need the target wait), the second the rest
(joined, checked and placed; the first call's stage is not run again). So the prepared GPU run
cannot rot between the rare occasions a GPU is lent. And bench/gpu_parts.py's cut and join,
which refuse a missing or corrupt part."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from training_helpers import save_tiny_target

from draftsmith.assets import asset_path
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.target import load_tokenizer

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the bench scripts import one another as the device runs them
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cut_and_join_round_trip_and_refuse_bad_parts(tmp_path):
    parts = _bench_module("gpu_parts")
    whole = tmp_path / "model.bin"
    whole.write_bytes(bytes(range(256)) * 41)  # 10,496 bytes: three parts of at most 4,000
    small = tmp_path / "config.json"
    small.write_text("{}")
    first, second, joined = tmp_path / "call1", tmp_path / "call2", tmp_path / "joined"
    written = parts.cut(whole, first, 4000, first=0, last=0)
    assert [p.name for p in written] == ["model.bin.parts.json", "model.bin.part0"]
    assert [p.name for p in parts.cut(whole, second, 4000, first=1)][1:] == ["model.bin.part1", "model.bin.part2"]
    parts.cut(small, second, 4000)  # within the bound: copied whole
    with pytest.raises(parts.PartsError, match="lacks model.bin.part1, model.bin.part2"):
        parts.join(first, joined)
    for path in second.iterdir():
        shutil.copyfile(path, first / path.name)
    assert sorted(p.name for p in parts.join(first, joined)) == ["config.json", "model.bin"]
    assert (joined / "model.bin").read_bytes() == whole.read_bytes()
    # A truncated part: refused, and the command says so in one line with exit code 2.
    (first / "model.bin.part1").write_bytes((first / "model.bin.part1").read_bytes()[:-1])
    with pytest.raises(parts.PartsError, match="join to other bytes"):
        parts.join(first, tmp_path / "again")
    run = subprocess.run(
        [sys.executable, str(BENCH / "gpu_parts.py"), "join", str(first), str(tmp_path / "again")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "model.bin" in run.stderr
    assert not (tmp_path / "again" / "model.bin").exists()


@pytest.mark.slow
def test_the_suite_runs_as_two_device_calls(tmp_path, monkeypatch):
    suite, parts, pack = _bench_module("gpu_suite"), _bench_module("gpu_parts"), _bench_module("gpu_pack")
    questions = asset_path("mt_bench")  # from the usual cache, before the suite gets a cache of its own
    target = save_tiny_target(tmp_path / "target", load_tokenizer("default"), hidden_size=64, layers=3, scale=4.0)
    data = tmp_path / "conversations.jsonl.xz"
    assert pack.write_conversations(data, "sharegpt", 12) == 12
    # The device's cache starts empty: MT-bench's questions arrive in two parts, one per call.
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    half = questions.stat().st_size // 2 + 1
    carried = tmp_path / "parts"
    parts.cut(questions, carried, half, first=0, last=0)
    parts.cut(questions, tmp_path / "call2", half, first=1)
    monkeypatch.setattr(suite, "PART_BYTES", 200_000)  # the head comes back in parts too
    out = tmp_path / "out"
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--target", str(target), "--data", str(data)]
    argv += ["--work", str(tmp_path / "work"), "--out", str(out), "--parts", str(carried), "--table-minutes", "0.01"]
    # The suite trains in this process, as on the device: an earlier in-process run's mixed precision must not stay.
    AcceleratorState._reset_state(reset_partial_state=True)

    first = suite.main(argv)
    assert first["identity"]["ok"] and all(row["lossless"] for row in first["identity"]["decoding"].values())
    decoding = first["identity"]["decoding"]
    assert {"plain", "eagle", "eagle3", "peagle_2_layers", "dflash_learned_mask", "dspark", "medusa"} <= set(decoding)
    # static shapes on a CPU: no graph is captured, and none failed
    assert all(r["cuda_graphs"] == 0 and r["cuda_graph_failure"] is None for r in decoding.values())
    for stage in ("train", "table", "profile"):
        assert "question.jsonl.part1" in first[stage]["waiting"] and "done" not in first[stage]
    assert "## train: waiting" in (out / "suite.md").read_text()

    for path in (tmp_path / "call2").iterdir():
        shutil.copyfile(path, carried / path.name)
    second = suite.main(argv)
    assert second["identity"]["wall_seconds"] == first["identity"]["wall_seconds"]  # done: not run again
    train = second["train"]
    assert train["done"] and train["steps"] == 4 and len(train["evals"]) == 2
    assert len(train["held_out_top1_per_depth"]) == 3 and len(train["learning_curve"]) == 4
    assert train["supervised_tokens"] > 0
    table = second["table"]
    methods = {"baseline", "prompt_lookup", "eagle3", "hybrid", "hf_plain", "hf_prompt_lookup"}
    for temperature in ("t0", "t1"):
        assert methods <= set(table[temperature]["methods"]) and table[temperature]["meta"]["device"] == "cpu"
        assert 1 <= table[temperature]["meta"]["prompts"] < table[temperature]["meta"]["prompts_asked"] == 8
    # fp32 greedy: every method verified by the target gives plain decoding's text.
    assert all(row["same_output"] == 1.0 for row in table["t0"]["methods"].values())
    profile = second["profile"]
    for graphs in ("off", "on"):
        planned = list(profile[f"pass_cost_ms_planned_graphs_{graphs}"].values())
        assert len(planned) == 8 and planned == sorted(planned)
    names = {"plain", *(m.split("?name=")[-1].split(":")[0] for m in table["methods"])}
    assert set(profile["step_phases"]) == {f"{n}_graphs_{g}" for n in names for g in ("off", "on")}
    assert all(p["host_ms_per_step"]["target_forward"] > 0 for p in profile["step_phases"].values())
    assert "| plain, on |" in (out / "suite.md").read_text()
    step = profile["training_step"]  # an optimiser step of the train stage's recipe, profiled
    assert step["real_tokens"] > 0 and step["wall_ms_per_step"] > 0 and len(step["top_ops_ms_per_step"]) == 12
    assert step["host_syncs_per_step"] >= 1  # the loss's metrics are read back every step

    # The head came back in parts within the bound and joins into the trained checkpoint.
    head = Path(train["head"])
    assert max(p.stat().st_size for p in (out / "head").iterdir()) <= 200_000
    joined = parts.join(out / "head", tmp_path / "head")
    assert {p.name for p in joined} == {"config.json", "model.safetensors"}
    assert (tmp_path / "head" / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    assert Eagle3Head.from_pretrained(tmp_path / "head").depth_accuracy == train["held_out_top1_per_depth"]
    assert json.loads((out / "suite.json").read_text())["table"]["done"]

    # A call with too little of its time left for the table or the profile leaves it to the next call.
    third = suite.main([*argv, "--stages", "table,profile", "--force", "--call-minutes", "0.5"])
    for stage in ("table", "profile"):
        assert "--call-minutes 0.5 left" in third[stage]["waiting"] and "done" not in third[stage]
