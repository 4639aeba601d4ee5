"""Data preparation runs once under ``accelerate launch``: the main process regenerates, tokenises
and extracts features while the others wait and then read the cache.

A two-process gloo run from a cold cache must leave exactly what a one-process run leaves: the
same regenerated JSONL (no conversation written twice), the same feature shards and the same
token counts (the reduced draft vocabulary chosen from them); its two replicas then train alike
(the suite's DDP training check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import check_two_replicas, launch, save_tiny_target, write_recipe
from transformers import LlamaForCausalLM

from draftsmith.target import load_tokenizer
from draftsmith.train.eagle import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prep")
    folder = save_tiny_target(root / "target", load_tokenizer("default"))
    target = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # at its init scale the tiny target only says newlines: make it talk
        for name, param in target.named_parameters():
            if "norm" not in name:
                param.mul_(8)
    target.save_pretrained(folder)
    return write_recipe(
        root,
        folder,
        {"num_layers": 1, "features": "offline", "draft_vocab_size": 64},
        data={"limit": 10, "regenerate": {"enabled": True, "max_new_tokens": 6, "batch_size": 4}},
        max_steps=1,
        learning_rate=1e-3,
    )


def _outputs(cache: Path, out: Path) -> dict:
    # One of each: processes racing to fetch the data first disagreed on its cache keys.
    regenerated, features = sorted((cache / "regenerated").glob("*.jsonl")), sorted((cache / "features").iterdir())
    assert len(regenerated) == len(features) == 1, (regenerated, features)
    regenerated, features = regenerated[0], features[0]
    shards = {str(p.relative_to(features)): load_file(str(p)) for p in sorted(features.rglob("shard-*.safetensors"))}
    return {
        "regenerated": regenerated.read_text(),
        "shards": shards,
        "manifest": json.loads((features / "manifest.json").read_text()),
        "leftovers": sorted(str(p) for p in cache.rglob("*.tmp")),
        "draft_vocab": load_file(str(out / "checkpoint-final" / "model.safetensors"))["draft_vocab"],
    }


@pytest.fixture(scope="module")
def one_process(recipe, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("one")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(root / "cache"))
        main([str(recipe), "--output_dir", str(root / "out"), "--data.cache_dir", str(root / "data")])
    return _outputs(root / "cache", root / "out")


# ZeRO-3 also partitions models loaded while an Accelerator exists: data preparation must not
# run under one, or the waiting processes deadlock the main one's from_pretrained.
@pytest.mark.parametrize(
    "backend", [[], ["--distributed.backend", "deepspeed", "--distributed.zero_stage", "3"]], ids=["ddp", "zero3"]
)
def test_two_processes_from_a_cold_cache_prepare_what_one_process_does(
    recipe, one_process, backend, tmp_path, monkeypatch
):
    one = one_process
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache2"))
    proc = launch(
        "train/eagle.py",
        recipe,
        tmp_path / "out2",
        "--data.cache_dir",
        str(tmp_path / "data2"),
        "--training.max_steps",
        "2",
        *backend,
        cpu=not backend,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = _outputs(tmp_path / "cache2", tmp_path / "out2")
    if not backend:  # DDP over gloo trained both replicas alike (test_eagle_training checks ZeRO-2's)
        check_two_replicas(tmp_path / "out2", recipe.parent / "target", 2)
        assert (tmp_path / "out2" / "checkpoint-final" / "state" / "model.safetensors").is_file()

    ids = [json.loads(line)["id"] for line in two["regenerated"].splitlines()]
    assert len(ids) == len(set(ids)) > 0  # every conversation written once
    assert two["regenerated"] == one["regenerated"]
    assert two["manifest"] == one["manifest"] and two["shards"].keys() == one["shards"].keys()
    for name, tensors in one["shards"].items():
        for key, value in tensors.items():
            assert torch.equal(two["shards"][name][key], value), (name, key)
    assert torch.equal(two["draft_vocab"], one["draft_vocab"])
    assert one["leftovers"] == two["leftovers"] == []
    # The main process regenerated; the other one waited and found the file complete (no generator started).
    assert proc.stdout.count(f"'written': {len(ids)}, 'skipped': 0") == 1
    assert proc.stdout.count("(hf): complete") == 1


def test_the_other_processes_outwait_the_default_group_timeout(tmp_path):
    """Regenerating a dataset takes hours where a barrier of the default group gives up after 10
    (NCCL) or 30 minutes; scaled down: a 15 s preparation against a 10 s default timeout."""
    proc = launch("tests/long_preparation.py", tmp_path / "marker", tmp_path / "unused", cpu=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT ")) == [
        "RESULT 0 prepared",
        "RESULT 1 prepared",
    ]
