"""User-facing errors: the CLI turns these into a one-line message, no traceback.

`UserError` is the harness's name for `dmuon.errors.InputError`; every package raises InputError (or a
subclass) for bad input, and `harness.cli.main` prints it and exits with code 2.
`RunFailed` is a run that could not finish (a worker process died, a timeout): the CLI prints its
message and exits with code 1. It subclasses RuntimeError, so callers catching that still do.
"""

from __future__ import annotations

from dmuon.errors import InputError, choice_error

UserError = InputError


class RunFailed(RuntimeError):
    """A run that could not finish (worker died, timed out); the message says which and why."""


__all__ = ["InputError", "RunFailed", "UserError", "choice_error"]
