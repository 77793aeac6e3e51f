"""User-facing errors: the CLI turns these into a one-line message and exit code 2 (no traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and what is accepted."""


def choice_error(what: str, got: object, accepted) -> UserError:
    """A UserError for a value outside a fixed set, listing the accepted values."""
    options = ", ".join(sorted(str(a) for a in accepted))
    return UserError(f"unknown {what} {got!r}; accepted: {options}")
