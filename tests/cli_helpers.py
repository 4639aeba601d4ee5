"""Helpers for checking how the command-line entry points report bad input."""

from __future__ import annotations

import re

import pytest


def user_error(capsys, call, *args, **kwargs) -> str:
    """Run an entry point that must reject its input: exit code 2 and exactly one line on stderr
    besides progress bars (no traceback). Returns that line."""
    capsys.readouterr()  # drop what came before
    with pytest.raises(SystemExit) as exit_:
        call(*args, **kwargs)
    err = capsys.readouterr().err
    # Progress bars (a model that loaded before the bad option was found) are not error lines.
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not re.search(r"\d+%\|", line)]
    assert exit_.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_user_error(capsys, pattern: str, call, *args, **kwargs) -> str:
    """:func:`user_error`, and its line matches the regular expression ``pattern``."""
    line = user_error(capsys, call, *args, **kwargs)
    assert re.search(pattern, line), line
    return line
