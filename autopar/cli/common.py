"""Shared CLI helpers: error lines, progress, model loading."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import click


def fail_message(message: str, ctx: click.Context | None) -> str:
    """One line: ``autopar: error: <cause and fix>``."""
    text = " ".join(message.split())
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"autopar: error: {text}{hint}"


@contextlib.contextmanager
def progress(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while slow work runs; silent when quiet or not on a terminal."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def capture_model(spec: str, batch: int, seq: int | None, quiet: bool = False):
    """Capture MODEL given on the command line (shipped name, config path, module:factory, .onnx)."""
    from autopar.capture import capture
    from autopar.models.spec import is_factory, load_factory

    with progress(f"capturing {spec}", quiet):
        if is_factory(spec):
            model, inputs = load_factory(spec)
            return capture(model, inputs or None)
        return capture(spec, batch=batch, seq=seq)
