"""The coordinator's own exceptions: one root, and the usage errors under it.

A `UsageError` is something the user gave that cannot be used (a flag, a variable, a tasks
file, a callable, a command, an output directory): the command says it in one line and exits
`ExitStatus.USAGE` with nothing changed. Anything else raised during a start is a bug, shown
with its traceback and `ExitStatus.INTERNAL`. Errors of the campaign file are the store's
(`store.errors.StoreError`).
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""


class UsageError(CoordinatorError):
    """A setting, file or command line the user gave cannot be used; the message names it."""
