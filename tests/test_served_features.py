"""``drafter.features: served``: a running vLLM server computes the target's hidden states as
training reads them.

- The server :func:`serve_command` starts takes exactly the settings asked for (vLLM's own parser).
- Its rows equal the stored features the target in this process computes (aux layers and the
  last state, fp32), and it leaves no file behind; its files hold the layers in ascending order,
  whatever order they are asked in, and say which (``layer_ids``).
- EAGLE-3 trains on it with a head-only target and logs the losses it logs on the offline store;
  files never outnumber ``data.features.window``, and none is left after training.
- A server that does not answer, none given, one capturing other layers (of the same count and
  size too), one whose files do not say which layers (vLLM's own connector) or one serving another
  model of the same shapes (its next-token log-probs against the recipe's LM head) is a one-line
  error naming data.features.server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import datasets
import pytest
import torch
from cli_helpers import assert_user_error
from server_helpers import end_group, free_port
from training_helpers import save_tiny_target, train_offline, write_recipe

from draftsmith.data_prep.features import FeatureDataset, extract_features
from draftsmith.data_prep.served_features import (
    ServedFeatures,
    check_captured,
    serve_command,
    served_model,
    take_states,
)
from draftsmith.data_prep.vllm_features import CONNECTOR_MODULE
from draftsmith.errors import UserError
from draftsmith.target import is_head_only, load_target, load_tokenizer
from draftsmith.vllm_engine import CPU_KV_CACHE_BYTES, why_unavailable

LAYERS, NUM_LAYERS = [3, 1, 2], 4  # not sorted: vLLM captures them in layer order
MAX_LENGTH = 128  # the recipe's data.max_length: the server's context is one token more
STARTUP = 300  # seconds vLLM may take to come up on two busy cores (about 40 idle)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny target vLLM's CPU attention takes (head size 32), 4 layers."""
    folder = tmp_path_factory.mktemp("served") / "target"
    return save_tiny_target(folder, load_tokenizer("default"), hidden_size=128, layers=NUM_LAYERS, scale=8.0)


@pytest.fixture(scope="module")
def recipe(target) -> Path:
    drafter = {"aux_layers": LAYERS, "ttt_steps": 2}  # the full vocabulary: every loss position counts
    return write_recipe(
        target.parent,
        target,
        drafter,
        data={"regenerate": {"enabled": False}, "max_length": MAX_LENGTH},
        learning_rate=3e-3,
        lr_schedule="constant",
        max_steps=3,
        log_every=1,
        eval_every=0,
    )


@pytest.fixture(scope="module")
def server(target):
    """``(url, storage)`` of a hidden-states server for ``target`` (``serve_command``), stopped after the module."""
    if why_unavailable():
        pytest.skip(why_unavailable())
    storage, port = target.parent / "states", free_port()
    command = serve_command(str(target), "float32", LAYERS, NUM_LAYERS, str(storage), port, "127.0.0.1", MAX_LENGTH + 1)
    log = open(target.parent / "server.log", "w")  # noqa: SIM115 (open while the server runs)
    # Its own process group: vLLM's engine-core processes stop with it.
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while not _healthy(url):
            tail = (target.parent / "server.log").read_text()[-3000:]
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{tail}"
            assert time.monotonic() < deadline, f"the server did not come up in {STARTUP} s:\n{tail}"
            time.sleep(1)
        yield url, storage
    finally:
        end_group(proc)
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_serve_command_is_what_vllms_parser_reads(tmp_path):
    """The flags are vLLM's (its server's parser reads them), with the engine settings asked for."""
    if why_unavailable():
        pytest.skip(why_unavailable())
    command = serve_command("some/model", "bfloat16", [5, 2], 8, str(tmp_path), 8123, "0.0.0.0", 2049, 2)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    probe = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "engine = AsyncEngineArgs.from_cli_args(args)\n"
        "names = ('model', 'dtype', 'max_model_len', 'enable_chunked_prefill', 'tensor_parallel_size',\n"
        "         'enforce_eager', 'kv_cache_memory_bytes', 'speculative_config', 'disable_log_stats')\n"
        "out = {name: getattr(engine, name) for name in names}\n"
        "transfer = ('kv_role', 'kv_connector', 'kv_connector_module_path', 'kv_connector_extra_config')\n"
        "out['kv_transfer_config'] = {name: getattr(engine.kv_transfer_config, name) for name in transfer}\n"
        "print(json.dumps({**out, 'host': args.host, 'port': args.port}))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe, *command[3:]], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    cpu = not torch.cuda.is_available()
    assert parsed["model"] == "some/model" and parsed["dtype"] == "bfloat16" and parsed["max_model_len"] == 2049
    assert (parsed["host"], parsed["port"], parsed["tensor_parallel_size"]) == ("0.0.0.0", 8123, 2)
    assert parsed["enable_chunked_prefill"] is False and parsed["disable_log_stats"] is False
    assert parsed["enforce_eager"] is cpu
    assert parsed["kv_cache_memory_bytes"] == (CPU_KV_CACHE_BYTES if cpu else None)
    assert parsed["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [5, 2, 8]}},
    }
    transfer = parsed["kv_transfer_config"]
    assert transfer["kv_role"] == "kv_producer"
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    connector = [transfer["kv_connector"], transfer["kv_connector_module_path"]]
    assert connector == ["CPUHiddenStatesConnector" if cpu else "HiddenStatesConnector", CONNECTOR_MODULE]


