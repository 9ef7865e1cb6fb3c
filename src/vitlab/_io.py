"""Atomic file writes shared by every package that saves results (training runs, benchmarks, figures): write a
temporary file in the target folder, fsync, ``os.replace`` it into place, fsync the folder. A crash or a kill
at any moment leaves either the previous file or the new one, never a half-written one. JSON results and
matplotlib figures (PNG) go through the same path.

Temporary files and folders are created with ``os.open(..., 0o666)`` / ``os.mkdir(..., 0o777)``, so the kernel
applies the process umask itself: nothing here reads or changes the umask (no global state touched)."""

from __future__ import annotations

import io
import json
import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_name(folder: Path, prefix: str, suffix: str) -> Path:
    return Path(folder) / f"{prefix}{secrets.token_hex(4)}{suffix}"


def open_temp(folder: str | Path, prefix: str = ".", suffix: str = ".tmp") -> tuple[int, Path]:
    """A new file in ``folder`` opened for writing (fd, path), with the permissions the umask allows (unlike
    ``tempfile.mkstemp``'s 0600, which would make results unreadable to others)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = _temp_name(Path(folder), prefix, suffix)
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {folder}")


def make_temp_dir(folder: str | Path, prefix: str = ".", suffix: str = ".tmp") -> Path:
    """A new folder inside ``folder`` with the permissions the umask allows (``tempfile.mkdtemp`` gives 0700)."""
    for _ in range(100):
        path = _temp_name(Path(folder), prefix, suffix)
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {folder}")


def atomic_write(path: str | Path, data: bytes) -> Path:
    """Write ``data`` through a temporary file in the same folder, fsync, then ``os.replace`` it into place: a
    crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = open_temp(path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | Path, payload) -> Path:
    """``payload`` as indented JSON with a final newline, written atomically."""
    return atomic_write(path, (json.dumps(payload, indent=2) + "\n").encode())


def png_bytes(fig, dpi: int = 100) -> bytes:
    """A matplotlib ``Figure`` (object API: ``matplotlib.figure.Figure(...)``, no ``pyplot``, no backend switch)
    rendered to PNG, trimmed to its drawn content."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def write_png(path: str | Path, fig, dpi: int = 100) -> Path:
    """``fig`` as a PNG at ``path``, written atomically (see :func:`png_bytes`)."""
    return atomic_write(path, png_bytes(fig, dpi))
