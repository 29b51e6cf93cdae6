"""Capture pass: a model (nn.Module, shipped/HF config, or ONNX file) -> autopar.ir.Graph."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from autopar.capture.attention_hook import NOT_A_MODULE, context_parallel_refusal
from autopar.capture.cache import graph_key, load_graph, store_graph
from autopar.capture.torch_capture import capture_module
from autopar.errors import CaptureError
from autopar.ir.blocks import assign_blocks
from autopar.ir.graph import Graph
from autopar.models.hf import build_model, load_config, max_positions, token_inputs
from autopar.peft import apply_peft, parse_peft


def _as_tuple(example_inputs: object) -> tuple:
    if example_inputs is None:
        return ()
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def capture(
    model: nn.Module | str | Path,
    example_inputs: object = None,
    *,
    kwargs: dict | None = None,
    batch: int = 1,
    seq: int | None = None,
    peft: object = None,
) -> Graph:
    """Capture a model into autopar's IR.

    ``model`` is an ``nn.Module`` (with ``example_inputs``, a tuple whose tensors have the batch
    dimension first; meta tensors are fine), a path to an ``.onnx`` file, or a Hugging Face
    config (a shipped name such as ``"llama3-8b"``, a ``config.json`` path or its folder), which is
    built on the meta device and fed ``batch`` x ``seq`` token ids. Raises
    :class:`autopar.CaptureError` naming what failed and how to fix it.

    ``peft`` (a fine-tuning method, see :func:`autopar.peft.parse_peft`) transforms the model
    first, in place for an nn.Module as peft's ``get_peft_model`` does: its frozen and
    trainable parameters are recorded per parameter.

    A config captured before with the same batch, sequence and method is read from the graph
    cache (:mod:`autopar.capture.cache`; ``AUTOPAR_CACHE=off`` turns it off).
    """
    key = None  # the graph cache's key, where the capture reads only a config (capture.cache)
    if isinstance(model, (str, Path)):
        text = str(model)
        if text.lower().endswith(".onnx"):
            from autopar.capture.onnx_import import onnx_graph

            if peft is not None:
                raise CaptureError("a fine-tuning method transforms a PyTorch model, not an "
                                   "ONNX file; pass the model or its Hugging Face config")
            graph = onnx_graph(Path(text))
            graph.context_parallel_refusal = NOT_A_MODULE
        else:
            cfg = load_config(text)
            seq = seq or min(max_positions(cfg), 4096)
            if example_inputs is None and kwargs is None:  # a pure function of these: cached
                key = graph_key(cfg, batch, seq, parse_peft(peft).to_dict()
                                if peft is not None else None)
                cached = load_graph(key)
                if cached is not None:
                    return cached
            module = build_model(cfg, device="meta")
            _adapt(module, peft)
            args = _as_tuple(example_inputs) or token_inputs(batch, seq)
            graph = _capture_module(module, args, kwargs, cfg)
    elif isinstance(model, nn.Module):
        args = _as_tuple(example_inputs)
        if not args:
            raise CaptureError(
                f"no example inputs for {type(model).__name__}; pass a tuple of tensors shaped "
                f"like a real batch, e.g. (torch.zeros(1, 128, dtype=torch.long, device='meta'),)"
            )
        cfg = model.config.to_dict() if hasattr(model, "config") and hasattr(model.config, "to_dict") else None
        _adapt(model, peft)
        graph = _capture_module(model, args, kwargs, cfg)
    else:
        raise CaptureError(
            f"cannot capture a {type(model).__name__}; pass an nn.Module, an .onnx path or a "
            f"Hugging Face config name/path"
        )
    assign_blocks(graph)
    if peft is not None:
        graph.peft = parse_peft(peft).to_dict()
    if key is not None:
        store_graph(key, graph)
    return graph


def _adapt(module: nn.Module, peft: object) -> None:
    if peft is not None:
        apply_peft(module, peft)


def _capture_module(module: nn.Module, args: tuple, kwargs: dict | None, cfg: dict | None) -> Graph:
    with torch.no_grad():
        graph = capture_module(module, args, kwargs, cfg)
    graph.context_parallel_refusal = context_parallel_refusal(module)
    return graph


__all__ = ["capture"]
