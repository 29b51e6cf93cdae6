"""Which parallel combinations autopar's runtime can run: the search only proposes those.

Kept in one place so the planner, the runtime's own checks and the docs agree.
"""

from __future__ import annotations

from autopar.cost.config import ParallelConfig


def unsupported(config: ParallelConfig, moe: bool = False) -> str | None:
    """Why the runtime cannot run ``config`` (for a mixture-of-experts model when ``moe``),
    or None when it can. Plans priced for another engine (megatron, deepspeed) are exported,
    not run: they are restricted only to what that engine offers."""
    if config.engine == "megatron" and config.zero_stage >= 2:
        return "ZeRO-2/3 on Megatron-LM (its distributed optimizer shards optimizer states only)"
    if config.engine == "megatron" and config.offload:
        return "offload on Megatron-LM"
    if config.engine != "autopar":
        return None
    tp, pp, ep = config.tp, config.pp, config.ep
    if moe and pp > 1:
        return "pipelines of mixture-of-experts models"
    if config.sequence_parallel and tp > 1 and pp > 1:
        return "sequence parallelism inside pipeline stages"
    if ep > 1 and pp > 1:
        return "expert parallelism with pipeline parallelism"
    if ep > 1 and config.sequence_parallel and tp > 1:
        return "expert parallelism with sequence parallelism"
    if ep > 1 and config.zero_stage == 1 and not config.offload:
        return "expert parallelism with ZeRO-1"
    return None
