"""Resolve a MODEL argument of the CLI: a shipped name, a config.json (or its folder), a Python
``module:factory``, or an ``.onnx`` file."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from torch import nn

from autopar.errors import CaptureError


def load_factory(spec: str) -> tuple[nn.Module, tuple]:
    """``pkg.mod:make`` -> call ``make()``; it returns a model or ``(model, example_inputs)``."""
    mod_name, _, attr = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # let users point at a module in the current folder
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise CaptureError(f"cannot import '{mod_name}' for model '{spec}': {exc}; "
                           f"check the module name and PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CaptureError(f"'{attr}' in module '{mod_name}' is not a callable; MODEL must be "
                           f"'module:factory' where factory() returns a model or (model, inputs)")
    made = factory()
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        inputs = made[1] if isinstance(made[1], tuple) else (made[1],)
        return made[0], inputs
    if isinstance(made, nn.Module):
        return made, ()
    raise CaptureError(f"{spec}() returned {type(made).__name__}; return an nn.Module or "
                       f"(model, example_inputs)")


def is_factory(spec: str) -> bool:
    return ":" in spec and not Path(spec).exists() and not spec.lower().endswith(".onnx")
