"""Pipeline stages for cached generation: each rank runs only the layers of its chunks, with
its own layers' caches, and hands the hidden states on at every change of owner.

Every rank runs the whole model's forward, but a layer another rank owns is a :class:`Relay`
(it returns its input untouched, holds nothing and caches nothing). Where ownership changes,
the owner of the layer before sends its output and the owner of the layer after receives it
in place of its input (point-to-point in the pipeline group, in model order, so interleaved
chunks hand on several times per token). The embedding runs on every rank (the first
layer's owner gets the right one); the logits that count are those of the last layer's
owner, whose next token every rank then receives.

A layer's cache is filled only on its owner, so the mask sizes a rank's cache reports come
from its first own layer (:class:`StageCache`), not from layer 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError
from autopar.parallel.pipeline import chunk_ranges
from autopar.plan import Plan


class Relay(nn.Module):
    """A layer another pipeline rank runs: its input passes through."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def stage_cache(config, max_cache_len: int, first_layer: int):
    """transformers' StaticCache whose mask sizes and length come from ``first_layer`` (the
    first layer this rank owns and fills)."""
    from transformers import StaticCache

    class StageCache(StaticCache):
        def get_query_offset(self, layer_idx: int = 0):
            return super().get_query_offset(first_layer)

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            return super().get_mask_sizes(query_length, first_layer)

        def get_seq_length(self, layer_idx: int = 0):
            return super().get_seq_length(first_layer)

    return StageCache(config=config, max_cache_len=max_cache_len)


def stage_owners(plan: Plan) -> dict[str, int]:
    """Layer module path -> the pipeline rank that runs it (chunk c on rank c % pp)."""
    pp = plan.mesh["pp"]
    owners = {}
    for chunk, (start, end) in enumerate(chunk_ranges(plan)):
        for block in plan.model.blocks[start:end]:
            if block.is_layer:
                owners[block.name] = chunk % pp
    return owners


@dataclass
class GenerationStage:
    """This rank's part of a pipeline for generation (:func:`split_stages`)."""

    group: object  # the pipeline process group
    layers: list[str]  # the layers this rank runs and caches, in model order
    first_layer: int  # the cache index of the first of them
    last: int  # the pipeline rank whose logits count (the last layer's owner)

    def cache(self, config, max_cache_len: int):
        """A static cache whose mask sizes come from this rank's first layer."""
        return stage_cache(config, max_cache_len, self.first_layer)

    def agree(self, token: torch.Tensor) -> torch.Tensor:
        """The last stage's token, on every rank of the pipeline."""
        dist.broadcast(token, group_src=self.last, group=self.group)
        return token


def split_stages(model: nn.Module, owners: dict[str, int], pp_group) -> GenerationStage:
    """Turn ``model`` into this rank's generation stage (in place): the layers ``owners``
    gives to other pipeline ranks become Relays, and hand-off hooks send and receive the
    hidden states at every change of owner."""
    rank = dist.get_rank(pp_group)
    paths = list(owners)
    if not paths:
        raise PlanError("the plan records no layers to split into pipeline stages; re-plan "
                        "with constraints pp=1")
    mine = [p for p in paths if owners[p] == rank]
    first = 0
    if mine:
        attention = next((m for m in model.get_submodule(mine[0]).modules()
                          if hasattr(m, "layer_idx")), None)
        first = int(attention.layer_idx) if attention is not None else 0
    for before, after in zip(paths, paths[1:], strict=False):
        sender, receiver = owners[before], owners[after]
        if sender == receiver:
            continue
        if rank == sender:
            model.get_submodule(before).register_forward_hook(_send(receiver, pp_group))
        if rank == receiver:
            model.get_submodule(after).register_forward_pre_hook(_receive(sender, pp_group),
                                                                with_kwargs=True)
    for path in paths:
        if owners[path] != rank:
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, Relay())
    return GenerationStage(pp_group, mine, first, owners[paths[-1]])


def split_for_generation(model: nn.Module, plan: Plan, pp_group) -> GenerationStage:
    """:func:`split_stages` with the owners of ``plan``'s chunks."""
    return split_stages(model, stage_owners(plan), pp_group)


def _send(receiver: int, group):
    def hook(_module, _args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        dist.send(hidden.contiguous(), group_dst=receiver, group=group)
    return hook


def _receive(sender: int, group):
    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        incoming = torch.empty_like(hidden)
        dist.recv(incoming, group_src=sender, group=group)
        if args:
            return (incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": incoming}
    return hook
