"""The training and held-out sets of a run, wherever its target features come from: computed by
the trainer (``online``: the tokenised splits as they are), a store on disk (``offline``,
:mod:`draftsmith.data_prep.features`, filled first where missing) or a running vLLM server
(``served``, :mod:`draftsmith.data_prep.served_features`).

It sits above both so that neither imports the other: the store's module knows nothing of servers.
"""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.data_prep.features import (
    FeatureDataset,
    FeatureSource,
    check_identity,
    extract_features,
    is_complete,
    store_identity,
)
from draftsmith.data_prep.served_features import served_sets


def training_sets(
    source: FeatureSource,
    target,
    tokenizer,
    data,
    layers: list[int] | None = None,
    full_target: Callable | None = None,
):
    """``(train, held_out)``: the tokenised splits ``data`` (``source.mode`` online), their stored
    features (``offline``; with ``layers`` the fused states too), extracted first where missing, or
    their features from the server at ``data.features.server`` (``served``).

    ``target`` may be head-only (:func:`~draftsmith.target.load_target` with ``head_only``): ``full_target()``
    then loads the whole target where the ``hf`` engine has to extract (vLLM's extraction runs
    before the data is loaded: :func:`~draftsmith.data_prep.vllm_features.prepare_with_vllm`)."""
    if source.mode == "online":
        return data["train"], data["held_out"]
    if source.mode == "served":
        return served_sets(source, target, data, layers)
    root = source.store_dir(data, layers)
    identity = store_identity(source.target.name, target, tokenizer, layers, source.data.features.storage_dtype, data)
    if not is_complete(root, data):
        model = full_target() if full_target is not None else target
        extract_features(model, data, root, layers=layers, identity=identity, max_gb=source.data.features.max_gb)
    else:
        check_identity(root, identity)
    # No held-out conversation (a small data.limit): no shards to read, and nothing to evaluate on.
    return FeatureDataset(root / "train"), FeatureDataset(root / "held_out") if len(data["held_out"]) else None
