"""vLLM's hidden-states file connector, made to run where there is no CUDA.

vLLM 0.32's ``ExampleHiddenStatesConnector`` (the writer behind its ``extract_hidden_states``
method) copies each finished request's states out of the KV cache on a CUDA stream into pinned
memory and waits on CUDA events; on a CPU that dies at ``pin_memory=True``. This subclass copies
synchronously (on a CPU the cache already is host memory) and keeps everything else: the file per
request (``hidden_states`` ``[tokens, layers, hidden]``, ``token_ids``), the ``.lock`` file readers
wait on, ``kv_transfer_params["hidden_states_path"]``. vLLM loads it by module path
(``draftsmith.data_prep.vllm_features.transfer_config`` picks it where CUDA is absent); import it
only in vLLM's processes.
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


class _Copied:
    """Stands in for the CUDA event of a finished device-to-host copy: a CPU copy is done at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous copy instead of CUDA streams and events."""

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
