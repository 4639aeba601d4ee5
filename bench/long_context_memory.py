"""Peak memory of feature extraction and EAGLE-3 training against conversation length (issue 58 item 2).

    python bench/long_context_memory.py --out R --lengths 2048 4096 8192 16384 32768

One synthetic long conversation per length: the bundled ShareGPT conversations, tokenised with the
bundled SmolLM2-135M-Instruct's chat template (assistant tokens supervised), laid end to end and cut
to LENGTH tokens (SmolLM2 was trained to 8K positions; its RoPE runs past them, which changes no
memory). Every measurement is a fresh child process, so each peak is its own:

- ``extract``: the ``hf`` engine's store of that conversation (EAGLE-3's default aux layers and the
  last hidden state, stored bfloat16): chunked prefill, the head's layers only;
- ``extract_whole``: the way it was before, one forward pass over the whole conversation returning
  every layer's states (the baseline);
- ``train``: ``--train-steps`` EAGLE-3 training steps (the recipe's defaults: 7 training-time-test
  passes, chain sampling 0.7, draft vocabulary 8192, bf16 autocast as ``mixed_precision: auto``
  gives on this CPU, AdamW) on the store, one conversation a batch, the head-only target (offline
  features), on the long rows' path (segment-id masks, chunked attention and loss) at every length
  (training takes it past ``DENSE_MASK_ROWS`` positions);
- ``train_dense``: the same with the dense ``n x n`` masks of short rows (the baseline), at
  ``--dense-lengths`` only: it does not fit in memory beyond them.

Reported per child: the RSS once the model and data are loaded, the peak RSS after that (the peak
is reset there, then read from ``resource.getrusage`` ru_maxrss; what the length adds is the
difference), wall seconds, and for ``extract`` the store's stated and written
bytes; with ``--device cuda``, ``torch.cuda.max_memory_allocated`` too. Results go to
``R/long_context_memory.json``; the table in BENCHMARKS.md is printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

MODES = ("extract", "extract_whole", "train", "train_dense")


def rss_mib() -> float:
    """This process's resident set size now, in MiB (Linux /proc)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak() -> None:
    """Start this process's peak resident set size afresh (Linux: ``clear_refs`` 5), so that loading
    the model, whose transient copies peak above what it keeps, does not mask what the work adds."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_mib() -> float:
    """This process's peak resident set size since :func:`reset_peak`, in MiB (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class HeapPeak:
    """The peak of what glibc's allocator holds for live allocations (``mallinfo2``: in use in its
    arenas plus mapped blocks), sampled every 2 ms on a thread while the context runs: RSS above it
    is freed memory the allocator keeps (fragmentation), not tensors. :attr:`peak_mib` is set by
    :meth:`stop`; None where glibc is absent."""

    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

    def __init__(self):
        self.peak_mib: float | None = None

    def start(self) -> HeapPeak:
        """Start sampling; returns self."""
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in self.FIELDS]

        try:
            mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError):
            self._thread = None
            return self
        mallinfo2.restype = MallInfo2
        self._done = threading.Event()

        def sample():
            peak = 0
            while not self._done.wait(0.002):
                info = mallinfo2()
                peak = max(peak, info.uordblks + info.hblkhd)
            self.peak_mib = peak / 2**20

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (the peak is then in :attr:`peak_mib`)."""
        if self._thread is not None:
            self._done.set()
            self._thread.join()


def begin_measuring() -> tuple[float, HeapPeak]:
    """Once the model and data are loaded: the RSS now (MiB), with the peak RSS reset and the
    allocator's live peak sampled from here on."""
    loaded = rss_mib()
    reset_peak()
    return loaded, HeapPeak().start()


def conversation(out: Path, length: int) -> Path:
    """A JSON file with ``input_ids`` and ``loss_mask`` of ``length`` tokens (made once per length)."""
    path = out / f"conversation-{length}.json"
    if path.is_file():
        return path
    from draftsmith.data_prep.dataset import build_dataset
    from draftsmith.recipe import DataConfig
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer("default")
    data, _ = build_dataset(DataConfig(limit=400, held_out_fraction=0.0, cache_dir=str(out / "data")), tokenizer)
    ids, mask = [], []
    for row in data["train"]:
        ids += row["input_ids"]
        mask += row["loss_mask"]
        if len(ids) >= length:
            break
    if len(ids) < length:
        raise SystemExit(f"the bundled conversations hold {len(ids)} tokens, fewer than {length}")
    path.write_text(json.dumps({"input_ids": ids[:length], "loss_mask": mask[:length]}))
    return path


