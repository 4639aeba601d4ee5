"""The docs name only what exists: every repository path and ``draftsmith`` module they name resolves,
and every ``--flag`` of a command line they show is one that command's ``--help`` lists."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import runpy
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
OURS = (
    "adapt",
    "bench",
    "core",
    "data_prep",
    "docs",
    "eval",
    "export",
    "heads",
    "plugins",
    "recipes",
    "scripts",
    "tests",
    "train",
)
PLACEHOLDER = "foo.py"  # docs/architecture.md's example of a new kind's files
COMMAND = re.compile(
    r"(?:accelerate launch |python3? )((?:[a-z_]+/)+[a-z_0-9]+\.py)|\b(draftsmith-[a-z]+(?:-[a-z]+)*)\b"
)
FLAG = re.compile(r"(?<![\w-])--([a-z][\w.-]*)")


def _named_paths(text: str) -> set[str]:
    found = set(re.findall(r"\b((?:[a-z_0-9]+/)+[\w.-]+\.(?:py|yaml|sh|md|json))\b", text))
    return {p for p in found if p.split("/")[0] in OURS and not p.endswith(PLACEHOLDER)}


def _resolves(module: str) -> bool:
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_repository_path_and_module_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        missing += [f"{doc.name}: {p}" for p in sorted(_named_paths(text)) if not (ROOT / p).exists()]
        modules = set(re.findall(r"`(draftsmith(?:\.\w+)+)`", text))
        missing += [f"{doc.name}: {m}" for m in sorted(modules) if not _resolves(m)]
    assert not missing, missing


def command_lines(text: str) -> list[str]:
    """The docs' command lines (shell continuations joined), from code blocks and inline code."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for line in lines if COMMAND.search(line)]


def documented_flags() -> dict[str, set[str]]:
    """Per command (a script path or a console script), the flags the docs give it."""
    flags: dict[str, set[str]] = {}
    for doc in DOCS:
        for line in command_lines(doc.read_text()):
            for segment in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
                match = COMMAND.search(segment)
                if match:
                    command = match.group(1) or match.group(2)
                    flags.setdefault(command, set()).update(FLAG.findall(segment[match.end() :]))
    return flags


SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _help(command: str) -> str:
    """What ``command --help`` prints, run in this process (imports are shared: seconds, not a
    Python start per command). ``draftsmith-train`` forwards a recipe's flags to its kind's trainer,
    whose help lists them: EAGLE-3's stands for it."""
    if command == "draftsmith-train":
        command = "train/eagle3.py"
    out = io.StringIO()
    argv, path = sys.argv, list(sys.path)
    sys.argv = [command, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), contextlib.suppress(SystemExit):
            if command.endswith(".py"):
                # `python bench/x.py` puts bench/ first on the path (its helpers import as top-level modules)
                sys.path.insert(0, str((ROOT / command).parent))
                runpy.run_path(str(ROOT / command), run_name="__main__")
            else:
                module, function = SCRIPTS[command].split(":")
                getattr(importlib.import_module(module), function)()
    finally:
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def test_every_flag_the_docs_give_a_command_is_in_its_help():
    flags = {
        command: names
        for command, names in documented_flags().items()
        if names and (command in SCRIPTS or (ROOT / command).exists())
    }
    assert {"eval/run.py", "draftsmith-export", "draftsmith-adapt"} <= set(flags), sorted(flags)
    helps = {command: _help(command) for command in flags}
    unknown = [
        f"{command} --{name}"
        for command, names in flags.items()
        for name in sorted(names)
        if f"--{name}" not in helps[command] and not re.search(rf"^\s+{re.escape(name)} = ", helps[command], re.M)
    ]
    assert not unknown, unknown


def test_the_flag_check_reads_command_lines_and_help_as_a_user_would():
    """Negative control: a made-up flag in a doc's command line is found and is not in the help."""
    text = (
        "Run\n\n```bash\npython eval/run.py --drafter suffix \\\n"
        "    --no-such-flag 3 && draftsmith-export X --format sglang\n```\n"
    )
    lines = command_lines(text)
    assert lines == ["python eval/run.py --drafter suffix      --no-such-flag 3 && draftsmith-export X --format sglang"]
    help_text = _help("eval/run.py")
    assert "--max-minutes" in help_text and "--no-such-flag" not in help_text