@pytest.mark.slow
def test_served_rows_equal_the_targets_stored_features(server, target, tmp_path):
    url, storage = server
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (1, 7, 33, 64, MAX_LENGTH)]
    masks = [torch.randint(0, 2, (len(row),), generator=generator).tolist() for row in ids]
    rows = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
    full, _ = load_target(str(target), "float32", "cpu")
    extract_features(full, {"train": rows}, tmp_path / "store", layers=LAYERS, show=False)
    stored = FeatureDataset(tmp_path / "store" / "train")
    head, _ = load_target(str(target), "float32", "cpu", head_only=True)
    assert served_model(url) == str(target)
    served = ServedFeatures(rows, url, str(target), LAYERS, NUM_LAYERS, head.get_decoder().norm, window=2)

    assert served.lengths() == stored.lengths() == [1, 7, 33, 64, MAX_LENGTH]
    got = served.__getitems__([4, 0, 2, 1]) + [served[3]]
    for row, index in zip(got, [4, 0, 2, 1, 3]):
        want = stored[index]
        assert row.keys() == want.keys() == {"input_ids", "loss_mask", "hidden", "aux"}
        assert {k: v.dtype for k, v in row.items()} == {k: v.dtype for k, v in want.items()}
        assert torch.equal(row["input_ids"], want["input_ids"]) and torch.equal(row["loss_mask"], want["loss_mask"])
        for key, width in (("hidden", 128), ("aux", 3 * 128)):
            assert row[key].shape == (len(ids[index]), width)
            # vLLM's kernels against the target's own, fp32: equal to a few parts in a million of the scale.
            scale = want[key].abs().max()
            assert (row[key] - want[key]).abs().max() <= 3e-5 * scale, (index, key)
    # The server's own next-token log-probs against our LM head on its states: one model, fp32.
    assert served.check_target(head, str(target)) < 1e-3
    assert list(storage.iterdir()) == []


