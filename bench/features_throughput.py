"""Feature extraction throughput: vLLM's ``extract_hidden_states`` against the target in this process (``hf``).

    python bench/features_throughput.py --out R --limit 256 --max-length 768 --dtype auto

Both engines write the same store (EAGLE-3's default aux layers plus the last hidden state, the
target's dtype) for the first LIMIT bundled ShareGPT conversations with their own replies (no
regeneration). Reported: tokens written per second of extraction (the store's own timer: compute
plus write, shards in order), each engine's start-up (loading the target; for vLLM the child
process, engine start and tokenised-set load) and the ratio vLLM / hf, measured one after the other
in one run. The largest difference between the two stores is printed as a check.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig

from draftsmith.data_prep.dataset import build_dataset
from draftsmith.data_prep.features import FeatureDataset, extract_features, store_identity
from draftsmith.data_prep.vllm_features import parallel_sizes
from draftsmith.heads.aux_layers import default_aux_layers
from draftsmith.precision import dtype_name, resolve_dtype
from draftsmith.recipe import DataConfig, TargetConfig
from draftsmith.target import load_target, load_tokenizer, resolve_target
from draftsmith.timing import clock  # noqa: E402
from draftsmith.vllm_engine import run_job


def largest_difference(a: FeatureDataset, b: FeatureDataset) -> dict[str, float]:
    """Largest |a - b| relative to b's largest magnitude, per tensor, over every row."""
    worst = {"hidden": 0.0, "aux": 0.0}
    for i in range(len(a)):
        for name in worst:
            x, y = a[i][name].float(), b[i][name].float()
            worst[name] = max(worst[name], ((x - y).abs().max() / y.abs().max()).item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()
    out = Path(args.out)
    dtype = dtype_name(resolve_dtype(args.dtype, torch.device("cpu")))
    model = resolve_target("default")
    num_layers = AutoConfig.from_pretrained(model).num_hidden_layers
    layers = default_aux_layers(num_layers)
    # A tenth held out: the two stores then also train two heads to compare (BENCHMARKS.md, item 3).
    data_cfg = DataConfig(
        limit=args.limit, max_length=args.max_length, held_out_fraction=0.1, cache_dir=str(out / "data")
    )
    tokenizer = load_tokenizer("default")
    data, _ = build_dataset(data_cfg, tokenizer, verbose=False)
    results = {}

    began = clock("cpu")
    target, _ = load_target("default", dtype, device="cpu")
    startup = clock("cpu") - began
    identity = store_identity("default", target, tokenizer, layers, data=data)
    manifest = extract_features(target, data, out / f"hf-{dtype}", layers=layers, identity=identity)
    results["hf"] = {"startup_s": startup, **manifest}
    del target

    job = {
        "task": "draftsmith.data_prep.vllm_features:run_vllm_features",
        "model": model,
        "dtype": dtype,
        "target": asdict(TargetConfig(dtype=dtype)),
        "data": asdict(data_cfg),
        "layers": layers,
        "num_layers": num_layers,
        "features_dir": str(out / f"vllm-{dtype}"),
        **parallel_sizes(data_cfg),
    }
    began = clock("cpu")
    manifest = run_job(job, "feature extraction benchmark", echo=False)
    results["vllm"] = {"startup_s": clock("cpu") - began - manifest["seconds"], **manifest}

    print(f"\n{manifest['tokens']:,} tokens ({args.limit} conversations, max {args.max_length}), {dtype}\n")
    print("| engine | extraction tokens/s | start-up s | end to end tokens/s |")
    print("|---|---|---|---|")
    for engine, r in results.items():
        rate = r["written_tokens"] / max(r["seconds"], 1e-9)  # 0 written: the store was complete already
        whole = r["written_tokens"] / max(r["seconds"] + r["startup_s"], 1e-9)
        print(f"| {engine} | {rate:,.0f} | {r['startup_s']:.1f} | {whole:,.0f} |")
        r["tokens_per_s"] = rate
    print(f"\nvLLM / hf: {results['vllm']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}x")
    worst = largest_difference(
        FeatureDataset(out / f"vllm-{dtype}" / "train"), FeatureDataset(out / f"hf-{dtype}" / "train")
    )
    print(f"largest |vllm - hf| / max|hf| per row: {worst}")
    results["largest_difference"] = worst
    (out / f"features_throughput_{dtype}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
