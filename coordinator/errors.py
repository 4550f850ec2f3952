"""The coordinator's own exceptions: one root, and the usage errors under it.

A `UsageError` is something the user gave that cannot be used (a flag, a variable, a tasks
file, a callable, a command, an output directory): the command says it in one line and exits
`ExitStatus.USAGE` with nothing changed. Anything else raised during a start is a bug, shown
with its traceback and `ExitStatus.INTERNAL`. Errors of the campaign file are the store's
(`store.errors.StoreError`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""


class UsageError(CoordinatorError):
    """A setting, file or command line the user gave cannot be used; the message names it."""


class OutputInUseError(UsageError):
    """The directory a run would write its test cases to is held by another master
    (`output_lock`); the message names it, the holder, and the flag that chooses another."""


@contextlib.contextmanager
def refusing_os_errors() -> Iterator[None]:
    """An OSError of the system (a path the user cannot search, a name too long, a file
    that vanished) as a one-line refusal (UsageError: exit 2), not a traceback. Not a
    broken pipe: `... | head` had enough, which is no error of the command's."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        what = e.strerror or str(e)
        raise UsageError(f"{e.filename}: {what}" if e.filename else what) from None


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Output to a pipe whose reader had enough (`check | head`, a script that read the
    first line): the rest is dropped, without a traceback, and the command's own status
    stands (a requeue that committed said exit 1 before)."""
    try:
        yield
    except BrokenPipeError:
        # Python's recipe: its buffered stdout is flushed again at exit, now into nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def refused(message: str, document: dict | None = None) -> int:
    """A command's refusal: one line on stderr, and exit 2 (`ExitStatus.USAGE`: nothing was
    changed). `document` is what a `--json` command prints on stdout besides: a script that
    parses its stdout got nothing there, and failed on the empty string instead of reading
    why."""
    import json

    from .exits import ExitStatus
    print(f"coordinator: {message}", file=sys.stderr)
    if document is not None:
        with reader_may_leave():
            print(json.dumps(document, indent=2, sort_keys=True))
    return ExitStatus.USAGE
