"""Durable file operations every pass may use (artifacts, checkpoints): a rename is only as
durable as what it renames, and the directory entry it changes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (renames into or out of it) to disk."""
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fsync_file(path)
