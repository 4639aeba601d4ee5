"""Pack what the GPU run needs and the GPU machine lacks, in two loads of at most 64 MiB each.

    python bench/gpu_pack.py [--out .gpu] [--conversations N] [--part-mib 56]

The GPU machine has torch, transformers, accelerate, safetensors and tokenizers, and reaches no
network: the bundled target (its GGUF, 98 MB), the training conversations, MT-bench's questions and
the Python packages it lacks (``datasets`` and its ``dill`` / ``multiprocess``, ``gguf``, and the
arctic-inference source with ``nanobind`` to build suffix decoding there) travel with the working
tree, which may not exceed 64 MiB a call. So they go in two calls (docs/gpu_runbook.md):

- ``OUT/call1``: the GGUF's first part and the wheels;
- ``OUT/call2``: the GGUF's second part, MT-bench's questions and the conversations (ShareGPT's
  complete records as ``messages`` JSONL, xz-compressed: text is the smallest form they take).

``bench/gpu_parts.py`` cuts and joins, checking the joined target's SHA-256. Prints each load's size
with the working tree's and refuses one over the limit. ``.gitignore`` lists ``/.gpu/``: a load
travels only in the call that names it in ``carry``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_parts import cut

from draftsmith.assets import ASSETS, asset_path
from draftsmith.data_prep.sharegpt import load_conversations

LIMIT = 64 * 2**20  # the device tool's working tree and carried paths, per call
REPO = Path(__file__).resolve().parents[1]
# What the device image lacks, pinned to the versions this project is tested with; Python 3.12 there.
WHEELS = ["datasets==5.1.0", "dill==0.4.1", "multiprocess==0.70.19", "gguf==0.19.0", "nanobind==2.9.2"]
SOURCES = ["arctic-inference==0.3.0"]  # built there (a C++ extension; it links no torch)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def download(requirements: list[str], folder: Path, binary: bool) -> None:
    """``pip download --no-deps`` of ``requirements`` into ``folder``: wheels for the device's
    Python 3.12 on x86-64 (``binary``), else source distributions."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(folder), *requirements]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        cmd += [w for p in PLATFORMS for w in ("--platform", p)]
    else:  # its build requirements name an unpinned torch: no isolated build to read its metadata
        cmd += ["--no-binary=:all:", "--no-build-isolation"]
    subprocess.run(cmd, check=True)


def write_conversations(path: Path, source: str, count: int | None) -> int:
    """The first ``count`` (None: all) complete conversations of ``source`` as xz-compressed ``messages`` JSONL."""
    conversations, _ = load_conversations(source, limit=count, verbose=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as out:
        for conversation in conversations:
            out.write(json.dumps({"id": conversation["id"], "messages": conversation["messages"]}) + "\n")
    return len(conversations)


def tree_bytes() -> int:
    """Bytes of the working tree that travels with every call (tracked and untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu")
    parser.add_argument("--target", default=None, help="a .gguf file (default: the bundled SmolLM2's)")
    parser.add_argument("--data", default="sharegpt", help="conversations (any data.path source)")
    parser.add_argument(
        "--conversations", type=int, default=None, help="complete conversations to carry (default: all; ShareGPT's fit)"
    )
    parser.add_argument("--part-mib", type=float, default=56, help="the GGUF's first part, in MiB (call 1)")
    parser.add_argument("--no-wheels", action="store_true", help="carry no packages (a machine that has them)")
    args = parser.parse_args(argv)
    target = Path(args.target) if args.target else asset_path("smollm2")
    if args.out.exists():
        shutil.rmtree(args.out)
    call1, call2 = args.out / "call1", args.out / "call2"
    part = int(args.part_mib * 2**20)
    cut(target, call1 / "parts", part, first=0, last=0)
    cut(target, call2 / "parts", part, first=1)
    shutil.copyfile(asset_path("mt_bench"), call2 / "parts" / Path(ASSETS["mt_bench"].member).name)
    (call2 / "data").mkdir(parents=True)
    kept = write_conversations(call2 / "data" / "conversations.jsonl.xz", args.data, args.conversations)
    if not args.no_wheels:
        download(WHEELS, call1 / "wheels", binary=True)
        download(SOURCES, call1 / "wheels", binary=False)
    tree = tree_bytes()
    sizes = {name: folder_bytes(folder) for name, folder in (("call1", call1), ("call2", call2))}
    for name, size in sizes.items():
        print(f"{args.out / name}: {size / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB")
    over = [name for name, size in sizes.items() if size + tree > LIMIT]
    if over:
        print(
            f"error: {', '.join(over)} exceed the device's 64 MiB per call with the working tree; "
            "lower --conversations or move --part-mib",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return {"conversations": kept, "tree_bytes": tree, **sizes}


if __name__ == "__main__":
    main()
