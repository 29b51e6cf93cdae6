"""Which parallel combinations autopar's runtime honours as planned: one table, read by the
search (it proposes nothing else) and by the runtime (it refuses a hand-edited plan that asks
for anything else, before any work). The docs' table in docs/runtime.md mirrors it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost.engines import MEGATRON_ENGINES
from autopar.cost.offload import STATE_OFFLOADS
from autopar.cost.recompute_policy import RECOMPUTE_MODES
from autopar.errors import PlanError

if TYPE_CHECKING:
    from autopar.cost.config import ParallelConfig
    from autopar.plan.plan import Plan

# whether autopar's runtime runs context parallelism (cp > 1): ring, all-to-all and hybrid attention on
# Hugging Face decoders and autopar's GPT (autopar.parallel.context_parallel), pipeline stages too
RUNTIME_RUNS_CP = True
# the cp modes it runs
RUNTIME_CP_MODES = ("ring", "alltoall", "hybrid", "allgather")


# the cp modes each engine's runtime runs (autopar's: when RUNTIME_RUNS_CP): Megatron-Core's
# --cp-comm-type offers p2p (ring), a2a, a2a+p2p (hybrid) and all_gather; Llama 3's 4D
# engine all-gathers K/V (arXiv 2407.21783, Sec. 3.3.2); autopar's runtime runs all four. Engines not named (DeepSpeed, llm-foundry) export no cp
_CP_MODES_BY_ENGINE = {
    "autopar": RUNTIME_CP_MODES,
    "megatron": ("ring", "alltoall", "hybrid", "allgather"),
    "megatron-core": ("ring", "alltoall", "hybrid", "allgather"),
    "llama3-4d": ("allgather",),
}


def runtime_runs_cp(engine: str) -> bool:
    """Whether ``engine`` runs context parallelism (cp > 1) as planned: autopar's runtime when
    ``RUNTIME_RUNS_CP``; Megatron-LM/Megatron-Core and Llama 3's 4D engine express it in their
    launch settings (--context-parallel-size)."""
    if engine == "autopar":
        return RUNTIME_RUNS_CP
    return engine in _CP_MODES_BY_ENGINE


def runtime_cp_modes(engine: str) -> tuple[str, ...]:
    """The cp modes (how cp ranks exchange keys and values) ``engine`` runs; empty when it
    runs no context parallelism."""
    return _CP_MODES_BY_ENGINE.get(engine, ()) if runtime_runs_cp(engine) else ()


def proposed_cp(pins: dict, engine: str = "autopar") -> int | None:
    """The context-parallel degree the search tries: the pinned one; None (every degree the
    model allows) where ``engine`` runs context parallelism; else 1. The free search proposes
    only what the engine runs (``runtime_runs_cp``)."""
    if "cp" in pins:
        return int(pins["cp"])
    return None if runtime_runs_cp(engine) else 1


def context_parallel_refusal(engine: str, cp: int, mode: str = "ring") -> str | None:
    """Why ``engine``'s runtime cannot run ``cp`` context-parallel ranks in ``mode``, or
    None."""
    if cp == 1 or engine != "autopar":
        return None
    if not RUNTIME_RUNS_CP:
        return (f"context parallelism (cp={cp}): autopar's runtime does not run it yet; the "
                f"plan is priced and reported only (re-plan with constraints cp=1 to run it, "
                f"or engine=megatron to export it)")
    if mode not in RUNTIME_CP_MODES:
        return (f"context parallelism with cp_mode={mode} (it runs "
                f"{', '.join(RUNTIME_CP_MODES)}; re-plan with constraints cp_mode=ring)")
    return None


def recompute_modes(schedule: str, engine: str = "autopar") -> tuple[str, ...]:
    """The recompute modes the runtime runs under a schedule. The zero-bubble schedule's split
    backward (input gradients, then weight gradients) unpacks a checkpointed layer twice, which
    selective checkpointing (modes selective and op) refuses; full checkpointing recomputes
    again. Plans for another
    engine are exported, not run: every mode their launch arguments express (Megatron-LM and
    DeepSpeed have no op-level policy: not ``op``)."""
    if engine == "autopar" and schedule == "zero_bubble":
        return ("none", "full")
    if engine in (*MEGATRON_ENGINES, "deepspeed"):
        return tuple(m for m in RECOMPUTE_MODES if m != "op")
    return RECOMPUTE_MODES


def refuse_op_recompute(plan: Plan, target: str) -> None:
    """Raise PlanError (one line) when ``plan`` recomputes a block with mode ``op`` and is
    written for ``target`` (Megatron-LM, MindFormers, DeepSpeed), whose settings have no
    op-level policy (Megatron-Core's --recompute-modules re-runs whole modules, not every
    second matmul): no mapping would run what was priced."""
    if "op" in plan.recompute:
        raise PlanError(f"{target} has no op-level recompute (torchtitan's policy, recompute "
                        f"'op' in this plan): re-plan with constraints recompute=selective or "
                        f"full to export it")


def unsupported_combination(*, engine: str, dp: int, tp: int, pp: int, ep: int,
                            zero_stage: int, sequence_parallel: bool, offload: frozenset[str],
                            schedule: str = "1f1b",
                            recompute: frozenset[str] = frozenset(),
                            num_microbatches: int = 0, cp: int = 1) -> str | None:
    """Why the runtime cannot honour this combination, or None when it can. Plans priced for
    another engine (megatron, megatron-core, deepspeed, llama3-4d, llm-foundry) are exported, not run: they
    are restricted only to what that engine offers."""
    if engine == "megatron" and zero_stage >= 2:
        return ("ZeRO-2/3 on Megatron-LM (its distributed optimizer shards optimizer states "
                "only; Megatron-Core's FSDP shards more: engine=megatron-core)")
    if engine in MEGATRON_ENGINES and offload:
        return "offload on Megatron-LM"
    if engine == "llama3-4d" and offload:
        return "offload in Llama 3's 4D setup (it keeps every state on the device)"
    if engine == "llm-foundry" and pp > 1:
        return "pipeline parallelism on llm-foundry (Composer has no pipeline schedule: pp=1)"
    if engine == "llm-foundry" and offload:
        return ("offload on llm-foundry (FSDP1's CPUOffload is not priced: constraints "
                "offload=none)")
    if engine in (*MEGATRON_ENGINES, "deepspeed", "llm-foundry") and "op" in recompute:
        return (f"op-level recompute on {engine} (no launch argument of it expresses "
                f"torchtitan's op-level policy: constraints recompute=selective or full)")
    if engine != "autopar":
        return None
    replicas = dp * ep * cp
    if pp > 1 and num_microbatches and num_microbatches < pp:
        return (f"{num_microbatches} micro-batches on {pp} pipeline stages (torch's schedules "
                f"need one per stage: a smaller micro-batch or a larger global batch)")
    if pp > 1 and recompute - set(recompute_modes(schedule)):
        return ("selective or op recompute with the zero-bubble schedule (constraints "
                "recompute=full or schedule=1f1b)")
    if ep > 1 and zero_stage >= 2 and {"selective", "op"} & recompute:
        # the recompute replays the cached expert dispatch while fully_shard re-gathers the
        # experts' weights, and the grouped matmul then sees integer routing tensors
        return ("selective or op recompute with expert parallelism under ZeRO-2/3 "
                "(constraints recompute=full or zero_stage=1)")
    if cp > 1 and ep > 1:
        return "context parallelism with expert parallelism (constraints ep=1 or cp=1)"
    # DDP and ZeroRedundancyOptimizer take plain tensors only: tensor-parallel (DTensor)
    # parameters are data-parallel through fully_shard, which shards gradients (ZeRO-2/3)
    if tp > 1 and dp * cp > 1 and zero_stage < 2 and ep == 1:  # cp ranks replicate too
        return (f"ZeRO-{zero_stage} with tensor parallelism (the runtime shards DTensor "
                f"parameters with fully_shard: constraints zero_stage=2)")
    # FSDP2 offloads the sharded states: with several replicas that is ZeRO-2/3
    if offload & STATE_OFFLOADS and replicas > 1 and zero_stage < 2 and ep == 1:
        return (f"offloading the optimizer or parameters with ZeRO-{zero_stage} (FSDP2 offloads "
                f"sharded states: constraints zero_stage=2)")
    return None


def unsupported_serving(*, engine: str, tp: int, pp: int, ep: int, cp: int = 1) -> str | None:
    """Why autopar's generation runtime cannot serve this mesh, or None when it can. Serving
    keeps no gradients or optimizer states, so the training runtime's ZeRO and data-parallel
    wrappers do not arise: data-parallel replicas each serve their share of the prompts."""
    if engine != "autopar":
        return None
    if ep > 1:
        return "expert parallelism when serving (constraints ep=1)"
    if cp > 1:
        return "context parallelism when serving (constraints cp=1)"
    return None


def unsupported(config: ParallelConfig) -> str | None:
    """:func:`unsupported_combination` for a cost-model configuration (the search's view)."""
    return unsupported_combination(
        engine=config.engine, dp=config.dp, tp=config.tp, pp=config.pp, ep=config.ep,
        zero_stage=config.zero_stage, sequence_parallel=config.sequence_parallel,
        offload=frozenset(config.offload), schedule=config.schedule,
        num_microbatches=config.num_microbatches, cp=config.cp,
        recompute=frozenset((config.recompute,) if isinstance(config.recompute, str)
                            else config.recompute))


def plan_unsupported(plan: Plan) -> str | None:
    """:func:`unsupported_combination` (:func:`unsupported_serving` for task="infer") for a
    plan (the runtime's view)."""
    m = plan.mesh
    if plan.task == "infer":
        return unsupported_serving(engine=plan.engine or "autopar", tp=m["tp"], pp=m["pp"],
                                   ep=m["ep"], cp=m.get("cp", 1))
    return unsupported_combination(
        engine=plan.engine or "autopar", dp=m["dp"], tp=m["tp"], pp=m["pp"], ep=m["ep"],
        zero_stage=plan.zero_stage, sequence_parallel=plan.sequence_parallel,
        offload=frozenset(plan.offload),
        schedule=plan.schedule, recompute=frozenset(plan.recompute),
        num_microbatches=plan.num_microbatches, cp=m.get("cp", 1))


def refuse_unsupported(plan: Plan) -> None:
    """Raise PlanError (one line, the way out included) when the runtime cannot honour
    ``plan``: what the runtime and ``autopar.parallelize`` check before any work."""
    cp_reason = context_parallel_refusal(plan.engine or "autopar", plan.mesh.get("cp", 1),
                                         plan.cp_mode)
    if cp_reason is not None:
        raise PlanError(f"the runtime does not run {cp_reason}")
    if (plan.engine or "autopar") != "autopar":
        launch = {"megatron": "megatron.sh", "megatron-core": "megatron.sh",
                  "deepspeed": "deepspeed.json"}.get(plan.engine)
        where = f" ({launch} beside plan.yaml)" if launch else ""
        raise PlanError(f"the plan is priced for {plan.engine} (engine={plan.engine}), not for "
                        f"autopar's runtime; run it with that engine{where}, or re-plan with "
                        f"constraints engine=autopar")
    reason = plan_unsupported(plan)
    if reason is not None:
        raise PlanError(f"the runtime does not run {reason}; re-plan (autopar compile "
                        f"proposes only what runs)")
