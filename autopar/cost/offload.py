"""What a plan can offload to the host, and which of it is model state.

A leaf module (nothing of autopar's imported): the cost model, the plan and the runtime all
read it, and the cost model is imported while the plan package loads.
"""

from __future__ import annotations

OFFLOADS = ("optimizer", "params", "activations")
# the offloads that move model state (parameters, gradients, optimizer states) to the host;
# "activations" moves only what the backward reads
STATE_OFFLOADS = frozenset({"optimizer", "params"})