def child(mode: str, length: int, out: Path, device: str, train_steps: int, ttt_steps: int) -> dict:
    """One measurement (a mode at a length), in this process; returns its record."""
    import datasets

    from draftsmith.data_prep.features import extract_features, store_identity
    from draftsmith.heads.aux_layers import default_aux_layers
    from draftsmith.target import load_target
    from draftsmith.timing import clock

    row = json.loads(conversation(out, length).read_text())
    data = datasets.DatasetDict({"train": datasets.Dataset.from_dict({k: [v] for k, v in row.items()})})
    store = out / f"store-{length}"
    began = clock("cpu")
    if mode.startswith("extract"):
        target, tokenizer = load_target("default", "auto", device)
        layers = default_aux_layers(target.config.num_hidden_layers)
        loaded, heap = begin_measuring()
        record = {}
        if mode == "extract":
            identity = store_identity("default", target, tokenizer, layers, "bfloat16", data)
            manifest = extract_features(target, data, store, show=False, layers=layers, identity=identity)
            from draftsmith.data_prep.features import StoreSize, store_bytes

            size = StoreSize(target.config.hidden_size, next(target.parameters()).dtype)
            record = {"stated_bytes": store_bytes(data, identity, size), "written_bytes": manifest["bytes"]}
        else:
            with torch.no_grad():
                ids = torch.tensor([row["input_ids"]], device=device)
                states = target.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
                torch.cat([states[layer][0] for layer in layers], dim=-1).cpu()
    else:
        from draftsmith.data_prep.dataset import pad_batch
        from draftsmith.data_prep.features import FeatureDataset
        from draftsmith.heads.eagle3 import Eagle3Head
        from draftsmith.heads.vocab import draft_vocab_for
        from draftsmith.train import unroll
        from draftsmith.train.eagle3 import Eagle3Recipe, Eagle3Task

        recipe = Eagle3Recipe()
        recipe.drafter.ttt_steps = ttt_steps
        # train: the long rows' path at every length (training takes it past DENSE_MASK_ROWS positions)
        # train_dense: the dense masks short rows keep, as every row had them before.
        unroll.DENSE_MASK_ROWS = 1 << 30 if mode == "train_dense" else 0
        if mode == "train":  # and its vocabulary loss in chunks of 512 rows at every length
            unroll.LOSS_CHUNK = 512 * recipe.drafter.draft_vocab_size
        target, tokenizer = load_target("default", "auto", device, head_only=True)
        vocab = draft_vocab_for(recipe.drafter.draft_vocab_size, data["train"], tokenizer, target.config.vocab_size)
        torch.manual_seed(0)
        head = Eagle3Head.for_target(target, "default", None, vocab).to(device)
        task = Eagle3Task(recipe, target, head)
        optimizer = torch.optim.AdamW(head.parameters(), lr=recipe.training.learning_rate)
        batch = {k: v.to(device) for k, v in pad_batch([FeatureDataset(store / "train")[0]]).items()}
        loaded, heap = begin_measuring()
        autocast = torch.bfloat16 if next(target.parameters()).dtype == torch.bfloat16 else None
        losses = []
        for _ in range(train_steps):
            with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=autocast is not None):
                loss, _ = task.loss(head, batch, True)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
        record = {"losses": losses}
    heap.stop()
    record.update(mode=mode, length=length, loaded_mib=round(loaded), peak_mib=round(peak_mib()))
    if heap.peak_mib is not None:
        record["heap_live_peak_mib"] = round(heap.peak_mib)
    if mode.startswith("train"):
        record["ttt_steps"] = ttt_steps
    record["seconds"] = round(clock("cpu") - began, 1)
    if device == "cuda":
        record["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return record


def table(records: list[dict]) -> str:
    """The BENCHMARKS.md table: peak RSS per mode and length, and what the length added."""
    lengths = sorted({r["length"] for r in records})
    by = {(r["mode"], r["length"]): r for r in records}
    lines = [
        "| tokens | " + " | ".join(f"{m} peak (added) MiB" for m in MODES) + " |",
        "|---:|" + "---:|" * len(MODES),
    ]
    for length in lengths:
        cells = []
        for mode in MODES:
            r = by.get((mode, length))
            cells.append(f"{r['peak_mib']:,} ({r['peak_mib'] - r['loaded_mib']:,})" if r and "peak_mib" in r else "-")
        lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--dense-lengths", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--train-steps", type=int, default=2)
    # training-time-test passes: the recipe's 7 by default; fewer where 32K tokens x 7 passes take too long
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        record = child(args.child[0], int(args.child[1]), out, args.device, args.train_steps, args.ttt_steps)
        print(json.dumps(record))
        return
    records = []
    for length in args.lengths:
        conversation(out, length)
        for mode in args.modes:
            if mode == "train_dense" and length not in args.dense_lengths:
                continue
            command = [sys.executable, __file__, "--out", str(out), "--device", args.device]
            command += ["--train-steps", str(args.train_steps), "--ttt-steps", str(args.ttt_steps)]
            command += ["--child", mode, str(length)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                record = {"mode": mode, "length": length, "failed": done.stderr.strip().splitlines()[-1:]}
            else:
                record = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(record), flush=True)
            records.append(record)
            (out / "long_context_memory.json").write_text(json.dumps(records, indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
