"""Target features from vLLM: the serving engine's ``extract_hidden_states`` fills a feature store.

vLLM 0.32 captures, for every prompt token, the residual stream at the layer ids its
``eagle_aux_hidden_state_layer_ids`` lists (id L: after L decoder layers, HF's
``hidden_states[L]``; id N, the last, is the state *before* the final norm) into a KV-cache-like
buffer, and a KV connector writes each finished request's states to a file. draftsmith asks for
the head's aux layers plus N, applies the target's final norm to N itself (HF's
``last_hidden_state``, what the LM head reads and training uses) and writes the same store the
``hf`` engine writes (:mod:`draftsmith.data_prep.features`). Prompts are whole conversations,
prefilled with ``max_tokens=1``. Where the recipe regenerates its data, one vLLM job regenerates,
tokenises and extracts, so the engine starts once.

The connector is draftsmith's (:mod:`draftsmith.hidden_states_connector`): vLLM's own, each file also
holding the layers it captured, with a synchronous copy where CUDA is absent; :func:`transfer_config`
picks which.
"""

from __future__ import annotations

import fcntl
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from draftsmith.config import from_dict
from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import (
    Compute,
    FeatureSource,
    StoreSize,
    features_dir,
    is_complete,
    store_identity,
    write_store,
)
from draftsmith.data_prep.regenerate import (
    prepare_data_config,
    regeneration_context,
    regeneration_pending,
    vllm_generator,
)
from draftsmith.data_prep.regenerate import resolve_engine as resolve_generation_engine
from draftsmith.errors import UserError
from draftsmith.precision import dtype_name
from draftsmith.recipe import DataConfig, TargetConfig
from draftsmith.target import load_target, resolve_target
from draftsmith.vllm_engine import engine_args, run_job

CONNECTOR_MODULE = "draftsmith.hidden_states_connector"
# Engine steps (with a millisecond's pause each) to wait for a states file: one step hands a finished
# request to the connector; the rest wait for its writer thread.
STEPS_TO_WRITE = 100_000


def resolve_engine(engine: str) -> str:
    """The engine that fills a store (``data.features.engine``): as regeneration resolves its own."""
    return resolve_generation_engine(engine, "data.features.engine")


def capture_ids(layers: list[int] | None, num_layers: int) -> list[int]:
    """The vLLM layer ids to capture: ``layers`` in the head's order, then N (the final state)."""
    return list(dict.fromkeys([*(layers or []), num_layers]))


def split_states(
    states: torch.Tensor, layers: list[int] | None, num_layers: int, norm
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden, aux)`` as the store keeps them from vLLM's ``[tokens, captured, hidden]`` states:
    ``aux`` in the head's order of ``layers``, N through the final ``norm`` (HF's
    ``hidden_states[N]`` is normed too), the others as they are. vLLM captures the layers as its
    forward pass meets them, in ascending order, whatever order its config lists them in."""
    slot = {layer: j for j, layer in enumerate(sorted(capture_ids(layers, num_layers)))}

    def state(layer: int) -> torch.Tensor:
        value = states[:, slot[layer]]
        return norm(value) if layer == num_layers else value

    hidden = state(num_layers)
    return hidden, torch.cat([state(layer) for layer in layers], dim=-1) if layers else None


def transfer_config(storage: str | Path) -> dict:
    """vLLM's ``kv_transfer_config`` writing hidden states under ``storage`` with draftsmith's
    connector: vLLM's copy on GPUs, the synchronous one where CUDA is absent."""
    return {
        "kv_role": "kv_producer",
        "kv_connector": "HiddenStatesConnector" if torch.cuda.is_available() else "CPUHiddenStatesConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def speculative_config(layers: list[int] | None, num_layers: int) -> dict:
    """vLLM's ``speculative_config`` for extracting the states :func:`capture_ids` lists."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids(layers, num_layers)}},
    }


def vllm_compute(llm, layers: list[int] | None, num_layers: int, norm) -> Compute:
    """:data:`~draftsmith.data_prep.features.Compute` by a ``vllm.LLM`` built with
    :func:`speculative_config` and :func:`transfer_config` (in vLLM's child process)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import cleanup_hidden_states
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, detokenize=False)

    @torch.no_grad()
    def compute(chunk: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in chunk], params, use_tqdm=False)
        rows = []
        for ids, output in zip(chunk, outputs):
            path = output.kv_transfer_params["hidden_states_path"]
            saved = written_states(llm, path)
            cleanup_hidden_states(path)
            if saved["token_ids"].tolist() != list(ids):
                raise RuntimeError(f"vLLM wrote the states of other tokens than asked for ({path})")
            rows.append(split_states(saved["hidden_states"], layers, num_layers, norm))
        return rows

    return compute


def await_written(llm, path: str) -> None:
    """Return once vLLM's connector has written the states file ``path`` of a finished request (its
    writer holds ``path.lock`` until then).

    The connector writes a request's file on the engine step after the one that finished it. An
    engine core in a process of its own (vLLM's default) takes that step by itself; one in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which spares starting two more processes, ~35 s
    on a 2-core CPU) steps only when asked: it is stepped here until the writer lets go."""
    from vllm.v1.engine.core_client import InprocClient

    in_process = isinstance(llm.llm_engine.engine_core, InprocClient)
    with open(f"{path}.lock") as lock:
        for _ in range(STEPS_TO_WRITE):
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | (fcntl.LOCK_NB if in_process else 0))
                return
            except BlockingIOError:
                llm.llm_engine.step()
                time.sleep(0.001)  # the file itself is written on the connector's thread
    raise RuntimeError(f"vLLM's connector did not write {path} within {STEPS_TO_WRITE} engine steps")


