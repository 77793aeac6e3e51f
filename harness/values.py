"""--set values: TOML syntax, bare words, or lists of them (`parse_value`); shared by the experiment reader
(harness.experiment) and the canonical command of a run's provenance (harness.provenance)."""

from __future__ import annotations

import tomllib

from dmuon.errors import InputError


def parse_value(text: str):
    """A --set value: TOML syntax ([8, 64], 2048, 1.5, true, "x"), a bare word (pi0), or a list whose items
    are either ([pi0, wall-oss], [8, "a800"])."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        t = text.strip()
        if t.startswith("[") and t.endswith("]") and t[1:-1].strip():
            return [_scalar(x, text) for x in t[1:-1].split(",")]
        return _scalar(t, text)


def _scalar(item: str, text: str):
    item = item.strip()
    try:
        v = tomllib.loads(f"v = {item}")["v"]
        if not isinstance(v, (list, dict)):
            return v
    except tomllib.TOMLDecodeError:
        if item and not any(c in item for c in "[]{}=\"' "):
            return item
    raise InputError(
        f'--set value {text!r} is not a TOML value (e.g. 8, [8, 64], true, "a800"), a bare word '
        "(pi0) or a list of them ([pi0, wall-oss])"
    )
