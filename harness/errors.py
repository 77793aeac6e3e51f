"""User-facing errors: the CLI turns these into a one-line message and exit code 2 (no traceback).

`UserError` is the harness's name for `dmuon.errors.InputError`; every package raises InputError (or a
subclass) for bad input, and `harness.cli.main` catches that one type.
"""

from __future__ import annotations

from dmuon.errors import InputError, choice_error

UserError = InputError

__all__ = ["InputError", "UserError", "choice_error"]
