"""Feature stores: vLLM's extraction equals the target's own (bundled SmolLM2, fp32), stores refuse
what they were not written for, and a damaged shard is written again rather than read."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.features import (
    FeatureDataset,
    dequantize,
    extract_features,
    is_complete,
    quantize,
    store_identity,
)
from draftsmith.data_prep.vllm_features import capture_ids, split_states, transfer_config
from draftsmith.errors import UserError
from draftsmith.target import is_head_only
from draftsmith.vllm_engine import why_unavailable

# Every kind's layers: EAGLE-3 / P-EAGLE / DFlash default to [2, 15, 27] on SmolLM2's 30 layers; 1 and
# 30 (the final state, normed in HF's hidden_states) make sure any id a recipe may name comes out right.
LAYERS = [27, 1, 30, 15, 2]  # not sorted: vLLM captures in layer order, the head fuses in its own


def prepare(tmp_path, name: str, *overrides: str):
    """``(task, train_set, held_out)`` of an EAGLE-3 recipe on 6 bundled ShareGPT conversations, its
    features stored (``--prepare-only``) under ``tmp_path / name``."""
    from draftsmith.train.eagle3 import main

    return main(
        [
            "--prepare-only",
            "--target.dtype",
            "float32",
            "--data.limit",
            "6",
            "--data.max_length",
            "192",
            "--data.held_out_fraction",
            "0.2",
            "--data.regenerate.enabled",
            "false",
            "--data.cache_dir",
            str(tmp_path / "data"),
            "--drafter.features",
            "offline",
            "--drafter.features_dir",
            str(tmp_path / name),
            "--drafter.aux_layers",
            json.dumps(LAYERS),
            "--output_dir",
            str(tmp_path / "unused"),
            *overrides,
        ]
    )


@pytest.mark.slow
@pytest.mark.skipif(why_unavailable() is not None, reason="vLLM is not installed here")
def test_vllm_features_equal_the_targets_own(tmp_path):
    """Every row's last hidden state (what EAGLE-1 and Medusa read, through the final norm) and every
    aux layer vLLM writes equal the target's Hugging Face states to fp32 tolerance (the residual
    stream reaches ~2e4 in SmolLM2's middle layers: the tolerance is relative)."""
    task, vllm_rows, vllm_held = prepare(tmp_path, "vllm", "--data.features.engine", "vllm")
    _, hf_rows, hf_held = prepare(tmp_path, "hf", "--data.features.engine", "hf")
    assert is_head_only(task.target)  # neither run trained, and neither kept the whole target
    assert len(vllm_rows) == len(hf_rows) == 4 and len(vllm_held) == len(hf_held) == 2
    for rows, reference in ((vllm_rows, hf_rows), (vllm_held, hf_held)):
        for i in range(len(rows)):
            ours, theirs = rows[i], reference[i]
            assert torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(
                ours["loss_mask"], theirs["loss_mask"]
            )
            assert ours["aux"].shape == (len(ours["input_ids"]), len(LAYERS) * 576)
            torch.testing.assert_close(ours["hidden"], theirs["hidden"], rtol=1e-4, atol=1e-3)
            for j in range(len(LAYERS)):
                block = slice(j * 576, (j + 1) * 576)
                scale = theirs["aux"][:, block].abs().amax()
                torch.testing.assert_close(ours["aux"][:, block], theirs["aux"][:, block], rtol=1e-4, atol=1e-6 * scale)
    identity = json.loads((tmp_path / "vllm" / "identity.json").read_text())
    assert identity == json.loads((tmp_path / "hf" / "identity.json").read_text()) and identity["layers"] == LAYERS


def test_vllm_states_are_split_as_hf_orders_them():
    """vLLM captures the layers in ascending order (as its forward pass meets them); the store's ``aux``
    keeps the head's order and only N goes through the norm (pre-norm in vLLM, normed in HF)."""
    layers, n = [27, 2, 30], 30
    assert capture_ids(layers, n) == [27, 2, 30] and capture_ids(None, n) == [30] and capture_ids([5], n) == [5, 30]
    states = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # captured: layers 2, 27, 30

    def norm(x):
        return -x

    hidden, aux = split_states(states, layers, n, norm)
    assert torch.equal(hidden, -states[:, 2])
    assert torch.equal(aux, torch.cat([states[:, 1], states[:, 0], -states[:, 2]], dim=-1))
    hidden, aux = split_states(states[:, :1], None, n, norm)
    assert torch.equal(hidden, -states[:, 0]) and aux is None


