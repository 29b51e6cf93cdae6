"""Putting a freshly written artifact in place of an old one without losing anything.

An artifact directory holds two kinds of entries: the files ``autopar compile`` generates
(:data:`GENERATED`) and everything a run or the user put there (``checkpoints/``, ``logs/``,
notes, hand-edited programs kept as ``*.edited.py``). Re-compiling replaces only the first
kind, and never moves or removes the second: a checkpoint stays where it was at every instant.

The swap moves the old generated files into ``DIR/.autopar-previous``, writes a marker when
that is complete, then moves the new files in (the manifest last) and drops the old ones.
SIGINT and SIGTERM wait until the swap is over. A process killed outright (SIGKILL, power)
leaves ``.autopar-previous`` behind; :func:`recover` (run by the next compile and by every
load) puts the previous artifact back, so a directory always holds one whole artifact.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from autopar.files import fsync_dir, fsync_file

# every file compile writes (the program is train.py or generate.py, the others on request)
GENERATED = ("plan.yaml", "train.py", "generate.py", "mindformers.yaml", "megatron.sh",
             "deepspeed.json", "manifest.json")
PREVIOUS = ".autopar-previous"  # the old generated files while a swap is under way
NEW_PREFIX = ".autopar-new-"  # where the new files are written inside an existing artifact
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
    stale = [p for p in directory.iterdir()
             if drop_unfinished and p.name.startswith(NEW_PREFIX)]
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
    """Undo a swap cut short (the caller holds the lock): the old generated files go back,
    new ones that had come in go."""
    previous = directory / PREVIOUS
    if not previous.is_dir():
        return
    if (previous / _MOVED).exists():  # new files may have come in: they go
        for name in GENERATED:
            if not (previous / name).exists() and (directory / name).exists():
                (directory / name).unlink()
    for name in GENERATED:  # the manifest last: it names the program
        if (previous / name).exists():
            os.replace(previous / name, directory / name)
    fsync_dir(directory)
    shutil.rmtree(previous, ignore_errors=True)


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
        shutil.rmtree(previous)
        new.rmdir()
