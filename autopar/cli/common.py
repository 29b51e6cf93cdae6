"""Shared CLI helpers: error lines, progress, model loading."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import click

from autopar.capture import capture
from autopar.errors import PlanError
from autopar.models.spec import is_factory, load_factory
from autopar.plan import Plan
from autopar.plan.plan import write_text_atomic


@contextlib.contextmanager
def progress(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while slow work runs; silent when quiet or not on a terminal."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def capture_model(spec: str, batch: int, seq: int | None, quiet: bool = False,
                  peft: object = None):
    """Capture MODEL given on the command line (shipped name, config path, module:factory,
    .onnx), transformed by a fine-tuning method when ``peft`` names one."""
    with progress(f"capturing {spec}", quiet):
        if is_factory(spec):
            model, inputs = load_factory(spec)
            return capture(model, inputs or None, peft=peft)
        return capture(spec, batch=batch, seq=seq, peft=peft)


def load_plan(path: str):
    """A plan file, or an artifact directory holding ``plan.yaml``."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        if not (p / "plan.yaml").is_file():
            raise PlanError(f"{p} is a directory without plan.yaml; pass a plan file or an "
                            f"artifact directory from `autopar compile`")
        p = p / "plan.yaml"
    return Plan.load(p)


_SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".md": "markdown", ".markdown": "markdown",
                   ".json": "json", ".txt": "text"}


def output_format(fmt: str | None, out: str | None, allowed: tuple[str, ...]) -> str:
    """``--format`` if given, else what ``--out``'s suffix says (report.html -> html), else text."""
    if fmt:
        return fmt
    if out:
        from pathlib import Path

        guess = _SUFFIX_FORMATS.get(Path(out).suffix.lower())
        if guess in allowed:
            return guess
    return "text"


def check_output_path(out: str) -> None:
    """Fail before any work when ``--out`` cannot be written."""
    from pathlib import Path

    p = Path(out)
    if p.is_dir():
        raise PlanError(f"--out {p} is a directory; give a file name such as {p / 'report.html'}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise PlanError(f"cannot write {p}: folder {parent} does not exist; create it or choose "
                        f"another --out")


def write_output(text: str, out: str | None, quiet: bool) -> None:
    """Print ``text``, or write it to ``out`` atomically (temp file + rename: an error leaves
    no partial file) and say where."""
    if out is None:
        click.echo(text, nl=False)
        return

    check_output_path(out)
    path = write_text_atomic(out, text)
    if not quiet:
        click.echo(f"wrote {path}", err=True)