@pytest.mark.slow
def test_the_server_writes_the_layers_in_ascending_order_and_says_which(server, target):
    """vLLM captures the layers as its forward pass meets them, whatever order they are asked in
    (LAYERS is not sorted), and each file's ``layer_ids`` say which: slot j holds the target's
    ``hidden_states[layer_ids[j]]`` (the final state before the final norm, which HF applies)."""
    url, storage = server
    ids = torch.randint(3, 40000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    body = json.dumps({"model": str(target), "prompt": ids, "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=STARTUP) as response:
        saved = take_states(json.load(response)["kv_transfer_params"]["hidden_states_path"])
    assert saved["layer_ids"].tolist() == [1, 2, 3, 4]
    full, _ = load_target(str(target), "float32", "cpu")
    with torch.no_grad():
        want = full(torch.tensor([ids]), output_hidden_states=True).hidden_states
        got = saved["hidden_states"].clone()
        got[:, -1] = full.get_decoder().norm(got[:, -1])
    for j, layer in enumerate(saved["layer_ids"].tolist()):
        # vLLM's kernels against the target's own, fp32: equal to a few parts in a million of the scale.
        assert (got[:, j] - want[layer][0]).abs().max() <= 3e-5 * want[layer].abs().max(), layer
    assert list(storage.iterdir()) == []


def _watch(folder: Path, stop: threading.Event, peak: list[int]) -> None:
    """Record in ``peak[0]`` the most requests whose files (states or lock) were in ``folder`` at once
    (a ``.tmp`` file is safetensors writing a request's states, whose lock is there too)."""
    while not stop.is_set():
        names = os.listdir(folder) if folder.is_dir() else []
        names = {name.removesuffix(".lock") for name in names if not name.startswith(".tmp")}
        peak[0] = max(peak[0], len(names))
        time.sleep(0.001)


@pytest.mark.slow
def test_eagle3_trains_on_served_features_as_on_stored_ones(server, recipe, tmp_path, one_thread):
    from draftsmith.train.eagle3 import main

    url, storage = server
    offline = train_offline(main, recipe, tmp_path / "offline", tmp_path / "features")
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_watch, args=(storage, stop, peak))
    watcher.start()
    try:
        served = main(
            [
                str(recipe),
                "--output_dir",
                str(tmp_path / "served"),
                "--drafter.features",
                "served",
                "--data.features.server",
                url,
                "--data.features.window",
                "1",
                # a worker process fetches the next batches while a step runs
                "--training.num_workers",
                "1",
            ]
        )
    finally:
        stop.set()
        watcher.join()
    assert is_head_only(served.task.target)
    logged = [[h for h in run.history if "train/loss" in h] for run in (offline, served)]
    assert [h["step"] for h in logged[1]] == [1, 2, 3]
    for a, b in zip(*logged):
        assert torch.isfinite(torch.tensor(b["train/loss"])) and b["train/loss"] > 1
        for key in ("train/loss", "train/ce_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5)
    evaluated = [[h for h in run.history if "eval/loss" in h] for run in (offline, served)]
    assert evaluated[1] and evaluated[1][-1]["eval/loss"] == pytest.approx(evaluated[0][-1]["eval/loss"], rel=1e-5)
    assert peak[0] == 1, "the watcher saw no request's files, or more than the window's one"
    assert list(storage.iterdir()) == []


@pytest.mark.parametrize("server_option", [["--data.features.server", "closed port"], []])
def test_no_server_is_a_one_line_error(recipe, tmp_path, capsys, server_option):
    from draftsmith.train.eagle3 import main

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there once the probe closes it
    options = [word if word != "closed port" else url for word in server_option]
    line = assert_user_error(
        capsys,
        r"data\.features\.server\b.*`draftsmith-features RECIPE --serve`",
        main,
        [str(recipe), "--output_dir", str(tmp_path / "run"), "--drafter.features", "served", *options],
    )
    assert (url in line and "does not answer" in line) if options else "needs data.features.server" in line


def served_run(recipe, tmp_path, url: str, *options: str) -> list[str]:
    """Arguments of a training run on the served features of ``url``, with ``options``."""
    return [str(recipe), "--output_dir", str(tmp_path / "run"), "--drafter.features", "served"] + [
        "--data.features.server",
        url,
        *options,
    ]


@pytest.mark.slow
def test_a_server_of_another_model_is_a_one_line_error_at_start_up(server, recipe, tmp_path, capsys):
    """Same layer count and size, other weights: the served log-probs are what tells them apart."""
    from draftsmith.train.eagle3 import main

    url, storage = server
    other = save_tiny_target(tmp_path / "other", load_tokenizer("default"), 1, 128, 8.0, NUM_LAYERS)
    line = assert_user_error(
        capsys,
        r"data\.features\.server .* differ by [0-9.]+ nats from what target\.name=\S+ LM head gives",
        main,
        served_run(recipe, tmp_path, url, "--target.name", str(other)),
    )
    assert f"target.name={other}'s" in line
    assert list(storage.iterdir()) == []


@pytest.mark.slow
def test_a_server_for_other_layers_is_a_one_line_error_at_start_up(server, recipe, tmp_path, capsys):
    """As many layers as the server captures, of the same size, but not the same ones."""
    from draftsmith.train.eagle3 import main

    url, storage = server
    assert_user_error(
        capsys,
        r"data\.features\.server \S+ captures layers \[1, 2, 3, 4\], the recipe reads \[0, 2, 3, 4\] "
        r"\(drafter\.aux_layers \[0, 2, 3\] and the final state, layer 4\): start the server for this recipe "
        r"with `draftsmith-features RECIPE --serve`$",
        main,
        served_run(recipe, tmp_path, url, "--drafter.aux_layers", "[0, 2, 3]"),
    )
    assert list(storage.iterdir()) == []


def test_a_states_file_that_does_not_say_its_layers_is_refused_in_one_line():
    """vLLM's own connector (a server started by hand) writes ``hidden_states`` and ``token_ids``
    only: which layers they are, shapes cannot tell, so the trainer refuses the file and says how to
    start a server whose files say. One that says, at another size, is another model's."""
    saved = {"hidden_states": torch.zeros(5, 4, 128), "token_ids": torch.arange(5)}
    with pytest.raises(UserError) as error:
        check_captured(saved, "/states/1.safetensors", "http://h:8000", LAYERS, NUM_LAYERS, 128)
    assert str(error.value) == (
        "data.features.server http://h:8000 does not say which layers it captures (/states/1.safetensors holds no "
        "layer_ids): start the server for this recipe with `draftsmith-features RECIPE --serve`, or give vLLM's "
        "--kv-transfer-config kv_connector_module_path draftsmith.hidden_states_connector"
    )
    saved["layer_ids"] = torch.tensor([1, 2, 3, 4])
    check_captured(saved, "/states/1.safetensors", "http://h:8000", LAYERS, NUM_LAYERS, 128)
    with pytest.raises(UserError, match=r"captures states of size 128, the recipe's target's are of size 64: start"):
        check_captured(saved, "/states/1.safetensors", "http://h:8000", LAYERS, NUM_LAYERS, 64)
