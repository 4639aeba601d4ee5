"""vLLM's hidden-states file connector, with a record of the layers each file holds, and made to run
where there is no CUDA.

vLLM 0.32's ``ExampleHiddenStatesConnector`` (the writer behind its ``extract_hidden_states``
method) writes one file per finished request (``hidden_states`` ``[tokens, layers, hidden]``,
``token_ids``) and a ``.lock`` file readers wait on; ``kv_transfer_params["hidden_states_path"]``
names the file. Nothing in it says which layers it holds: a trainer reading a server for layers
[2, 15, 26] cannot tell it from one for [2, 15, 27]. :class:`HiddenStatesConnector` adds
``layer_ids``, the vLLM layer ids along ``hidden_states``' second axis. The record is in every file
rather than once in the storage folder: a folder outlives its server, and a server started later in
it without this connector would pass for the earlier one.

On a CPU vLLM's connector dies at ``pin_memory=True`` (it copies each request's states out of the KV
cache on a CUDA stream and waits on CUDA events): :class:`CPUHiddenStatesConnector` copies
synchronously (there the cache already is host memory). vLLM loads either by module path
(``draftsmith.data_prep.vllm_features.transfer_config`` picks one); import this module only in
vLLM's processes.
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose files also hold ``layer_ids``: the layers of
    ``hidden_states``, in its order."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        ids = vllm_config.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids
        # vLLM's model keeps them distinct and sorted (EagleModelMixin._set_aux_hidden_state_layers) and
        # captures them as its forward pass meets them, whatever order the config lists them in.
        self._layer_ids = torch.tensor(sorted(set(ids)))

    def _write_tensors(self, tensors, event, filename, lock_fd) -> None:
        super()._write_tensors({**tensors, "layer_ids": self._layer_ids}, event, filename, lock_fd)


class _Copied:
    """Stands in for the CUDA event of a finished device-to-host copy: a CPU copy is done at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(HiddenStatesConnector):
    """:class:`HiddenStatesConnector` with a synchronous copy instead of CUDA streams and events."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        # A copy, not a view: the blocks go back to the cache as soon as this request is reported done.
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        # The disk write stays on vLLM's writer threads: the engine goes on while a file is written.
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
