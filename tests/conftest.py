"""Shared fixtures: the bundled SmolLM2 target (loaded once per worker), tiny random-weight models,
and the vLLM tests' trained EAGLE-3 head (trained once per run, whichever worker asks first).

``make test`` runs the suite on two pytest-xdist workers, a test file to a worker (``--dist
loadfile``: module fixtures are built once); each worker's torch gets its share of the cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.target import load_target
from draftsmith.vllm_engine import PRELOAD_ENV

# Every vLLM job already runs in a child process of its own (core/vllm_engine.py): its engine core
# can run in that process rather than in a third one, which saves the third's start (imports, a
# second torch) on each of the suite's few dozen vLLM starts: a tiny target's 4-prompt job took
# 40-60 s instead of 83-97 s on a 2-core CI machine. Outputs and counters are the same either way.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# And each job's child is forked from a server that imported vLLM once per worker
# (core/vllm_engine.py's fork server): ~17 s less per job here (a tiny target's job: 13 s, not 30-38 s).
os.environ.setdefault(PRELOAD_ENV, "1")

# Two workers with torch's default of a thread per core would run 2x oversubscribed: tiny models'
# ops then stall on each other (see ``one_thread``). The processes a worker starts (vLLM jobs, the
# commands run as a user types them) get the same share: a tiny target's vLLM generation beside a
# busy core took 8.7 s with two OpenMP threads, 2.8 s with one.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def build_once(tmp_path_factory, name: str, build) -> dict:
    """``build(folder)`` run once per test run by whichever xdist worker asks first (the others wait
    for it, then read what it returned): for session fixtures that train. ``build`` returns a dict
    of paths and JSON values; paths come back as paths."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by the run's workers
    folder, record = root / name, root / f"{name}.json"
    with FileLock(f"{folder}.lock"):
        if not record.is_file():
            folder.mkdir()
            built = build(folder)
            paths = {key: str(value) for key, value in built.items() if isinstance(value, Path)}
            values = {key: value for key, value in built.items() if not isinstance(value, Path)}
            record.write_text(json.dumps({"paths": paths, "values": values}))
    saved = json.loads(record.read_text())
    return {**saved["values"], **{key: Path(value) for key, value in saved["paths"].items()}}


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct in fp32 on the CPU, with its tokenizer."""
    model, tokenizer = load_target("default", dtype="float32", device="cpu")
    return model, tokenizer


def tiny_llama(
    vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, seed: int = 0, scale: float = 1.0
) -> LlamaForCausalLM:
    """A random-weight Llama small enough for exhaustive or statistical tests.

    At the default init (std 0.02) such a model is nearly uniform and context-blind, so greedy
    decoding repeats one token; ``scale`` multiplies every weight except the norms (10-20 gives
    peaked, context-dependent distributions and varied greedy text).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.mul_(scale)
    return model


@pytest.fixture(scope="session")
def make_tiny_llama():
    """``tiny_llama`` as a fixture: with ``--import-mode=importlib`` tests cannot import conftest."""
    return tiny_llama


def pair_target() -> LlamaForCausalLM:
    """The statistical tests' target: 8 tokens, peaked (weights x 15)."""
    return tiny_llama(vocab_size=8, hidden_size=32, layers=1, seed=0, scale=15.0)


def pair_draft() -> LlamaForCausalLM:
    """A draft unrelated to ``pair_target`` (other seed, flatter): many rejections, some acceptances."""
    return tiny_llama(vocab_size=8, hidden_size=32, layers=1, seed=1, scale=8.0)


@pytest.fixture(scope="session")
def tiny_pair_target():
    """:func:`pair_target`, once per worker."""
    return pair_target()


@pytest.fixture(scope="session")
def tiny_pair_draft():
    """:func:`pair_draft`, once per worker."""
    return pair_draft()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for tiny models: their ops are all overhead, and two threads on two
    busy cores stall (10-100x slower) on oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def gate_eagle3(tmp_path_factory):
    """The vLLM tests' tiny target (4 layers, hidden 128: head size 32, which vLLM's CPU attention
    takes) with the bundled tokenizer, its own replies to 16 ShareGPT prompts (``data`` regenerates
    them into ``regenerated``; ``prompts`` holds their first user turns), and an EAGLE-3 head trained
    on them for 400 steps at a constant learning rate with a checkpoint every 20 steps (``run``;
    ``last`` is its final checkpoint).

    Trained once for test_serve_check (the 400-step head; checkpoint-20 as its weak one) and
    test_vllm_reload (checkpoints 20 and 60 as its rounds): at a constant learning rate the
    checkpoint of step n is the head a run of n steps ends with, bit for bit.
    """
    return build_once(tmp_path_factory, "gate-eagle3", _train_gate_eagle3)


