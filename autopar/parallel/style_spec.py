"""Tensor-parallel styles as typed records, never as code to evaluate.

A layout names, per module, the ParallelStyle ``parallelize_module`` gets. The generated
program prints it as source (``ColumnParallel([64, 64, 64], use_local_output=False)``) and the
runtime builds the same object. Both come from one record, :class:`StyleSpec`: a constructor
from a fixed list and its arguments as plain values (ints, bools, None, lists and dicts of
them, strings, and nested placement records). The source is rendered with ``repr``; the
object is built by calling the listed constructor. A value read from a plan file can only ever
be an argument, never code.

A StyleSpec is also a ``str`` (its source text), so that code reading a layout's text (the
program generator's imports, tests) reads it as before.
"""

from __future__ import annotations

from collections.abc import Callable

_NAMES = ("ColumnParallel", "RowParallel", "RowwiseParallel", "SequenceParallel", "Relayout",
          "KvHeadReplicated", "WholeKvProjection", "HeadSplit", "SharedRotaryKey",
          "GraphParallel", "Replicate", "Shard")


class StyleSpec(str):
    """One constructor call: ``name(*args, **kwargs)``, its source text as the str value."""

    name: str
    args: tuple
    kwargs: tuple[tuple[str, object], ...]

    def __new__(cls, name: str, *args: object, **kwargs: object) -> StyleSpec:
        if name not in _NAMES:
            raise ValueError(f"{name!r} is not a tensor-parallel style autopar builds")
        for value in (*args, *kwargs.values()):
            _check_value(value)
        parts = [_source(a) for a in args] + [f"{k}={_source(v)}" for k, v in kwargs.items()]
        spec = super().__new__(cls, f"{name}({', '.join(parts)})")
        spec.name, spec.args, spec.kwargs = name, args, tuple(kwargs.items())
        return spec

    def __repr__(self) -> str:  # as source: a tuple of styles prints as the code it is
        return str.__str__(self)

    def __reduce__(self):  # copies and pickles keep the record, not only the text
        return (_rebuild, (self.name, self.args, self.kwargs))

    def build(self, constructors: dict[str, Callable]) -> object:
        """The object this record describes, from ``constructors`` (name -> class)."""
        return constructors[self.name](*(_built(a, constructors) for a in self.args),
                                       **{k: _built(v, constructors) for k, v in self.kwargs})


def _rebuild(name: str, args: tuple, kwargs: tuple) -> StyleSpec:
    return StyleSpec(name, *args, **dict(kwargs))


def _check_value(value: object) -> None:
    if isinstance(value, StyleSpec) or value is None or type(value) in (bool, int, float, str):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_value(item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_value(key)
            _check_value(item)
        return
    raise TypeError(f"a style argument must be plain data, got {type(value).__name__}")


def _source(value: object) -> str:
    if isinstance(value, StyleSpec):
        return str.__str__(value)
    if isinstance(value, tuple):
        inner = ", ".join(_source(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)  # plain data: a literal


def _built(value: object, constructors: dict[str, Callable]) -> object:
    if isinstance(value, StyleSpec):
        return value.build(constructors)
    if isinstance(value, tuple):
        return tuple(_built(v, constructors) for v in value)
    return value


REPLICATE = StyleSpec("Replicate")


def shard(dim: int) -> StyleSpec:
    """``Shard(dim)`` as a record."""
    return StyleSpec("Shard", int(dim))
