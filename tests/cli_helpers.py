"""Helpers for checking how the command-line entry points report bad input."""

from __future__ import annotations

import re

import pytest


def user_error(capsys, call, *args, **kwargs) -> str:
    """Run an entry point that must reject its input: exit code 2 and exactly one line on stderr
    (no traceback). Returns that line."""
    capsys.readouterr()  # drop what came before
    with pytest.raises(SystemExit) as exit_:
        call(*args, **kwargs)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_user_error(capsys, pattern: str, call, *args, **kwargs) -> str:
    """:func:`user_error`, and its line matches the regular expression ``pattern``."""
    line = user_error(capsys, call, *args, **kwargs)
    assert re.search(pattern, line), line
    return line
