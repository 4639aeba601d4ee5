"""vLLM's native weight update (``start_draft_weight_update`` / ``update_weights`` / ``finish_weight_update``)
reading a draftsmith export folder: the ``draftsmith_export`` transfer backend.

Imported by vLLM's ``WeightTransferEngineFactory`` in a worker (never by draftsmith's own processes);
:mod:`draftsmith.export.vllm_reload` registers it and says how it is used. vLLM's built-in engines
stream tensors from a trainer (NCCL, CUDA IPC) and need CUDA; this one reads ``model.safetensors`` from a
folder the worker can read, on any device. ``update_weights({"folder": DIR})`` never raises on a refused
export (a raise would end vLLM's update session half way): it records ``{"error"}`` in :attr:`last`,
which ``collective_rpc("draftsmith_last_reload")`` returns, and the old weights keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from draftsmith.errors import UserError, one_line
from draftsmith.export.vllm_reload import load_export, started_export


@dataclass
class ExportFolderInit(WeightTransferInitInfo):
    """Nothing to set up: the weights come from a folder."""


@dataclass
class ExportFolderUpdate(WeightTransferUpdateInfo):
    folder: str  # an export folder (draftsmith-export's output) this worker can read


class ExportFolderEngine(WeightTransferEngine[ExportFolderInit, ExportFolderUpdate]):
    """Loads an export folder into the update's target (the drafter, after ``start_draft_weight_update``)."""

    init_info_cls = ExportFolderInit
    update_info_cls = ExportFolderUpdate
    supports_draft_weight_update = True
    draftsmith = True  # DraftReloader.draftsmith_native: the reload may go this way

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        # Created as the worker finishes loading the model: the export the drafter came from, read now.
        self.started = started_export(vllm_config) if vllm_config.speculative_config is not None else None
        self.last: dict | None = None

    def init_transfer_engine(self, init_info: ExportFolderInit) -> None:
        pass

    def start_weight_update(self) -> None:
        self.last = None

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:  # no device sync: the load is synchronous
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ExportFolderUpdate) -> None:
        try:
            if self.model is self._default_model:
                raise UserError("draftsmith_export reloads the drafter only: call start_draft_weight_update first")
            loaded = load_export(
                self.vllm_config, self.model, self._default_model, Path(update_info.folder), self.started
            )
            self.last = {**loaded, "path": "get_draft_model"}
        except UserError as err:
            self.last = {"error": one_line(err)}

    def shutdown(self) -> None:
        pass
