"""New draft weights into a running vLLM (0.32), without a restart: heads that learn from served traffic.

Start vLLM with :data:`ENGINE_ARGS` (``worker_extension_cls``: :class:`DraftReloader` joins vLLM's
worker class), then ``reload_draft(llm, EXPORT_DIR)`` after each round's ``draftsmith-export``. Each
worker reads the export's ``model.safetensors``, checks it against the checkpoint vLLM started from,
and loads it through the drafter model's own ``load_weights`` inside vLLM's in-place reload
(``model_loader.reload``: it redoes the processing done at start; a bare ``load_weights`` fails on the
CPU build, whose linear weights were prepacked and dropped). The prefix cache is then reset: its
blocks hold the old drafter's KV entries (a reload without it drafts unlike a fresh start).

``vllm serve`` (0.32) takes the same over HTTP only with ``VLLM_SERVER_DEV_MODE=1`` (dev and RL routers:
keep that port private) and ``--worker-extension-cls draftsmith.export.vllm_reload.DraftReloader``:
``POST /pause?mode=wait``, ``POST /collective_rpc`` with ``{"method": "draftsmith_reload_draft", "args":
["/abs/export/dir"]}`` (answers ``{"results": [one dict per worker]}``, with ``error`` when refused),
``POST /reset_prefix_cache``, ``POST /resume``. (Its ``/start_draft_weight_update`` streams tensors from a
trainer over NCCL/IPC, not from a folder.) A restart (~35 s here: tiny target, 2 CPU cores; a reload
takes ~0.1 s) is needed for a drafter of another shape (draft vocabulary, layers) or an embedding/LM head
unlike the target's while vLLM shares the target's with the drafter: both are refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from draftsmith.errors import CheckpointError, UsageError, UserError, one_line
from draftsmith.timing import clock
from draftsmith.vllm_engine import EngineError, generate_with

WEIGHTS = "model.safetensors"
METHOD = "draftsmith_reload_draft"
SHOWN = 3  # differing tensor names quoted in a refusal


class DraftReloader:
    """vLLM worker extension: ``collective_rpc("draftsmith_reload_draft", args=(folder,))`` loads the
    export in ``folder`` into the running drafter and returns ``{"tensors", "sha256",
    "shared_with_target"}``, or ``{"error"}`` (one line naming the file) leaving the old weights serving.
    Method names carry a prefix: vLLM refuses an extension whose names its worker class already has."""

    def draftsmith_reload_draft(self, folder: str) -> dict:
        """Reload the drafter from the export in ``folder`` (a path this worker can read)."""
        try:
            return _reload(self, Path(folder))
        except UserError as err:  # as data: the error class does not survive vLLM's RPC or HTTP
            return {"error": one_line(err)}


ENGINE_ARGS = {"worker_extension_cls": f"{__name__}.{DraftReloader.__qualname__}"}


def reload_draft(llm, folder: str | Path) -> dict:
    """Load the export in ``folder`` into the drafter of ``llm`` (a ``vllm.LLM`` started with
    :data:`ENGINE_ARGS`), between ``generate`` calls; returns what the workers loaded (tensors,
    the file's sha256, the tensors vLLM shares with the target). A refused export raises
    :class:`~draftsmith.errors.CheckpointError` and the old weights keep serving."""
    results = llm.collective_rpc(METHOD, args=(str(Path(folder).expanduser().resolve()),))
    for result in results:
        if "error" in result:
            raise CheckpointError(result["error"])
    if not llm.reset_prefix_cache():
        raise EngineError(
            f"{folder}: loaded, but vLLM kept its prefix cache (requests were running): reload between generate calls"
        )
    return results[0]


def _reload(worker, folder: Path) -> dict:
    drafter = worker.get_draft_model()
    if drafter is None:
        raise UsageError("this vLLM serves no drafter model: start it with a speculative_config naming an export")
    path = folder / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; give an export folder (draftsmith-export CKPT --out DIR)")
    from safetensors.torch import load
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    data = path.read_bytes()
    tensors = load(data)
    _check_shapes(path, tensors, _started_shapes(worker))
    shared = _check_shared(path, tensors, drafter, worker.get_model())
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        reload_weights(worker.vllm_config, drafter, iter(tensors.items()), weights_path=None, is_checkpoint_format=True)
    return {"tensors": len(tensors), "sha256": hashlib.sha256(data).hexdigest(), "shared_with_target": shared}


def _started_shapes(worker) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the export vLLM built the drafter from. Read at the first reload
    and kept: a later round exported into that same folder must not redefine what the drafter is."""
    if not hasattr(worker, "_draftsmith_started"):
        from safetensors import safe_open

        started = Path(worker.speculative_config.draft_model_config.model) / WEIGHTS
        if not started.is_file():
            raise CheckpointError(f"{started}: not here; reloading needs vLLM started from a local export folder")
        with safe_open(str(started), "pt") as weights:
            worker._draftsmith_started = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return worker._draftsmith_started


def _check_shapes(path: Path, tensors: dict, started: dict) -> None:
    """Refuse tensors the drafter was not built for: drafters' loaders drop unknown names or stop
    halfway on a wrong shape, and a missing tensor would leave an old one serving."""
    given = {name: tuple(t.shape) for name, t in tensors.items()}
    if given == started:
        return
    missing = sorted(started.keys() - given.keys())
    unexpected = sorted(given.keys() - started.keys())
    reshaped = [
        f"{n} {list(given[n])} (serving {list(started[n])})"
        for n in sorted(given.keys() & started.keys())
        if given[n] != started[n]
    ]
    found = [
        f"{what} {', '.join(names[:SHOWN])}{' ...' if len(names) > SHOWN else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape of", reshaped))
        if names
    ]
    raise CheckpointError(
        f"{path}: not the drafter vLLM serves ({'; '.join(found)}): a drafter of another shape "
        "(draft vocabulary, layers) needs vLLM restarted with this export"
    )


