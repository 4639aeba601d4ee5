"""Feature stores: vLLM's extraction equals the target's own (bundled SmolLM2, fp32), stores refuse
what they were not written for, and a damaged shard is written again rather than read."""

import json

import pytest
import torch
from gate_helpers import needs_vllm
from safetensors.torch import load_file
from training_helpers import write_recipe

from draftsmith.data_prep.features import (
    FeatureDataset,
    dequantize,
    extract_features,
    is_complete,
    quantize,
    store_identity,
)
from draftsmith.data_prep.vllm_features import features_job, job_engine_args
from draftsmith.errors import UserError
from draftsmith.target import is_head_only
from draftsmith.train.prepare import feature_layers, feature_source

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
@needs_vllm
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
                # vLLM's fused CPU kernels sum in another order: CI saw one element in 1e5 off by
                # 1.5e-6 of the block's largest; a wrong layer or position is off by a whole fraction of it.
                torch.testing.assert_close(ours["aux"][:, block], theirs["aux"][:, block], rtol=1e-4, atol=1e-5 * scale)
    identity = json.loads((tmp_path / "vllm" / "identity.json").read_text())
    assert identity == json.loads((tmp_path / "hf" / "identity.json").read_text()) and identity["layers"] == LAYERS


@pytest.fixture(scope="module")
def tiny_job(make_tiny_llama, tmp_path_factory):
    """``job(*overrides)``: the features job of an EAGLE-3 recipe for layers [3, 1] of a tiny 4-layer
    target (its config is all vLLM's engine config reads), regenerating with vLLM, with ``overrides``."""
    from draftsmith.train.cli import parse_training_args
    from draftsmith.train.eagle3 import Eagle3Recipe

    root = tmp_path_factory.mktemp("job")
    target = make_tiny_llama(layers=4)
    target.config.save_pretrained(root / "target")
    data = {"regenerate": {"enabled": True, "engine": "vllm"}, "features": {"engine": "vllm"}}
    path = write_recipe(root, root / "target", {"aux_layers": [3, 1]}, data)

    def job(*overrides: str) -> dict:
        recipe, _ = parse_training_args(Eagle3Recipe, [str(path), *overrides])
        return features_job(feature_source(recipe), feature_layers(recipe), target)

    return job


@needs_vllm
def test_the_features_job_runs_vllm_at_the_parallelism_of_its_regeneration(tiny_job, tmp_path):
    """One vLLM regenerates and extracts: the sizes data.regenerate sets hold unless data.features sets
    others (1, the default, gives way); set differently in both, a one-line error naming both fields."""

    def sizes(*overrides: str) -> tuple[int, int]:
        args = job_engine_args(tiny_job(*overrides), str(tmp_path))
        return args["tensor_parallel_size"], args["data_parallel_size"]

    assert sizes("--data.regenerate.tensor_parallel_size", "2") == (2, 1)
    assert sizes("--data.regenerate.data_parallel_size", "2", "--data.features.tensor_parallel_size", "4") == (4, 2)
    both = ["--data.regenerate.tensor_parallel_size", "2", "--data.features.tensor_parallel_size", "2"]
    assert sizes(*both) == (2, 1)
    # Regenerated elsewhere (hf) or not at all: the job only extracts, at data.features' sizes.
    for regenerate in (["--data.regenerate.engine", "hf"], ["--data.regenerate.enabled", "false"]):
        assert sizes(*regenerate, "--data.regenerate.tensor_parallel_size", "2") == (1, 1)
    with pytest.raises(
        UserError,
        match=r"^data\.regenerate\.data_parallel_size = 2 and data\.features\.data_parallel_size = 4, .*: set them",
    ) as error:
        tiny_job("--data.regenerate.data_parallel_size", "2", "--data.features.data_parallel_size", "4")
    assert "\n" not in str(error.value)


@needs_vllm
def test_the_connector_vllm_builds_for_the_job_writes_a_requests_states_and_their_layers(tiny_job, tmp_path):
    """vLLM's own factory, given the features job's engine configuration, builds a connector that
    works on this machine (vLLM's stock one dies at ``pin_memory`` without CUDA): a finished request's
    states are copied out of the cache slots of its blocks, with its token ids and the layers they are
    (in the order vLLM captures them; the served-features tests check that order against HF's states).
    The trainer's check reads that record: the recipe's layers pass, others of the same count do not."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnectorMetadata,
        PendingSave,
    )
    from vllm.engine.arg_utils import EngineArgs

    from draftsmith.data_prep.served_features import check_captured, take_states

    storage = tmp_path / "states"
    config = EngineArgs(**job_engine_args(tiny_job(), str(storage))).create_engine_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)
    block = connector._block_size
    # What vLLM's worker hands it (register_kv_caches, which needs vLLM's distributed state): the cache of
    # its CacheOnlyAttentionLayer, [blocks, captured layers, block size, hidden].
    connector._kv_cache = torch.randn(3, 3, block, 32)
    ids = torch.arange(block + 5)
    path = str(storage / "request-1.safetensors")
    finished = PendingSave("request-1", path, ids, block_ids=[2, 0])
    connector.bind_connector_metadata(ExampleHiddenStatesConnectorMetadata(pending_saves=[finished]))
    assert connector.get_finished({"request-1"}) == ({"request-1"}, None)
    saved = take_states(path)  # waits for the writer thread
    cache = connector._kv_cache
    assert torch.equal(saved["hidden_states"], torch.cat([cache[2], cache[0, :, :5]], dim=1).transpose(0, 1))
    assert torch.equal(saved["token_ids"], ids)
    assert saved["layer_ids"].tolist() == [1, 3, 4]
    check_captured(saved, path, "URL", [3, 1], 4, 32)
    with pytest.raises(UserError, match=r"captures layers \[1, 3, 4\], the recipe reads \[1, 2, 4\]"):
        check_captured(saved, path, "URL", [1, 2], 4, 32)


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
