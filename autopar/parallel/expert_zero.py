"""ZeRO-1 under expert parallelism: the optimizer states sharded over two groups at once.

Under expert parallelism the dense parameters are replicated over the dp x ep ranks and the
experts' shards over the dp ranks (see :mod:`autopar.parallel.expert_parallel`); the gradients
are synchronised as at ZeRO-0 (DDP or the pipeline's all-reduce for the dense ones,
:func:`~autopar.parallel.expert_parallel.sync_expert_grads` for the experts). ZeRO-1 then gives
each parameter one owner among the ranks that replicate it: the owner keeps its optimizer
states and steps it, and broadcasts the new values to the other replicas.

torch's ZeroRedundancyOptimizer shards over one group of plain tensors; the experts are
DTensors over another group, so this is the same scheme with an owner group per parameter:
an expert's (a DTensor on the ep mesh) is the dp group, whose ranks hold the same ep shard,
and its local shard is what is stepped and broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.parallel.expert_parallel import dense_mesh


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert-parallel expert's parameter: a DTensor on the ep mesh."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``p`` (an alias: writing it writes the parameter)."""
    return p.to_local() if isinstance(p, DTensor) else p


class ExpertZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` with its states sharded as ZeRO-1 under expert parallelism: each
    dense parameter owned by one rank of ``dense_group`` (dp x ep), each expert parameter by
    one rank of ``expert_group`` (dp); None stands for a group of this rank alone.

    ``param_groups`` holds every parameter (the learning-rate schedule, clipping and
    ``zero_grad`` see them all); ``optim`` is the optimizer over this rank's own parameters,
    which is what a checkpoint saves and loads (as for ZeroRedundancyOptimizer's ``optim``).
    Gradients must be synchronised before :meth:`step`.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer],
                 dense_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None,
                 **defaults) -> None:
        super().__init__(params, defaults)
        groups = {False: dense_group, True: expert_group}
        ordered = [p for g in self.param_groups for p in g["params"]]
        # (group, owner's rank in it) per parameter; the same on every rank of the group,
        # which holds the same parameters in the same order
        self._owners: dict[int, tuple[dist.ProcessGroup | None, int]] = {}
        for expert, group in groups.items():
            size = group.size() if group is not None else 1
            loads = [0] * size
            mine = [p for p in ordered if is_expert_parameter(p) == expert]
            # largest first to the least loaded rank, as ZeroRedundancyOptimizer partitions
            for p in sorted(mine, key=lambda t: -_local(t).numel()):
                owner = loads.index(min(loads))
                loads[owner] += _local(p).numel()
                self._owners[id(p)] = (group, owner)
        own = [{**{k: v for k, v in g.items() if k != "params"},
                "params": [p for p in g["params"] if self._owns(p)]} for g in self.param_groups]
        self.optim = optimizer_class(own, **defaults)

    def _owns(self, p: torch.Tensor) -> bool:
        group, owner = self._owners[id(p)]
        return owner == (group.rank() if group is not None else 0)

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's parameters (with the wrapper's current hyperparameters), then
        broadcast every parameter from its owner to the other ranks of its group."""
        if closure is not None:
            raise ValueError("ExpertZeroOptimizer takes no closure")
        for wrapper, own in zip(self.param_groups, self.optim.param_groups, strict=True):
            own.update({k: v for k, v in wrapper.items() if k != "params"})
        self.optim.step()
        self._broadcast()

    def _broadcast(self) -> None:
        """One broadcast per (group, owner, dtype): the owner's parameters, flattened."""
        buckets: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        groups: dict[int, dist.ProcessGroup] = {}
        for g in self.param_groups:
            for p in g["params"]:
                group, owner = self._owners[id(p)]
                if group is None or group.size() == 1:
                    continue
                groups[id(group)] = group
                buckets.setdefault((id(group), owner, p.dtype), []).append(_local(p))
        for (key, owner, _), tensors in buckets.items():
            group = groups[key]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def expert_zero_optimizer(param_groups: list[dict], mesh: DeviceMesh,
                          optimizer_class: type[torch.optim.Optimizer], **defaults
                          ) -> ExpertZeroOptimizer:
    """:class:`ExpertZeroOptimizer` over ``mesh``'s groups (the generated program's ZeRO-1
    under expert parallelism): dense states over dp x ep, experts' over dp."""
    dp = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
    return ExpertZeroOptimizer(param_groups, optimizer_class, dense_mesh(mesh).get_group(), dp,
                               **defaults)
