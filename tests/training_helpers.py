"""Helpers for training tests: tiny random-weight Llama targets saved to folders (sharing the
bundled SmolLM2 tokenizer, loaded by path like any user's target; seconds per run on one CPU
thread), the tiny recipes trained on them, in-process runs and two-process ``accelerate launch``
runs of a training script.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.heads.eagle import EagleHead
from draftsmith.target import load_tokenizer

VOCAB = 49152  # the bundled SmolLM2 tokenizer
EOS = 2  # <|im_end|>


def save_tiny_target(
    folder: Path, tokenizer, seed: int = 0, hidden_size: int = 64, scale: float = 1.0, layers: int = 2
) -> Path:
    """Save a ``layers``-layer Llama of ``hidden_size`` (4 heads) with ``tokenizer`` into ``folder``;
    ``scale`` multiplies every weight but the norms (the default init is near uniform over the
    vocabulary: nothing to distil)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_targets(root: Path, **variants: dict) -> dict[str, Path]:
    """Tiny targets sharing the bundled tokenizer, one a keyword: saved in ``root``/its name with its
    options to ``save_tiny_target``."""
    tokenizer = load_tokenizer("default")
    return {name: save_tiny_target(root / name, tokenizer, **options) for name, options in variants.items()}


REPO = Path(__file__).resolve().parents[1]


def greedy_rows(target, prompts: list[list[int]], length: int) -> torch.Tensor:
    """Rows of ``length`` tokens: each prompt and the target's greedy continuation, one full forward a
    token (regenerated data as the training pass recomputes it, with no cache to round differently)."""
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            while len(ids) < length:
                ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            rows.append(ids)
    return torch.tensor(rows)


def launch(
    script: str, recipe: Path, out: Path, *extra: str, cpu: bool, timeout: int = 400
) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes 2 SCRIPT RECIPE``: DDP over gloo with ``cpu``
    (``ACCELERATE_USE_CPU``), else what the recipe selects (DeepSpeed needs it unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["ACCELERATE_USE_CPU"] = "true" if cpu else "false"
    if not cpu:
        env.pop("ACCELERATE_USE_CPU")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "draftsmith" / "torch_extensions"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
        script,
        str(recipe),
        "--output_dir",
        str(out),
        *extra,
    ]
    # Its own process group: a run that hangs past ``timeout`` is ended with all its workers.
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[killed after {timeout} s]"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def write_recipe(root: Path, target: Path, drafter: dict, data: dict | None = None, **training) -> Path:
    """A tiny recipe file under ``root``: 8 conversations of at most 128 tokens, batch 2, no tracker;
    ``data`` and ``training`` entries override those defaults."""
    data = dict(data or {})
    # Hugging Face generate regenerates and extracts features here: vLLM (the default where installed) costs
    # ~20 s to start and its CPU attention needs head sizes of 32 and up, which these tiny targets do not have.
    data["regenerate"] = {"engine": "hf", **data.get("regenerate", {})}
    data["features"] = {"engine": "hf", **data.get("features", {})}
    recipe = {
        "target": {"name": str(target), "dtype": "float32"},  # exact comparisons, whatever this CPU's bf16
        "data": {"limit": 8, "max_length": 128, "held_out_fraction": 0.1, "cache_dir": str(root / "data"), **data},
        "drafter": drafter,
        "training": {
            "output_dir": str(root / "unused"),
            "batch_size": 2,
            "warmup_steps": 1,
            "mixed_precision": "no",
            **training,
        },
        "tracking": {"report_to": "none"},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def tiny_training_recipe(root: Path, drafter: dict, **training) -> Path:
    """``write_recipe`` under ``root`` for a short run whose loss must fall: a tiny target of
    weights x 8 (peaked: something to learn) saved in ``root``/target, the data as it is (not
    regenerated), 16 steps at a constant 3e-3, logs every 4 steps, held-out loss every 8;
    ``training`` entries override those."""
    target = save_tiny_target(root / "target", load_tokenizer("default"), scale=8.0)
    schedule = {"learning_rate": 3e-3, "lr_schedule": "constant", "max_steps": 16, "log_every": 4, "eval_every": 8}
    return write_recipe(root, target, drafter, data={"regenerate": {"enabled": False}}, **(schedule | training))


def resumable_recipe(root: Path, target: Path, drafter: dict, data: dict | None = None, **training) -> Path:
    """``write_recipe`` for the run the resume tests set an interrupted one against: 6 steps, a
    checkpoint at step 3, a log line every step; ``training`` entries add to those."""
    return write_recipe(root, target, drafter, data, max_steps=6, log_every=1, save_every=3, **training)


def run_training(main, recipe: Path, output_dir: Path, *overrides: str):
    """``main`` (a training entry point) on ``recipe`` into ``output_dir``, with ``overrides``
    (``--section.field value`` pairs)."""
    return main([str(recipe), "--output_dir", str(output_dir), *overrides])


def train_offline(main, recipe: Path, output_dir: Path, features_dir: Path, *overrides: str):
    """``main`` (a training entry point) on ``recipe`` with its features stored in ``features_dir``."""
    offline = ["--drafter.features", "offline", "--drafter.features_dir", str(features_dir)]
    return run_training(main, recipe, output_dir, *overrides, *offline)


def check_two_replicas(out: Path, target: Path, steps: int) -> None:
    """A two-process EAGLE run's final checkpoint under ``out``: ``steps`` taken, both replicas'
    parameter checksums equal to each other and to the saved weights, both ranks' RNG states saved,
    and the parameters moved from a fresh head's (``target``: the run's target folder)."""
    final = out / "checkpoint-final"
    state = json.loads((final / "state" / "trainer_state.json").read_text())
    assert state["step"] == steps
    checksums = state["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    # Both ranks' RNG states made it into the checkpoint before it was renamed into place.
    assert (final / "state" / "random_states_0.pkl").is_file() and (final / "state" / "random_states_1.pkl").is_file()
    tensors = load_file(str(final / "model.safetensors"))
    assert checksums[0] == pytest.approx(
        float(sum(v.double().sum() for k, v in tensors.items() if k != "draft_vocab")), rel=1e-9
    )
    drafter = yaml.safe_load((final / "recipe.yaml").read_text())["drafter"]
    fresh = EagleHead.for_target(
        LlamaForCausalLM.from_pretrained(target, dtype=torch.float32),
        "x",
        drafter["num_layers"],
        draft_vocab=tensors.get("draft_vocab"),
        init=drafter["init"],
    )
    fresh_sum = float(sum(p.detach().double().sum() for p in fresh.parameters()))
    assert abs(checksums[0] - fresh_sum) > 1e-3  # training moved the parameters
