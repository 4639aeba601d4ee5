"""The processes of a training run: process group, free port, Accelerator, W&B tracker.

Accelerate drives devices, mixed precision, DDP or DeepSpeed, built here from the recipe, so a
bare ``accelerate launch script.py recipe.yaml`` needs no extra flags; a single process started
without a launcher gets the environment DeepSpeed needs.
"""

from __future__ import annotations

import netrc
import os
import socket
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env

from draftsmith.config import to_dict
from draftsmith.precision import dtype_name, mixed_precision_for, resolve_dtype
from draftsmith.recipe import Recipe
from draftsmith.target import default_device


def _wandb_mode(mode: str) -> None:
    if mode != "auto":
        os.environ["WANDB_MODE"] = mode
        return
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        has_login = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        has_login = False
    if not has_login:  # W&B errors out without a key: log locally, `wandb sync` later
        os.environ["WANDB_MODE"] = "offline"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_group(recipe: Recipe) -> InitProcessGroupKwargs | None:
    """Process-group settings for ``recipe`` (None: Accelerate's defaults); sets up the
    environment DeepSpeed needs when no launcher did."""
    if recipe.distributed.backend == "deepspeed" and "RANK" not in os.environ:
        # A single process started without a launcher: DeepSpeed would go looking for MPI.
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
        )
    launched = "LOCAL_RANK" in os.environ  # started by accelerate launch / torchrun (or just above)
    if launched and not torch.cuda.is_available():
        # Multi-process CPU runs (and DeepSpeed on CPU) need gloo instead of NCCL.
        return InitProcessGroupKwargs(backend="gloo")
    return None


def process_state(recipe: Recipe) -> PartialState:
    """This run's processes before any model is wrapped (the state the Accelerator made by
    :func:`make_accelerator` takes over), e.g. for :func:`main_process_first` around data preparation.

    Not an Accelerator yet: under ZeRO-3 one would make ``from_pretrained`` partition the frozen
    target, a collective that deadlocks while the other processes wait.
    """
    group = _process_group(recipe)
    if recipe.distributed.backend == "deepspeed":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as the Accelerator sets it: DeepSpeed's own init
    return PartialState(parse_flag_from_env("ACCELERATE_USE_CPU"), **(group.to_kwargs() if group else {}))


@contextmanager
def main_process_first(recipe: Recipe, timeout: timedelta = timedelta(hours=24)):
    """Run the block on the main process, then on the others (e.g. to read the caches it wrote).

    The others may wait as long as a dataset takes to regenerate: they wait in a gloo group of
    their own with a long ``timeout``, where a barrier of the default group gives up after 10
    (NCCL) or 30 minutes. A failing main process still ends the run: the launcher stops the rest.
    """
    state = process_state(recipe)
    if state.num_processes == 1:
        yield
        return
    group = torch.distributed.new_group(backend="gloo", timeout=timeout)
    if not state.is_main_process:
        torch.distributed.barrier(group=group)
    yield
    if state.is_main_process:
        torch.distributed.barrier(group=group)


def resolve_precision(recipe: Recipe) -> Recipe:
    """``recipe`` with ``auto`` in ``target.dtype`` and ``training.mixed_precision`` replaced by what
    this machine runs fastest (so the saved recipe records the concrete choice): a copy, ``recipe``
    is left as it is."""
    dtype = recipe.target.dtype
    if dtype == "auto":
        dtype = dtype_name(resolve_dtype("auto", default_device()))
    mixed = recipe.training.mixed_precision
    if mixed == "auto":
        mixed = mixed_precision_for(resolve_dtype(dtype, log=False))
    return replace(
        recipe,
        target=replace(recipe.target, dtype=dtype),
        training=replace(recipe.training, mixed_precision=mixed),
    )


def make_accelerator(recipe: Recipe) -> Accelerator:
    """An Accelerator configured from the recipe's training, distributed and tracking sections
    (``recipe`` resolved by :func:`resolve_precision`, as the trainer and the command line do)."""
    train, dist, track = recipe.training, recipe.distributed, recipe.tracking
    kwargs: dict = {
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "mixed_precision": train.mixed_precision,
        "project_dir": train.output_dir,
    }
    group = _process_group(recipe)
    if group is not None:
        kwargs["kwargs_handlers"] = [group]
    if dist.backend == "deepspeed":
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=dist.zero_stage,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            gradient_clipping=train.max_grad_norm,
            offload_optimizer_device="cpu" if dist.offload_optimizer else "none",
            offload_param_device="cpu" if dist.offload_params else "none",
            zero3_init_flag=False,
        )
    if track.report_to == "wandb" and track.mode != "disabled":
        _wandb_mode(track.mode)
        kwargs["log_with"] = "wandb"
    accelerator = Accelerator(**kwargs)
    if dist.backend == "deepspeed" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(
            "the recipe asks for DeepSpeed but Accelerate did not enable it: ACCELERATE_USE_CPU=true "
            "drops DeepSpeed silently. Launch with `accelerate launch --multi_gpu --num_processes N "
            "SCRIPT RECIPE` (without ACCELERATE_USE_CPU) or set distributed.backend: ddp."
        )
    return accelerator


def start_tracker(accelerator: Accelerator, recipe: Recipe) -> None:
    """Start the recipe's W&B run (named ``tracking.run_name``, its files under the output folder)
    with the whole recipe as its config; nothing when tracking is off."""
    track = recipe.tracking
    if track.report_to == "wandb" and track.mode != "disabled":
        accelerator.init_trackers(
            track.project,
            config=to_dict(recipe),
            init_kwargs={"wandb": {"name": track.run_name, "dir": str(Path(recipe.training.output_dir))}},
        )
