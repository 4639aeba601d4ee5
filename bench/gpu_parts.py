"""Files cut into parts of bounded size and joined back, checked: how large files cross to and from
the GPU machine, which takes at most 64 MiB of files per call and gives back files of at most 16 MiB.

    python bench/gpu_parts.py join PARTS_DIR OUT_DIR     # e.g. the trained head a GPU run brought back

A cut file ``NAME`` becomes ``NAME.part0``, ``NAME.part1``, ... beside a ``NAME.parts.json`` that
records the whole file's size and SHA-256 and its parts; a file within the bound is copied whole.
Joining refuses (one line, exit code 2) when a part is missing, truncated or the joined bytes do not
hash to what was recorded, so a transfer cut short never yields a silently corrupt model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = ".parts.json"
CHUNK = 1 << 20


class PartsError(ValueError):
    """A set of parts that does not join into the file it was cut from."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def cut(path: Path, out_dir: Path, max_bytes: int, first: int = 0, last: int | None = None) -> list[Path]:
    """Cut ``path`` into parts of at most ``max_bytes`` under ``out_dir`` with its manifest; only
    parts ``first`` to ``last`` (inclusive) are written there (the others go in another call), the
    manifest always. A file within the bound is copied whole. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    if size <= max_bytes:
        shutil.copyfile(path, out_dir / path.name)
        return [out_dir / path.name]
    count = -(-size // max_bytes)
    manifest = {"name": path.name, "size": size, "sha256": sha256(path), "parts": count, "max_bytes": max_bytes}
    written = [out_dir / f"{path.name}{MANIFEST}"]
    written[0].write_text(json.dumps(manifest, indent=1))
    with path.open("rb") as f:
        for index in range(count):
            block = f.read(max_bytes)
            if first <= index <= (count - 1 if last is None else last):
                part = out_dir / f"{path.name}.part{index}"
                part.write_bytes(block)
                written.append(part)
    return written


def join(parts_dir: Path, out_dir: Path) -> list[Path]:
    """Join every cut file under ``parts_dir`` into ``out_dir`` and copy the whole files beside them;
    raises :class:`PartsError` naming what is missing or corrupt. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifests = sorted(parts_dir.glob(f"*{MANIFEST}"))
    cut_files = {m.name[: -len(MANIFEST)] for m in manifests}  # a manifest's and its parts' names start so
    written = []
    for path in sorted(parts_dir.iterdir()):
        if path.is_file() and path.name.rsplit(".part", 1)[0] not in cut_files:
            if path.resolve() != (out_dir / path.name).resolve():
                shutil.copyfile(path, out_dir / path.name)
            written.append(out_dir / path.name)
    for manifest_path in manifests:
        manifest = json.loads(manifest_path.read_text())
        parts = [parts_dir / f"{manifest['name']}.part{i}" for i in range(manifest["parts"])]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise PartsError(f"{parts_dir}: {manifest['name']} lacks {', '.join(missing)}; carry every part")
        target = out_dir / manifest["name"]
        tmp = target.with_name(target.name + ".joining")
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, CHUNK)
        if tmp.stat().st_size != manifest["size"] or sha256(tmp) != manifest["sha256"]:
            tmp.unlink()
            raise PartsError(
                f"{parts_dir}: {manifest['name']}'s parts join to other bytes than were cut (a part is truncated "
                "or from another file); cut and carry them again"
            )
        tmp.replace(target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["join"])
    parser.add_argument("parts_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        for path in join(args.parts_dir, args.out_dir):
            print(path)
    except (PartsError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