def _check_shared(path: Path, tensors: dict, drafter: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    """Names of the tensors that load into parameters vLLM shares between drafter and target (the
    embedding or LM head, when the export vLLM started from carried the target's). Reloading writes
    them into the target, so they must equal what it holds: each is put through its parameter's own
    weight loader into a scratch copy (the loader shards it as vLLM did) and compared."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    target_params = {id(p) for p in target.parameters()}
    shared = []
    for param_name, param in drafter.named_parameters():
        if id(param) not in target_params:
            continue
        # Drafters' loaders prefix the checkpoint's names (EAGLE-3: embed_tokens -> model.embed_tokens).
        name = next((n for n in tensors if param_name == n or param_name.endswith("." + n)), None)
        if name is None:
            continue
        scratch = torch.nn.Parameter(torch.zeros_like(param), requires_grad=False)
        scratch.__dict__.update(param.__dict__)
        getattr(param, "weight_loader", default_weight_loader)(scratch, tensors[name])
        if not torch.equal(scratch, param):
            raise CheckpointError(
                f"{path}: {name} differs from the target's, which vLLM shares with the drafter: "
                "restart vLLM with this export to serve it"
            )
        shared.append(name)
    return shared


def serve_rounds(job: dict) -> dict:
    """vLLM job (:func:`draftsmith.vllm_engine.run_job`, task ``draftsmith.export.vllm_reload:serve_rounds``):
    start vLLM once with ``job["engine"]`` (with :data:`ENGINE_ARGS`), then per entry of
    ``job["rounds"]`` (an export folder, or None for the weights it started with) reload the drafter
    and run the ``generate`` job on its prompts. Each round carries ``reload`` (what was loaded) or
    ``error`` (why it was refused), and the seconds it took; ``start_seconds`` is vLLM's start."""
    from vllm import LLM

    began = clock("cpu")
    llm = LLM(**job["engine"])
    result = {"start_seconds": clock("cpu") - began, "rounds": []}
    for folder in job["rounds"]:
        entry = {"folder": folder}
        if folder is not None:
            began = clock("cpu")
            try:
                entry["reload"] = reload_draft(llm, folder)
            except CheckpointError as err:
                entry["error"] = str(err)
            entry["reload_seconds"] = clock("cpu") - began
        result["rounds"].append({**entry, **generate_with(llm, job)})
    return result
