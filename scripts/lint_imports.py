"""Check the import layers of pyproject.toml's ``[tool.importlinter]`` contracts (``make lint`` runs this).

import-linter finds a package's modules by walking its folder, but ``draftsmith`` is put together from
several top-level folders (``[tool.setuptools.package-dir]``), so its folder holds only the core
modules. This lays the namespace out as one folder of symbolic links in a temporary directory, puts
it first on the path and runs ``lint-imports`` over it.

    python scripts/lint_imports.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def lay_out(package_dirs: dict[str, str], into: Path) -> None:
    """Symbolic links under ``into`` that make each package's folder sit where its dotted name says."""
    for package, folder in sorted(package_dirs.items(), key=lambda item: item[0].count(".")):
        source, place = ROOT / folder, into.joinpath(*package.split("."))
        if place.exists():  # a folder inside an already linked package's folder (eval/engine in eval)
            if place.resolve() != source.resolve():
                raise SystemExit(f"{package}: {folder} is not the folder {place.resolve()} it sits in")
            continue
        if package.count("."):
            place.symlink_to(source, target_is_directory=True)
        else:  # the root package: its own folder, so that the subpackages can be linked into it
            place.mkdir()
            for module in source.glob("*.py"):
                (place / module.name).symlink_to(module)


def main() -> int:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    with tempfile.TemporaryDirectory(prefix="draftsmith-layers-") as tmp:
        lay_out(config["tool"]["setuptools"]["package-dir"], Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        command = ["lint-imports", "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"]
        return subprocess.run(command, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
