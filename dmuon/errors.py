"""The one exception type for bad user input, shared by every package of the project.

`InputError` subclasses ValueError (so library callers can catch ValueError); the `harness` CLI turns
any InputError into a one-line message and exit code 2. Messages say what was wrong and what is
accepted.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input (configuration, shapes, names, files): the message says what is accepted."""


def choice_error(what: str, got: object, accepted) -> InputError:
    """An InputError for a value outside a fixed set, listing the accepted values. The error carries
    `got` and `accepted`, so a caller (the harness CLI) can name the option the value came from."""
    accepted = tuple(accepted)
    options = ", ".join(str(a) for a in accepted)
    err = InputError(f"unknown {what} {got!r}; accepted: {options}")
    err.got, err.accepted = got, accepted
    return err
