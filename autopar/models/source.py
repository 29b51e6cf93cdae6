"""Where a model comes from, recorded so every rank can rebuild it identically."""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.models.hf import build_model, load_config
from autopar.models.spec import load_factory


def describe_source(model: object) -> dict:
    """A JSON-able recipe for ``model``: a Hugging Face config, or a class and its dataclass
    config, or a ``module:factory`` string."""
    if isinstance(model, str):
        if ":" in model and not model.endswith(".onnx"):
            return {"kind": "factory", "spec": model}

        return {"kind": "hf_config", "config": load_config(model)}
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            cfg = config.to_dict()
            cfg.setdefault("model_type", getattr(config, "model_type", None))
            return {"kind": "hf_config", "config": _jsonable(cfg)}
        cfg = getattr(model, "cfg", None)
        if cfg is not None and dataclasses.is_dataclass(cfg):
            cls = type(model)
            return {"kind": "class", "class": f"{cls.__module__}:{cls.__qualname__}",
                    "config_class": f"{type(cfg).__module__}:{type(cfg).__qualname__}",
                    "config": dataclasses.asdict(cfg)}
    raise PlanError(f"cannot record how to rebuild a {type(model).__name__}: pass a shipped "
                    f"name, a config.json, a 'module:factory' string, or a model whose .cfg is "
                    f"a dataclass")


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, (str, int, float, bool, type(None), list, dict)):
            out[k] = v
        elif isinstance(v, torch.dtype):
            out[k] = str(v).removeprefix("torch.")
    return out


def _resolve(path: str) -> object:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_from_source(source: dict, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model in fp32 on ``device`` with weights drawn from ``seed`` (the same on
    every rank, so a sharded run starts where a single process would).

    ``device="meta"`` allocates no weights: parallelise the model, then fill only this rank's
    shards with :func:`autopar.parallel.init.materialize`.
    """
    torch.manual_seed(seed)
    kind = source.get("kind")
    if kind == "hf_config":
        return build_model(dict(source["config"]), device=device, dtype=torch.float32)
    if kind == "class":
        cfg_cls = _resolve(source["config_class"])
        cls = _resolve(source["class"])
        with torch.device(device):
            return cls(cfg_cls(**source["config"]))
    if kind == "factory":
        if torch.device(device).type == "meta":
            # the factory's own allocations land on meta too, so no rank ever holds the model
            with torch.device("meta"):
                model, _ = load_factory(source["spec"])
        else:
            model, _ = load_factory(source["spec"])
        return model.to(device)
    raise PlanError(f"unknown model source kind {kind!r} in the artifact manifest")
