"""Expert capacity: each expert takes at most C token copies per routing group, and the copies
past it are dropped (their combine weight is 0: the token passes on through the residual
alone), as GShard routes (Lepikhin et al. 2021, Algorithm 1).

* Capacity, as Megatron-Core sizes it (``moe_expert_capacity_factor``):
  ``C = ceil(capacity_factor * tokens * top_k / experts)`` for a group of ``tokens`` tokens.
* Priority, as GShard's: every token's first choice before any token's second choice, and
  within one choice the tokens in sequence order. A copy is kept while fewer than C copies
  are already kept for its expert.
* The routing group is one sequence. GShard and Megatron-Core count per device (all the tokens
  a rank routes at once); that group changes with data parallelism and micro-batching, so the
  same run would drop other tokens under another plan. A sequence is the same under every plan
  that keeps sequences whole (context parallelism splits them: refused).

Without a capacity factor, routing is dropless, as Hugging Face's MoE models run.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.parallel.expert_parallel import EXPERTS_SIGNATURE


def expert_capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Copies one expert may take from a group of ``tokens`` tokens."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def kept_copies(top_k_index: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Which token copies an expert keeps: ``top_k_index`` is ``(groups, tokens, k)`` (each
    token's chosen experts, first choice first); returns a bool mask of its shape."""
    groups, tokens, k = top_k_index.shape
    # choice-major order within each group: all first choices, then all second choices, ...
    ordered = top_k_index.transpose(1, 2).reshape(groups, k * tokens)
    one_hot = torch.nn.functional.one_hot(ordered, experts)
    # each copy's place in its expert's queue: copies of the same expert before it
    place = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1
    keep = place < capacity
    return keep.view(groups, k, tokens).transpose(1, 2)


class CapacityCounter:
    """Token copies routed and dropped since the last :meth:`take` (this rank's)."""

    def __init__(self) -> None:
        self.routed = 0
        self.dropped = 0

    def take(self) -> tuple[int, int]:
        routed, dropped = self.routed, self.dropped
        self.routed = self.dropped = 0
        return routed, dropped


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that run a layer's experts (transformers 5's ``forward(hidden_states,
    top_k_index, top_k_weights)``, or autopar's expert-parallel drop-in for one)."""
    found = []
    for name, module in model.named_modules():
        try:
            params = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            continue
        if params == EXPERTS_SIGNATURE:
            found.append((name, module))
    return found


def refuse_split_sequences(mesh: dict[str, int], remedy: str) -> None:
    """Capacity is counted per whole sequence inside one module tree: refuse pipeline stages
    and context parallelism, in one line ending with ``remedy``."""
    if mesh["pp"] > 1 or mesh.get("cp", 1) > 1:
        raise PlanError(f"expert capacity is counted per whole sequence inside one module "
                        f"tree: re-plan with constraints pp=1,cp=1, or {remedy}")


def install_capacity(model: nn.Module, capacity_factor: float, experts: int,
                     top_k: int) -> CapacityCounter:
    """Drop the token copies past each expert's capacity in every MoE layer of ``model`` (after
    it is parallelized: the hook must sit on the module that is called). Returns the counter
    the layers add their routed and dropped copies to."""
    if not capacity_factor > 0:
        raise PlanError(f"the capacity factor must be more than 0; got {capacity_factor}")
    layers = _experts_modules(model)
    if not layers or not experts or not top_k:
        raise PlanError(f"{type(model).__name__} routes no tokens to experts (no top-k expert "
                        f"layer found); drop --capacity-factor")
    counter = CapacityCounter()
    blocks = dict(model.named_modules())

    def record_sequence(block: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None or hidden.dim() != 3:
            raise PlanError(f"{type(block).__name__} did not receive (batch, sequence, hidden) "
                            f"hidden states; capacity is counted per sequence: drop "
                            f"--capacity-factor")
        block._capacity_sequence = hidden.shape[1]

    def drop_past_capacity(owner: nn.Module):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            values = dict(zip(EXPERTS_SIGNATURE, args, strict=False), **kwargs)
            index, weights = values["top_k_index"], values["top_k_weights"]
            sequence = owner._capacity_sequence
            groups = index.shape[0] // sequence
            capacity = expert_capacity(sequence, top_k, experts, capacity_factor)
            keep = kept_copies(index.reshape(groups, sequence, -1), experts, capacity)
            keep = keep.reshape(index.shape)
            counter.routed += keep.numel()
            counter.dropped += int((~keep).sum())
            values["top_k_weights"] = weights * keep.to(weights.dtype)
            if hasattr(module, "kept"):  # expert parallelism: dropped copies are not sent
                module.kept = keep
            return (), values
        return hook

    for name, module in layers:
        owner = blocks[name.rsplit(".", 1)[0]] if "." in name else model
        owner.register_forward_pre_hook(record_sequence, with_kwargs=True)
        module.register_forward_pre_hook(drop_past_capacity(owner), with_kwargs=True)
    return counter
