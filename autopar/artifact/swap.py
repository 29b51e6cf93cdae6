"""Putting a freshly written artifact in place of an old one without losing anything.

An artifact directory holds two kinds of entries: the files ``autopar compile`` generates
(:data:`GENERATED`) and everything a run or the user put there (``checkpoints/``, ``logs/``,
notes, hand-edited programs kept as ``*.edited.py``). Re-compiling replaces only the first
kind, and never moves or removes the second: a checkpoint stays where it was at every instant.

The swap moves the old generated files into ``DIR/.autopar-previous``, writes a marker when
that is complete, then moves the new files in (the manifest last); renaming
``.autopar-previous`` to ``.autopar-old-*`` commits the new artifact, and the old files are
removed after that. SIGINT and SIGTERM wait until the swap is over. A process killed outright
(SIGKILL, power) leaves ``.autopar-previous`` behind; :func:`recover` (run by the next compile
and by every load) puts the previous artifact back, so a directory always holds one whole
artifact. Every step of the swap and of the roll-back can be cut short and redone: the
roll-back first removes the new files, then the marker, then puts the old ones back, so a
roll-back killed half-way never mistakes an old file it already restored for a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from autopar.files import fsync_dir, fsync_file

# every file compile writes (the program is train.py or generate.py, the others on request)
GENERATED = ("plan.yaml", "train.py", "generate.py", "mindformers.yaml", "megatron.sh",
             "deepspeed.json", "manifest.json")
PREVIOUS = ".autopar-previous"  # the old generated files while a swap is under way
NEW_PREFIX = ".autopar-new-"  # where the new files are written inside an existing artifact
OLD_PREFIX = ".autopar-old-"  # a committed swap's old files, being removed
_MOVED = ".moved"  # in PREVIOUS: every old generated file is in it (the new ones may follow)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (every rank of a job may load it at once)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM received inside the block take effect when it ends (the main
    thread only: elsewhere Python cannot install handlers, and the block is a few renames)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda num, _frame: caught.append(num))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for num in caught[:1]:
            signal.raise_signal(num)


def recover(directory: Path, drop_unfinished: bool = False) -> bool:
    """Put back the previous artifact where a swap was cut short; with ``drop_unfinished``
    (the compile about to write, not a reader: another compile may be writing one now), also
    drop new files a killed compile left unfinished. True when there was anything to do.
    Entries that are not generated files are never touched."""
    directory = Path(directory)
    if not directory.is_dir():
        return False
    # a committed swap's old files are garbage to any caller; unfinished new files only to
    # the compile about to write
    stale = [p for p in directory.iterdir() if p.name.startswith(OLD_PREFIX)
             or (drop_unfinished and p.name.startswith(NEW_PREFIX))]
    previous = directory / PREVIOUS
    if not stale and not previous.exists():
        return False
    with _locked(directory), _signals_deferred():
        _roll_back(directory)
        for path in stale:
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
    return True


def _roll_back(directory: Path) -> None:
    """Undo a swap cut short (the caller holds the lock): new files that had come in go, the
    old generated files go back. Safe to cut short and redo at any point."""
    previous = directory / PREVIOUS
    if not previous.is_dir():
        return
    moved = previous / _MOVED
    if moved.exists():
        # every old file is in PREVIOUS, so any generated file in the directory is a new one
        for name in GENERATED:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
        fsync_dir(directory)
        # from here on a generated file in the directory is an old one already put back
        moved.unlink()
        fsync_dir(previous)
    for name in GENERATED:  # the manifest last: it names the program
        if (previous / name).exists():
            os.replace(previous / name, directory / name)
    fsync_dir(directory)
    shutil.rmtree(previous, ignore_errors=True)


def _discard(previous: Path) -> None:
    """Commit a swap: ``previous`` (the old files) leaves its name in one rename, then goes.
    Removing it in place could be cut short with the marker gone and old files left, which
    :func:`recover` would put back over the new ones."""
    trash = previous.with_name(f"{OLD_PREFIX}{os.getpid()}-{time.monotonic_ns()}")
    os.rename(previous, trash)
    fsync_dir(previous.parent)
    shutil.rmtree(trash, ignore_errors=True)


def new_files_dir(directory: Path) -> Path:
    """A fresh directory inside ``directory`` for the new generated files (the same
    filesystem: the swap is renames)."""
    import tempfile

    return Path(tempfile.mkdtemp(dir=directory, prefix=NEW_PREFIX))


def swap_in(new: Path, directory: Path) -> None:
    """Replace ``directory``'s generated files by ``new``'s (each file in ``new`` is a
    generated name or a ``*.edited.py`` copy); everything else in ``directory`` stays."""
    for path in new.iterdir():
        fsync_file(path)
    names = sorted(p.name for p in new.iterdir() if p.name != "manifest.json")
    names.append("manifest.json")  # last: it commits the program and the plan it was made from
    previous = directory / PREVIOUS
    with _locked(directory), _signals_deferred():
        previous.mkdir()
        try:
            for name in GENERATED:
                if (directory / name).exists():
                    os.replace(directory / name, previous / name)
            (previous / _MOVED).touch()
            fsync_dir(previous)
            for name in names:
                os.replace(new / name, directory / name)
            fsync_dir(directory)
        except BaseException:
            _roll_back(directory)
            raise
        _discard(previous)
        new.rmdir()
