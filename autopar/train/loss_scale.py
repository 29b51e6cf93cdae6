"""Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", 2018), with
torch.amp.GradScaler's constants, across a whole mesh.

torch's GradScaler checks each rank's gradients on its own and refuses a mix of plain and
DTensor gradients; a pipeline stage that never computes the loss never initialises it. Here
every rank unscales its local shards, the overflow flag is reduced over all ranks (so every rank
skips the same steps), and the scale is one number every rank updates alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000  # steps without overflow before the scale grows


class LossScaler:
    """Scale the loss before backward; unscale the gradients, skip the step on overflow."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.value = INIT_SCALE
        self._good_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale in place; returns whether any rank saw an inf
        or nan (then the step must be skipped)."""
        found = torch.zeros(1, device=self.device)
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in params if p.grad is not None]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in local:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        inverse = torch.full((1,), 1.0 / self.value, device=self.device)
        for (device, _), grads in by_kind.items():
            flag = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse.to(device))
            found += flag.to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.value *= BACKOFF_FACTOR
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= GROWTH_INTERVAL:
            self.value *= GROWTH_FACTOR
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"value": self.value, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.value, self._good_steps = float(state["value"]), int(state["good_steps"])
