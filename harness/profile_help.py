"""Help texts built from the hardware profiles present (simulator/profiles/*.toml), so that the CLI's
`--gpu` options name every built-in profile without importing the simulator at start-up."""

from __future__ import annotations

from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent.parent / "simulator" / "profiles"


def builtin_profiles(section: str | None = None) -> tuple[str, ...]:
    """Names of the built-in hardware profiles (file stems, sorted); with `section`, only the profiles
    whose file has that TOML table (e.g. 'uncertainty': `harness sensitivity`'s input)."""
    names = []
    for f in sorted(PROFILE_DIR.glob("*.toml")):
        if section is None or any(line.strip() == f"[{section}]" for line in f.read_text().splitlines()):
            names.append(f.stem)
    return tuple(names)


def gpu_help(lead: str = "Hardware profile", section: str | None = None, path: bool = True) -> str:
    """'<lead>: a100 | a800 | ... | <path>.toml.' from the profiles present."""
    names = list(builtin_profiles(section))
    return f"{lead}: {' | '.join(names + (['<path>.toml'] if path else []))}."


__all__ = ["builtin_profiles", "gpu_help"]
