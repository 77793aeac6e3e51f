"""Atomic file writes, the one way the project writes user-facing files (results, profiles, caches,
traces, figures, plans): a temp file in the same folder, then os.replace, so a reader sees the old file
or the new one, never half of one, and an interrupted writer leaves no partial file behind.

  atomic_write_text(path, text)         text files (CSV, JSON, Markdown)
  atomic_write_bytes(path, data)        binary files
  with atomic_path(path) as tmp: ...    for writers that want a path (DataFrame.to_csv, savefig):
                                        write to `tmp`; it replaces `path` when the block ends without
                                        an exception, and is removed when it raises

Parent folders are created. The new file gets the mode a plain open() would give (0o666 minus the
umask), not mkstemp's 0o600. Standard library only: importable without torch.

  cache_dir()                           the project's cache folder: $DMUON_CACHE_DIR, else ~/.cache/dmuon
                                        (Triton autotune winners, the simulator's compiled event loop)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_CACHE_DIR = "DMUON_CACHE_DIR"


def cache_dir() -> Path:
    """The project's cache folder: $DMUON_CACHE_DIR, else ~/.cache/dmuon."""
    return Path(os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "dmuon"))


def file_mode() -> int:
    """0o666 minus the umask: the mode open() gives a new file (mkstemp's temp files are 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """A temp path next to `path`; on a clean exit it replaces `path`, on an exception it is removed.

    suffix: the temp file's suffix (default: `path`'s own, so writers that pick a format by extension,
    such as matplotlib's savefig, see the right one).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent,
                                   suffix=suffix if suffix is not None else path.suffix or ".tmp")
    except OSError as e:  # name the file the caller asked for, not the temp file
        raise type(e)(e.errno, e.strerror, str(path)) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically; returns the path."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, newline: str | None = "") -> Path:
    """Write `text` to `path` atomically (UTF-8; newline="" writes the text's own line ends); returns
    the path."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline=newline) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "file_mode"]
