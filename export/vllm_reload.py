"""New draft weights into a running vLLM (0.32), without a restart: heads that learn from served traffic.

Start vLLM with :data:`ENGINE_ARGS`, then ``reload_draft(llm, EXPORT_DIR)`` after each round's
``draftsmith-export``. Two paths, the first where the running vLLM has it:

- **vLLM's native weight update** (``start_draft_weight_update`` / ``update_weights`` /
  ``finish_weight_update``, on ``vllm.LLM`` and, under ``VLLM_SERVER_DEV_MODE=1``, over HTTP). Its
  built-in transfer engines (``nccl``, ``ipc``, ...) stream tensors from a trainer over NCCL or CUDA IPC:
  none runs on CPU, and none reads a folder. :data:`ENGINE_ARGS` names ours,
  ``weight_transfer_config={"backend": "draftsmith_export"}`` (registered with vLLM's
  ``WeightTransferEngineFactory`` when the worker imports this module for its extension class, before
  it loads the model): ``update_weights({"folder": DIR})`` loads the export's weights. It is created
  right after vLLM loads the drafter, so it reads and fingerprints the export vLLM started from *then*
  (names, shapes, sha256), before an adapter's ``current`` link can move.
- **Our** ``collective_rpc`` **extension** (:class:`DraftReloader`, the ``worker_extension_cls``), for a
  vLLM started without the transfer engine: the same load, the started export read at the first reload,
  and refused when it (or a link on its path) changed after the worker started.

Either way the worker reads the export's ``model.safetensors``, refuses one that is not the drafter it
serves (another shape, a tensor vLLM shares with the target that differs from the target's, a kind
whose derived buffers a reload would leave stale: DFlash/DSpark's fused context K/V weights), loads it
through the drafter's own ``load_weights`` inside vLLM's in-place reload (``reload_weights``: it redoes
the processing done at start; a bare ``load_weights`` fails on the CPU build, whose linear weights were
prepacked and dropped), and then the prefix cache is reset (its blocks hold the old drafter's KV entries).
The drafter is found as both of vLLM 0.32's runners hold it: ``get_draft_model()`` (the v1 runner,
which the CPU runner subclasses: ``drafter.model``; the v2 GPU runner: ``speculator.model``, for EAGLE's
``DraftModelSpeculator`` subclasses too), else those attributes themselves, unwrapped from CUDA graphs.

**The probe** (:func:`probe_digests`): after loading, the worker digests the tensors of the drafter it
serves that carry an export tensor's name and shape (norms, and on GPUs the unfused linear weights; the
CPU's prepacked linears cannot be read back) and :func:`check_probe` compares them with the export's own
digests, and says whether one of them differs between the old export and the new one (else the digests
cannot tell them apart and only served counters can: :meth:`draftsmith.adapt.watch.HttpServer.counters`).

``vllm serve`` takes the same over HTTP only with ``VLLM_SERVER_DEV_MODE=1`` (dev and RL routers: keep
that port private), ``--worker-extension-cls draftsmith.export.vllm_reload.DraftReloader`` and
``--weight-transfer-config '{"backend": "draftsmith_export"}'``: ``POST /pause?mode=wait``,
``/start_draft_weight_update``, ``/update_weights`` with ``{"update_info": {"folder": "/abs/export"}}``,
``/finish_weight_update``, then ``/collective_rpc`` ``{"method": "draftsmith_last_reload"}`` (what was
loaded, or ``error``), ``/reset_prefix_cache``, ``/resume`` (:class:`draftsmith.adapt.watch.HttpServer`).
A restart (~35 s here: tiny target, 2 CPU cores; a reload takes well under 1 s) is needed for a drafter
of another shape (draft vocabulary, layers) or an embedding/LM head unlike the target's while vLLM
shares the target's with the drafter: both are refused.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from draftsmith.errors import CheckpointError, UsageError, UserError, one_line
from draftsmith.timing import clock
from draftsmith.vllm_engine import EngineError, generate_with

WEIGHTS = "model.safetensors"
METHOD = "draftsmith_reload_draft"  # the collective_rpc path
LAST = "draftsmith_last_reload"  # what the native path's engine loaded (or why it refused)
NATIVE = "draftsmith_native"  # whether this worker's weight-transfer engine is ours
ENGINE = "draftsmith_export"  # our weight-transfer backend's name in vLLM's factory
SHOWN = 3  # differing tensor names quoted in a refusal
# Drafter methods that build buffers from loaded weights (vLLM 0.32's DFlash and DSpark: fused context K/V).
DERIVED = ("_build_fused_kv_buffers", "_build_context_kv_buffers")
_IMPORTED = time.time()  # in a worker: before it loaded the model (vLLM imports the extension first)


class DraftReloader:
    """vLLM worker extension. ``collective_rpc("draftsmith_reload_draft", args=(folder,))`` loads the
    export in ``folder`` into the running drafter; ``draftsmith_last_reload`` is what the native path's
    engine last loaded. Both return ``{"tensors", "sha256", "shared_with_target", "probe", "path"}``, or
    ``{"error"}`` (one line naming the file) leaving the old weights serving. Method names carry a
    prefix: vLLM refuses an extension whose names its worker class already has."""

    def draftsmith_reload_draft(self, folder: str) -> dict:
        """Reload the drafter from the export in ``folder`` (a path this worker can read)."""
        try:
            drafter, path = draft_model(self)
            if not hasattr(self, "_draftsmith_started"):
                self._draftsmith_started = started_export(self.vllm_config, since=_IMPORTED)
            return {
                **load_export(self.vllm_config, drafter, self.get_model(), Path(folder), self._draftsmith_started),
                "path": path,
            }
        except UserError as err:  # as data: the error class does not survive vLLM's RPC or HTTP
            return {"error": one_line(err)}

    def draftsmith_native(self) -> bool:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine is not None and getattr(engine, "draftsmith", False)

    def draftsmith_last_reload(self) -> dict:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last", None) or {"error": "no export was loaded through the weight update"})


def _register_engine() -> None:
    """Make :data:`ENGINE` a weight-transfer backend of the vLLM imported in this process (a worker
    imports this module for its extension class before it loads the model and creates the engine)."""
    if "vllm" not in sys.modules:
        return
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without native weight updates: the collective_rpc path serves
        return
    if ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            ENGINE, "draftsmith.export.vllm_weight_engine", "ExportFolderEngine"
        )


_register_engine()

ENGINE_ARGS = {
    "worker_extension_cls": f"{__name__}.{DraftReloader.__qualname__}",
    "weight_transfer_config": {"backend": ENGINE},
}


def _unwrap(model):
    return model.unwrap() if hasattr(model, "unwrap") else model


def draft_model(worker) -> tuple[torch.nn.Module, str]:
    """The drafter module the worker's runner drafts with, and where it was found: ``get_draft_model()``
    (vLLM 0.32's v1 runner, the CPU runner's base, and its v2 GPU runner for every ``DraftModelSpeculator``,
    EAGLE's included), else the runner's ``drafter.model`` (v1) or ``speculator.model`` (v2)."""
    runner = worker.model_runner
    found = worker.get_draft_model() if hasattr(worker, "get_draft_model") else None
    path = "get_draft_model"
    owners = (("drafter", getattr(runner, "drafter", None)), ("speculator", getattr(runner, "speculator", None)))
    for owner_name, owner in owners:
        if found is None and owner is not None and getattr(owner, "model", None) is not None:
            found, path = _unwrap(owner.model), f"{owner_name}.model"
    if found is None:
        raise UsageError("this vLLM serves no drafter model: start it with a speculative_config naming an export")
    return found, path


def fingerprint(folder: Path) -> dict:
    """An export's weights as a reload checks them: tensor names and shapes, and the file's sha256."""
    from safetensors import safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: not here; reloading needs vLLM started from a local export folder")
    with safe_open(str(path), "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return {"folder": str(folder.resolve()), "shapes": shapes, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def started_export(vllm_config, since: float | None = None) -> dict:
    """:func:`fingerprint` of the export vLLM started its drafter from. ``since``: when the worker
    started; read later than that (the collective_rpc path reads it at the first reload), it is refused
    when the file or a link on its path changed since: it may no longer be what vLLM loaded (an
    adapter's ``current`` link switched to a new round)."""
    folder = Path(vllm_config.speculative_config.draft_model_config.model)
    if since is not None:
        path = folder / WEIGHTS
        for part in [path, *path.parents]:
            if part.is_symlink() or part == path:
                changed = max(os.lstat(part).st_mtime, os.lstat(part).st_ctime) if part.exists() else None
                if changed is not None and changed > since:
                    raise CheckpointError(
                        f"{part} changed after this vLLM started: the export it serves can no longer be read to check "
                        "a reload against; start vLLM with ENGINE_ARGS (its weight-transfer engine reads it at start), "
                        "or from a round's own folder rather than the `current` link"
                    )
    return fingerprint(folder)


def derived_buffers(drafter: torch.nn.Module) -> str | None:
    """The name of a method by which ``drafter`` (or its inner model) derives buffers from its loaded
    weights, which an in-place reload would not rebuild; None when it has none."""
    for module in (drafter, getattr(drafter, "model", None)):
        for name in DERIVED:
            if module is not None and hasattr(module, name):
                return f"{type(module).__name__}.{name}"
    return None


def load_export(vllm_config, drafter: torch.nn.Module, target: torch.nn.Module, folder: Path, started: dict) -> dict:
    """Load the export in ``folder`` into ``drafter`` (served beside ``target``, started from the export
    ``started`` fingerprints), or raise a one-line :class:`CheckpointError` before touching a weight."""
    path = folder / WEIGHTS
    derived = derived_buffers(drafter)
    if derived is not None:
        raise CheckpointError(
            f"{path}: this drafter keeps buffers derived from its weights at load ({derived}: DFlash/DSpark's fused "
            "context K/V weights), which an in-place reload would leave stale: restart vLLM with this export"
        )
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; give an export folder (draftsmith-export CKPT --out DIR)")
    from safetensors.torch import load
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    data = path.read_bytes()
    tensors = load(data)
    _check_shapes(path, tensors, started["shapes"])
    shared = _check_shared(path, tensors, drafter, target)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        reload_weights(vllm_config, drafter, iter(tensors.items()), weights_path=None, is_checkpoint_format=True)
    return {
        "tensors": len(tensors),
        "sha256": hashlib.sha256(data).hexdigest(),
        "shared_with_target": shared,
        "probe": probe_digests(drafter, list(tensors)),
    }


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def probe_digests(drafter: torch.nn.Module, names: list[str]) -> dict[str, dict]:
    """``{name: {"shape", "dtype", "sha256"}}`` of the served drafter's tensors (parameters and buffers)
    that carry an export tensor's name (the drafter's loaders prefix it: ``norm.weight`` ->
    ``model.norm.weight``) and are not empty (the CPU build drops the linear weights it prepacked)."""
    tensors = dict(drafter.named_parameters())
    tensors.update(dict(drafter.named_buffers()))
    found = {}
    for name in names:
        served = next((t for n, t in tensors.items() if n == name or n.endswith("." + name)), None)
        if served is not None and served.numel() > 0:
            found[name] = {"shape": list(served.shape), "dtype": str(served.dtype), "sha256": _tensor_digest(served)}
    return found


def _export_digest(tensor: torch.Tensor, served: dict) -> dict:
    """:func:`probe_digests`' entry for an export ``tensor`` as vLLM would hold it (``served``'s dtype)."""
    dtype = getattr(torch, served["dtype"].removeprefix("torch."))
    return {"shape": list(tensor.shape), "dtype": served["dtype"], "sha256": _tensor_digest(tensor.to(dtype))}


def check_probe(served: dict[str, dict], folder: Path, previous: Path | None = None) -> dict:
    """Whether the drafter vLLM serves holds the export in ``folder``: ``served`` (the worker's
    :func:`probe_digests`) must name at least one tensor and equal the export's tensors, in vLLM's
    dtype, on every one it names (``mismatched`` lists the others: weights that did not reach the module
    vLLM drafts with), and ``discriminating`` says whether one of them differs between ``previous`` (the
    export served before) and this one (else the digests cannot tell the two apart)."""
    from safetensors.torch import load_file

    new = load_file(str(folder / WEIGHTS))
    old = load_file(str(previous / WEIGHTS)) if previous is not None else {}
    mismatched = sorted(n for n in served if n not in new or served[n] != _export_digest(new[n], served[n]))
    changed = sorted(n for n in served if n in new and (n not in old or not torch.equal(old[n], new[n])))
    return {
        "checked": sorted(served),
        "mismatched": mismatched,
        "changed_since_previous": changed,
        "discriminating": bool(changed),
        "passed": bool(served) and not mismatched,
    }


def reload_draft(llm, folder: str | Path) -> dict:
    """Load the export in ``folder`` into the drafter of ``llm`` (a ``vllm.LLM`` started with
    :data:`ENGINE_ARGS`), between ``generate`` calls: through vLLM's native weight update when its
    workers run our transfer engine, else through :class:`DraftReloader`'s ``collective_rpc``. Returns
    what the workers loaded (tensors, the file's sha256, the tensors vLLM shares with the target, the
    probe's digests) and ``via`` (the path taken). A refused export raises
    :class:`~draftsmith.errors.CheckpointError` and the old weights keep serving."""
    folder = str(Path(folder).expanduser().resolve())
    native = hasattr(llm, "start_draft_weight_update") and all(llm.collective_rpc(NATIVE))
    if native:
        llm.start_draft_weight_update()
        try:
            llm.update_weights({"update_info": {"folder": folder}})
        finally:
            llm.finish_weight_update()
        results = llm.collective_rpc(LAST)
    else:
        results = llm.collective_rpc(METHOD, args=(folder,))
    for result in results:
        if "error" in result:
            raise CheckpointError(result["error"])
    if not llm.reset_prefix_cache():
        raise EngineError(
            f"{folder}: loaded, but vLLM kept its prefix cache (requests were running): reload between generate calls"
        )
    return {**results[0], "via": "native weight update" if native else "collective_rpc"}


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