def test_the_cpu_connector_is_chosen_without_cuda():
    cpu = transfer_config("/x", "cpu")
    assert cpu["kv_connector"] == "CPUHiddenStatesConnector"
    assert cpu["kv_connector_module_path"] == "draftsmith.hidden_states_connector"
    assert cpu["kv_connector_extra_config"] == {"shared_storage_path": "/x"}
    gpu = transfer_config("/x", "vllm")
    assert gpu["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in gpu
    assert transfer_config("/x")["kv_connector"] == (
        "CPUHiddenStatesConnector" if not torch.cuda.is_available() else gpu["kv_connector"]
    )


def test_float8_storage_keeps_every_layer_to_its_own_scale():
    """Layers of very different magnitudes (SmolLM2's reach 2e4 beside O(1) ones) each keep e4m3's
    relative precision (3 mantissa bits: within 1/16 of each value's scale)."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(7, 8), 2e4 * torch.randn(7, 8)], dim=-1)
    q, scale = quantize(x, 2)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 2)
    back = dequantize(q, scale)
    for block in (slice(0, 8), slice(8, 16)):
        err = (back[:, block] - x[:, block]).abs() / x[:, block].abs().amax(-1, keepdim=True)
        assert err.max() < 1 / 16
    assert (back[:, :8] - x[:, :8]).abs().max() < 0.2  # not swamped by the large layer


@pytest.fixture
def store(make_tiny_llama, tmp_path):
    """A tiny target, its tokenised rows as a DatasetDict and an fp32 store of layers [1, 2]."""
    import datasets

    target = make_tiny_llama(seed=1)
    rows = {"input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9]], "loss_mask": [[0, 1, 1, 1], [0, 0, 1], [1, 1]]}
    data = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    identity = store_identity("tiny", target, None, [1, 2], data=data)
    extract_features(target, data, tmp_path / "store", shard_size=2, show=False, layers=[1, 2], identity=identity)
    return target, data, tmp_path / "store", identity


def test_a_store_refuses_other_layers_and_targets_in_one_line(store, make_tiny_llama):
    target, data, root, identity = store
    with pytest.raises(UserError, match=r"written for layers \[1, 2\].*\[2, 1\] \(drafter\.aux_layers\)") as error:
        extract_features(target, data, root, show=False, layers=[2, 1], identity={**identity, "layers": [2, 1]})
    assert "\n" not in str(error.value)
    other = store_identity("tiny", make_tiny_llama(seed=2), None, [1, 2])
    with pytest.raises(UserError, match=r"\(target\.name\)"):
        extract_features(target, data, root, show=False, layers=[1, 2], identity=other)
    # A head reading the last hidden state only shares the store.
    extract_features(target, data, root, show=False, identity={**identity, "layers": []})
    # Other conversations under the same drafter.features_dir (another limit, mix or held-out set) are refused
    # too, even where the split sizes agree and the shards would read.
    import datasets

    other = datasets.DatasetDict({"train": data["train"].map(lambda row: {"input_ids": row["input_ids"][::-1]})})
    with pytest.raises(UserError, match=r"written for data .*\(data \(its conversations"):
        extract_features(
            target,
            other,
            root,
            show=False,
            layers=[1, 2],
            identity=store_identity("tiny", target, None, [1, 2], data=other),
        )


def test_a_truncated_shard_is_written_again_not_read(store):
    target, data, root, identity = store
    shard = root / "train" / "shard-00000.safetensors"
    whole = {name: tensor.clone() for name, tensor in load_file(shard).items()}  # not views of the file
    shard.write_bytes(shard.read_bytes()[:-100])  # cut short, as a full disk or a dying copy leaves it
    manifest = root / "manifest.json"
    manifest.unlink()
    assert not is_complete(root, data)
    extract_features(target, data, root, shard_size=2, show=False, layers=[1, 2], identity=identity)
    assert is_complete(root, data)
    again = load_file(shard)
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    rows = FeatureDataset(root / "train")
    assert [len(rows[i]["input_ids"]) for i in range(len(rows))] == [4, 3, 2]


def test_a_float8_store_reads_back_within_e4m3s_precision(store, tmp_path):
    """``data.features.storage_dtype: float8``: half the bytes of bf16 (a byte a value plus a scale per
    token and layer), rows read back in float32 within e4m3's relative precision of each layer."""
    target, data, root, identity = store
    f8 = tmp_path / "f8"
    extract_features(
        target, data, f8, shard_size=2, show=False, layers=[1, 2], identity={**identity, "storage": "float8"}
    )
    exact, coarse = FeatureDataset(root / "train"), FeatureDataset(f8 / "train")
    shard = load_file(f8 / "train" / "shard-00000.safetensors")
    assert shard["aux"].dtype == torch.float8_e4m3fn and shard["aux_scale"].shape == (7, 2)
    for i in range(len(exact)):
        for name in ("hidden", "aux"):
            x, y = exact[i][name], coarse[i][name]
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert ((y - x).abs().max(-1).values <= x.abs().max(-1).values / 16).all()