def _train_gate_eagle3(root: Path) -> dict:
    from gate_helpers import gate_recipe
    from training_helpers import save_tiny_target

    from draftsmith.target import load_tokenizer
    from draftsmith.train.eagle3 import main as train_eagle3

    target = save_tiny_target(root / "target", load_tokenizer("default"), hidden_size=128, layers=4, scale=8.0)
    regenerated = root / "regenerated.jsonl"
    data = {
        "limit": 16,
        "max_length": 160,
        "held_out_fraction": 0.1,
        "regenerate": {"enabled": True, "max_new_tokens": 64, "output": str(regenerated)},
    }
    (root / "e3").mkdir()
    recipe = gate_recipe(
        root / "e3",
        {"target": target, "data": data},
        # Every position trained, as when test_serve_check's negative controls were sized on this head.
        {"aux_layers": [0, 1, 2], "ttt_steps": 3, "draft_vocab_size": 2048, "down_sample_ratio": 1.0},
        max_steps=400,
        log_every=100,
        save_every=20,
        keep_checkpoints=0,
    )
    last = Path(train_eagle3([str(recipe), "--output_dir", str(root / "run")]).last_checkpoint)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as out:  # the conversations the head was trained on: it accepts there
        for line in regenerated.read_text().splitlines():
            messages = json.loads(line)["messages"]
            out.write(json.dumps({"prompt": next(m["content"] for m in messages if m["role"] == "user")}) + "\n")
    return {
        "target": target,
        "data": data,
        "regenerated": regenerated,
        "prompts": prompts,
        "run": root / "run",
        "last": last,
    }


@pytest.fixture(scope="session")
def gate_heads(gate_eagle3, tmp_path_factory):
    """The export gate's drafters on ``gate_eagle3``'s target, trained once per run: ``eagle3`` (its
    400-step head), ``weak`` (its checkpoint-20, for the negative controls), ``medusa`` (3 heads,
    150 steps) and ``draft_lm`` (the target's layers moved a little), with ``target``, ``prompts``
    (the conversations they were trained on: they accept there) and ``data``."""
    return build_once(tmp_path_factory, "gate-heads", lambda root: _train_gate_heads(root, gate_eagle3))


def _train_gate_heads(root: Path, gate_eagle3: dict) -> dict:
    from training_helpers import write_recipe
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.draft_lm import derive_draft_lm, save_draft_lm
    from draftsmith.target import load_tokenizer, target_record
    from draftsmith.train.medusa import main as train_medusa

    tokenizer = load_tokenizer("default")
    target_dir, data = gate_eagle3["target"], gate_eagle3["data"]
    (root / "m").mkdir()
    medusa = write_recipe(
        root / "m",
        target_dir,
        {"num_heads": 3, "num_layers": 1, "lm_head": "shared", "draft_vocab_size": None},
        data=data,  # its regenerated file is written already: read, not generated again
        learning_rate=1e-2,
        lr_schedule="constant",
        max_steps=150,
        log_every=100,
        eval_every=1000,
    )
    checkpoints = {
        "eagle3": gate_eagle3["last"],
        "medusa": Path(train_medusa([str(medusa), "--output_dir", str(root / "m-run")]).last_checkpoint),
        "weak": gate_eagle3["run"] / "checkpoint-20",
    }
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    # The target's layers moved a little (embeddings kept): it agrees with the target often, not always.
    draft = derive_draft_lm(target, layers=[0, 1, 2, 3])
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" not in name and "embed" not in name:
                param.add_(0.005 * torch.randn_like(param))
    # Saved as train/distill.py saves it: with the training replies' token counts beside the weights.
    counts = torch.bincount(torch.randint(0, target.config.vocab_size, (4096,)), minlength=target.config.vocab_size)
    save_draft_lm(draft, root / "draft", tokenizer, target_record(target, str(target_dir)), counts=counts)
    checkpoints["draft_lm"] = root / "draft"
    return {"target": target_dir, "prompts": gate_eagle3["prompts"], "data": data, **checkpoints}


# Measured seconds per test file (tests/file_seconds.json, from bench/file_seconds.py): xdist hands out whole files
# in collection order (a first batch of several to each worker, then one at a time), so the longest
# are collected first. A balance only: a worker's first batch is fixed before any file's time is known.
FILE_SECONDS = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
# Files that wait for test_serve_check's build of the gate's heads (build_once): started with it,
# a second worker would sit idle until that build is done.
GATE_FOLLOWERS = {"test_serve_check_controls.py", "test_vllm_reload.py"}
LEADERS = 4  # the longest files that start before the followers


def pytest_collection_modifyitems(config, items):
    """Longest files first (a file's tests keep their order), the gate's followers after the leaders."""
    seconds = {item.path.name: FILE_SECONDS.get(item.path.name, 0) for item in items}
    leaders = sorted((s for name, s in seconds.items() if name not in GATE_FOLLOWERS), reverse=True)[:LEADERS]
    cap = min(leaders, default=0) - 1
    key = {name: min(s, cap) if name in GATE_FOLLOWERS else s for name, s in seconds.items()}
    items.sort(key=lambda item: -key[item.path.name])