def written_states(llm, path: str) -> dict[str, torch.Tensor]:
    """The states file ``path`` of a finished request, once written (:func:`await_written`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

    await_written(llm, path)
    return load_hidden_states(path)


def discard_states(llm, storage: Path) -> None:
    """Delete the states files under ``storage`` once written (:func:`await_written`)."""
    for lock in storage.glob("*.lock"):
        path = str(lock)[: -len(".lock")]
        await_written(llm, path)
        Path(path).unlink(missing_ok=True)
        lock.unlink()


def parallel_sizes(data: DataConfig) -> dict[str, int]:
    """vLLM's ``tensor_parallel_size`` and ``data_parallel_size`` for the features job of ``data``:
    ``data.features``' own, or, where the job regenerates too (``data.regenerate`` with vLLM, one
    engine for both), the size either section sets (1, the default, gives way to the other). Set in
    both, to different sizes: a one-line error naming both fields."""
    regenerates = data.regenerate.enabled and resolve_generation_engine(data.regenerate.engine) == "vllm"
    sizes = {}
    for name in ("tensor_parallel_size", "data_parallel_size"):
        extracting, regenerating = getattr(data.features, name), getattr(data.regenerate, name)
        if not regenerates:
            sizes[name] = extracting
        elif extracting == 1 or regenerating == 1 or extracting == regenerating:
            sizes[name] = max(extracting, regenerating)
        else:
            raise UserError(
                f"data.regenerate.{name} = {regenerating} and data.features.{name} = {extracting}, but one vLLM "
                "job regenerates and extracts: set them to the same size (or leave one at 1)"
            )
    return sizes


def features_job(source: FeatureSource, layers: list[int] | None, target) -> dict:
    """The job (:func:`run_vllm_features`) that fills ``source``'s feature store with the states of
    ``layers``, regenerating first where its data section asks (``target``: the head-only target)."""
    return {
        "task": "draftsmith.data_prep.vllm_features:run_vllm_features",
        "model": resolve_target(source.target.name, "target.name"),
        "dtype": dtype_name(next(target.parameters()).dtype),
        "num_layers": target.config.num_hidden_layers,
        "target": asdict(source.target),
        "data": asdict(source.data),
        "layers": layers,
        "features_dir": source.folder,
        **parallel_sizes(source.data),
    }


def job_engine_args(job: dict, storage: str) -> dict:
    """The ``vllm.LLM`` arguments of the features ``job``, its states written under ``storage``."""
    data = from_dict(DataConfig, job["data"], "job")
    context = data.max_length + 1
    if data.regenerate.enabled:
        context = max(context, regeneration_context(job["model"], data.regenerate))
    return engine_args(
        job["model"],
        job["dtype"],
        max_model_len=context,
        speculative_config=speculative_config(job["layers"], job["num_layers"]),
        kv_transfer_config=transfer_config(storage),
        # The connector saves what the request prefilled: whole prompts, not chunks of them.
        enable_chunked_prefill=False,
        tensor_parallel_size=job["tensor_parallel_size"],
        data_parallel_size=job["data_parallel_size"],
    )


def prepare_with_vllm(source: FeatureSource, layers: list[int] | None, target, tokenizer, full_target) -> None:
    """Fill ``source``'s feature store with vLLM (regenerating its data first where its data section
    asks, in the same job) unless it is complete. ``target``: the head-only target (its identity);
    ``full_target()``: the whole one, for data regenerated with ``hf``."""
    name = source.target.name
    # Replies still to write go to the job's vLLM, unless the recipe writes them with hf (here, first).
    vllm_writes = resolve_generation_engine(source.data.regenerate.engine) == "vllm"
    if not (vllm_writes and regeneration_pending(source.data, target, name, tokenizer)):
        prepared = prepare_data_config(source.data, target, name, tokenizer, full_target=full_target)
        data, _ = build_dataset(prepared, tokenizer, verbose=False)
        if is_complete(source.store_dir(data, layers), data):
            return
    job = features_job(source, layers, target)
    run_job(job, "extracting target features with vLLM (data.features.engine)", echo=True)


def run_vllm_features(job: dict) -> dict:
    """The features job for :func:`draftsmith.vllm_engine.run_job` (in vLLM's child process):
    regenerate where asked, tokenise, extract every split into the store; returns the manifest."""
    from vllm import LLM

    target_cfg, data_cfg = from_dict(TargetConfig, job["target"], "job"), from_dict(DataConfig, job["data"], "job")
    model, layers, num_layers = job["model"], job["layers"], job["num_layers"]
    head, tokenizer = load_target(
        target_cfg.name, job["dtype"], "cpu", target_cfg.chat_template, "target.name", head_only=True
    )
    features = data_cfg.features
    with tempfile.TemporaryDirectory(prefix="draftsmith-states-") as storage:
        llm = LLM(**job_engine_args(job, storage))
        # Regeneration with hf is done by the parent before this job; what is left is vLLM's.
        replies = vllm_generator(llm, model, tokenizer, data_cfg.regenerate)

        def generate(histories: list[list[dict]], seeds: list[int]):
            # The connector writes every finished request's prompt states, generation's too: not needed.
            out = replies(histories, seeds)
            discard_states(llm, Path(storage))
            return out

        prepared = prepare_data_config(data_cfg, head, target_cfg.name, tokenizer, generate=generate)
        data, _ = build_dataset(prepared, tokenizer)
        root = features_dir(target_cfg, data, layers, features.storage_dtype, job["features_dir"])
        identity = store_identity(target_cfg.name, head, tokenizer, layers, features.storage_dtype, data)
        norm = head.get_decoder().norm
        size = StoreSize(head.config.hidden_size, head.dtype, features.max_gb)
        return write_store(data, root, vllm_compute(llm, layers, num_layers, norm), identity, size=size)
