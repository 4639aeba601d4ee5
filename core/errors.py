"""User errors and how every command-line entry point reports them.

A :class:`UserError` is a problem with what the user gave us (a recipe, a data file, a flag, a
checkpoint, a model id the hub will not serve): the entry point prints it as one line on stderr,
naming the file, field or record and what to do, and exits with code 2. Anything else is a bug
and keeps its traceback. ``--debug`` (or ``DRAFTSMITH_DEBUG=1``) shows the traceback of user
errors too.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USER_ERROR = 2
DEBUG_FLAG = "--debug"
DEBUG_ENV = "DRAFTSMITH_DEBUG"

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """Bad input from the user; its message says what was wrong and what to do about it."""


class UsageError(UserError, ValueError):
    """A command-line flag or drafter spec that cannot be used as given."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, of the wrong kind, or made for another target."""


class HubError(UserError, OSError):
    """A model or dataset the Hugging Face hub cannot serve here (offline, gated, missing)."""


def debug_enabled(argv: list[str] | None = None) -> bool:
    """True when tracebacks were asked for with ``--debug`` or ``DRAFTSMITH_DEBUG=1``."""
    argv = sys.argv[1:] if argv is None else argv
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def one_line(message: str) -> str:
    """``message`` folded onto one line (multi-line library messages included)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def report_user_errors(main: F) -> F:
    """Run ``main`` so that a :class:`UserError` ends the program with one line and exit code 2.

    ``--debug`` is taken out of ``argv`` (or ``sys.argv``) before ``main`` sees it.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None, *args, **kwargs):
        given = sys.argv[1:] if argv is None else list(argv)
        debug = debug_enabled(given)
        if DEBUG_FLAG in given:
            given = [a for a in given if a != DEBUG_FLAG]
            if argv is None:
                sys.argv[1:] = given
            os.environ[DEBUG_ENV] = "1"  # entry points this one calls (eval/demo.py runs two) see it too
        try:
            return main(given if argv is not None else None, *args, **kwargs)
        except UserError as err:
            if debug:
                raise
            prog = os.path.basename(sys.argv[0]) or "draftsmith"
            print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in ``--help``) and the ``--debug`` flag listed."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument(
            DEBUG_FLAG, action="store_true", help=f"show the traceback of user errors too (or set {DEBUG_ENV}=1)"
        )

    def error(self, message: str):
        print(f"{self.prog}: error: {one_line(message)} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers ``>= minimum``."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {raw!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse
