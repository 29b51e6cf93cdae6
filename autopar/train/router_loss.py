"""The router's losses of a mixture-of-experts model: the auxiliary load-balancing loss and the
router z-loss, added to the language-model loss, and the expert load they are logged with.

* Load balancing: the Switch Transformer form (Fedus et al. 2021, eqs. 4-6), as Hugging Face's
  MoE models (Mixtral, Qwen2-MoE) compute it when asked (``output_router_logits``): with
  ``f_e`` the share of top-k assignments that go to expert ``e`` and ``P_e`` the mean router
  probability of ``e``, both over every routed token of every MoE layer,
  ``aux = E * sum_e f_e * P_e``.
* z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of the squared log-sum-exp of
  the router logits, per MoE layer, summed over the layers (Megatron-Core's convention).

Both are products or means over all of a micro-batch's tokens. When context parallelism
splits the sequences, each rank holds part of the tokens: the token counts are summed over the
cp group first, and each rank returns its *share*, the terms its own tokens contribute; the
shares add up to one process's value, and the gradient of each rank's share is the exact
gradient of the whole-sequence loss through its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.errors import PlanError
from autopar.train.loss import full


@dataclass(frozen=True)
class RouterLoss:
    """What the router's losses need: their weights (``aux_coef``, ``z_coef``; 0 is off),
    how many experts the router picks from and how many it picks per token."""

    aux_coef: float
    z_coef: float
    experts: int
    top_k: int


@dataclass
class RouterTerms:
    """One micro-batch's router losses on this rank (shares under cp) and the top-k
    assignments per expert (summed over the MoE layers and, under cp, the cp ranks)."""

    aux: torch.Tensor
    z: torch.Tensor
    load: torch.Tensor

    def weighted(self, spec: RouterLoss) -> torch.Tensor:
        """The terms as they enter the loss: ``aux_coef * aux + z_coef * z``."""
        return spec.aux_coef * self.aux + spec.z_coef * self.z


def routing_shape(model: nn.Module) -> tuple[int, int]:
    """(experts the router picks from, experts it picks per token) from the model's config;
    (0, 0) for a model without a top-k router."""
    config = getattr(model, "config", None)
    experts = next((int(getattr(config, name)) for name in
                    ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(config, name, None)), 0)
    return experts, int(getattr(config, "num_experts_per_tok", 0) or 0)


def router_loss_of(model: nn.Module, aux_coef: float | None = None,
                   z_coef: float = 0.0) -> RouterLoss | None:
    """The router losses to train ``model`` with, or None. ``aux_coef`` None follows the
    model's config as Hugging Face does (its ``router_aux_loss_coef`` when
    ``output_router_logits`` is set, else off); a number overrides it. A model without a
    top-k router refuses a non-zero coefficient."""
    config = getattr(model, "config", None)
    experts, top_k = routing_shape(model)
    if aux_coef is None:
        aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
            if getattr(config, "output_router_logits", False) else 0.0
    if aux_coef < 0 or z_coef < 0:
        raise PlanError(f"router loss coefficients must be 0 or more; got aux {aux_coef}, "
                        f"z {z_coef}")
    if not aux_coef and not z_coef:
        return None
    if not experts or not top_k:
        raise PlanError(f"{type(model).__name__} has no top-k expert router (its config names "
                        f"no experts or experts per token); drop --router-aux-loss and "
                        f"--router-z-loss")
    return RouterLoss(aux_coef, z_coef, experts, top_k)


def router_logits_of(output: object) -> tuple[torch.Tensor, ...]:
    """The per-layer router logits a model returned (``output_router_logits=True``)."""
    logits = getattr(output, "router_logits", None)
    if not logits:
        raise PlanError(f"the model returned no router logits ({type(output).__name__}); the "
                        f"router losses read them: train without --router-aux-loss and "
                        f"--router-z-loss")
    return tuple(logits)


def traced_moe_output(output: object, experts: int) -> SimpleNamespace:
    """A traced pipeline's last-stage output as a model output: the flat tuple Hugging Face's
    MoE output becomes when torch's pipeline tracer splits the model (the model's own
    auxiliary loss, a scalar; the logits; each MoE layer's router logits, ``(tokens,
    experts)``)."""
    if hasattr(output, "logits"):
        return output
    items = [t for t in output if isinstance(t, torch.Tensor)]
    logits = [t for t in items if t.ndim == 3]
    if len(logits) != 1:
        raise PlanError(f"the last pipeline stage returned {len(logits)} logits tensors "
                        f"beside the router logits; train without --router-aux-loss and "
                        f"--router-z-loss, or re-plan with constraints pp=1")
    routers = tuple(t for t in items if t.ndim == 2 and t.shape[-1] == experts)
    return SimpleNamespace(logits=logits[0], router_logits=routers)


def router_terms(router_logits: tuple[torch.Tensor, ...], spec: RouterLoss,
                 group=None) -> RouterTerms:
    """This rank's router losses for one micro-batch from each MoE layer's router logits
    ``(tokens, experts)``; ``group``: the cp process group splitting the sequences (None:
    this rank holds whole sequences)."""
    counts = torch.zeros(spec.experts)
    probs = 0.0
    lse_squared = 0.0
    rows = 0
    for layer in router_logits:
        layer = full(layer).float().reshape(-1, spec.experts)
        weights = F.softmax(layer, dim=-1)
        chosen = torch.topk(weights.detach(), spec.top_k, dim=-1).indices
        counts = counts.to(layer.device) + torch.bincount(chosen.reshape(-1),
                                                          minlength=spec.experts).float()
        probs = probs + weights.sum(dim=0)
        lse_squared = lse_squared + torch.logsumexp(layer, dim=-1).square().sum()
        rows += layer.shape[0]
    layers = len(router_logits)
    totals = torch.tensor([float(rows)], device=counts.device)
    if group is not None:  # the counts of the whole sequences: no gradient flows through them
        both = torch.cat([counts, totals])
        dist.all_reduce(both, group=group)
        counts, totals = both[:-1], both[-1:]
    total_rows = totals[0]
    aux = spec.experts * (counts / total_rows * probs / total_rows).sum()
    z = lse_squared * layers / total_rows  # per layer: tokens of the layer = rows / layers
    return RouterTerms(aux=aux, z=z, load=counts)


def load_summary(load: torch.Tensor) -> dict[str, float]:
    """The step record's expert load: the busiest and idlest expert's share of the top-k
    assignments relative to an even share (1.0 is perfectly balanced)."""
    even = load.sum() / load.numel()
    if float(even) == 0:
        return {"expert_load_max": 0.0, "expert_load_min": 0.0}
    return {"expert_load_max": float(load.max() / even),
            "expert_load_min": float(load.min() / even)}
