"""Capture an nn.Module: torch.export (non-strict) first, fx.symbolic_trace as the fallback."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn

from autopar.capture.fx_to_ir import dtype_name, fx_graph_to_ir
from autopar.errors import CaptureError
from autopar.ir.graph import Graph, ParamInfo


def first_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip().splitlines()
    line = next((ln.strip() for ln in text if ln.strip()), type(exc).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def param_table(model: nn.Module) -> tuple[dict[str, ParamInfo], dict[str, str]]:
    """Distinct parameters keyed by canonical FQN, and every FQN (aliases too) -> canonical."""
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    to_canonical: dict[str, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), fqn)
        to_canonical[fqn] = first
        if first != fqn:
            aliases.setdefault(first, []).append(fqn)
    table = {}
    for fqn, p in model.named_parameters():
        table[fqn] = ParamInfo(fqn, tuple(p.shape), dtype_name(p.dtype), p.requires_grad,
                               tuple(aliases.get(fqn, ())))
    return table, to_canonical


def buffer_table(model: nn.Module) -> tuple[dict[str, ParamInfo], dict[str, str]]:
    canonical: dict[int, str] = {}
    to_canonical: dict[str, str] = {}
    for fqn, b in model.named_buffers(remove_duplicate=False):
        to_canonical[fqn] = canonical.setdefault(id(b), fqn)
    table = {fqn: ParamInfo(fqn, tuple(b.shape), dtype_name(b.dtype), False)
             for fqn, b in model.named_buffers()}
    return table, to_canonical


def check_arity(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Fail before tracing when the inputs cannot bind to ``forward``'s signature."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        positional = [p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p.name for p in sig.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise CaptureError(
            f"example inputs do not match {type(model).__name__}.forward{sig}: {exc}; "
            f"pass a tuple of {len(required)} to {len(positional)} tensors "
            f"({', '.join(positional) or 'none'})"
        ) from None


def place_inputs(model: nn.Module, args: tuple) -> tuple:
    """Put inputs where the model is: meta inputs become zeros for a real model (values do not
    matter for tracing), real inputs become meta for a meta model (no memory is spent)."""
    first = next(iter(model.parameters()), None)
    on_meta = first is not None and first.is_meta

    def move(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if on_meta and not x.is_meta:
            return torch.empty_like(x, device="meta")
        if not on_meta and x.is_meta:
            dev = first.device if first is not None else "cpu"
            return torch.zeros(x.shape, dtype=x.dtype, device=dev)
        return x

    return tuple(move(a) for a in args)


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch.export logs and prints failing graphs; the CaptureError says what matters."""
    logger = logging.getLogger("torch")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(old)


@contextlib.contextmanager
def track_module_stack(model: nn.Module) -> Iterator[list[str]]:
    """Record which submodule is running, so a failure can name it."""
    names = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
    stack: list[str] = []
    failed_in: list[str] = []

    def pre(module: nn.Module, _args: object) -> None:
        if id(module) in names:
            stack.append(names[id(module)])
            failed_in[:] = list(stack)

    def post(module: nn.Module, _args: object, _out: object) -> None:
        if id(module) in names and stack:
            stack.pop()
            failed_in[:] = list(stack)

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        yield failed_in
    finally:
        h1.remove()
        h2.remove()


def _describe_location(model: nn.Module, where: list[str]) -> str:
    if not where:
        return type(model).__name__
    path = where[-1]
    try:
        sub = model.get_submodule(path) if path != type(model).__name__ else model
        return f"module '{path}' ({type(sub).__name__})"
    except AttributeError:
        return f"module '{path}'"


def export_graph(model: nn.Module, args: tuple, kwargs: dict, model_config: dict | None) -> Graph:
    """torch.export (non-strict) -> IR."""
    params, param_canon = param_table(model)
    buffers, buffer_canon = buffer_table(model)
    ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
    sig = ep.graph_signature
    param_of: dict[str, str] = {}
    buffer_of: dict[str, str] = {}
    for spec in sig.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.PARAMETER:
            param_of[spec.arg.name] = param_canon.get(spec.target, spec.target)
        elif spec.kind in (torch.export.graph_signature.InputKind.BUFFER,
                           torch.export.graph_signature.InputKind.CONSTANT_TENSOR):
            buffer_of[spec.arg.name] = buffer_canon.get(spec.target, spec.target)
    return fx_graph_to_ir(ep.graph, param_of, buffer_of, params, buffers, "torch.export",
                          model_config)


class _InlineTracer(fx.Tracer):
    """Trace through every module (no leaves) so ops become functions with module paths."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return False


def symbolic_graph(model: nn.Module, args: tuple, model_config: dict | None) -> Graph:
    """fx.symbolic_trace fallback for plain modules that torch.export cannot take."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    params, param_canon = param_table(model)
    buffers, buffer_canon = buffer_table(model)
    tracer = _InlineTracer()
    # parameters the example leaves out keep their defaults as constants: a proxy for an optional
    # input (``positions=None``) would send the trace down the branch for a given tensor
    params_in_order = list(inspect.signature(model.forward).parameters.values())[len(args):]
    concrete = {p.name: p.default for p in params_in_order
                if p.default is not inspect.Parameter.empty}
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(model, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    FakeTensorProp(gm, mode).propagate(*fake_args)
    param_of: dict[str, str] = {}
    buffer_of: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            if node.target in param_canon:
                param_of[node.name] = param_canon[node.target]
            elif node.target in buffer_canon:
                buffer_of[node.name] = buffer_canon[node.target]
    return fx_graph_to_ir(graph, param_of, buffer_of, params, buffers, "fx.symbolic_trace",
                          model_config)


def capture_module(model: nn.Module, args: tuple, kwargs: dict | None = None,
                   model_config: dict | None = None) -> Graph:
    """Capture ``model(*args, **kwargs)``; raise CaptureError naming the failing module."""
    kwargs = dict(kwargs or {})
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # a training graph has no KV cache outputs
    check_arity(model, args, kwargs)
    args = place_inputs(model, args)
    with track_module_stack(model) as where, quiet_torch_logs():
        try:
            return export_graph(model, args, kwargs, model_config)
        except CaptureError:
            raise
        except Exception as export_exc:  # noqa: BLE001 - any tracer failure is reported
            export_where = _describe_location(model, list(where))
            export_reason = first_line(export_exc)
    if not kwargs or set(kwargs) == {"use_cache"}:
        try:
            return symbolic_graph(model, args, model_config)
        except Exception:  # noqa: BLE001 - the export error is the one worth showing
            pass
    raise CaptureError(
        f"cannot capture {type(model).__name__}: torch.export failed in {export_where}: "
        f"{export_reason}; fix: make that module traceable (no data-dependent Python control "
        f"flow or non-tensor outputs; use torch.cond for branches) and check that the example "
        f"inputs run with the model eagerly"
    )


def dtype_of(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return dtype_name(p.dtype) if p is not None else "float32"
