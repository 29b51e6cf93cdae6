"""Step time of a pipeline schedule from per-stage forward/backward times of one micro-batch.

With p stages, m micro-batches, stage times f_i + b_i, bottleneck T = max_i(f_i + b_i):

- GPipe and 1F1B: (m - 1) T + sum_i(f_i + b_i): the fill and drain (the bubble) is the sum of
  the other stages' times; 1F1B has GPipe's time with less memory;
- interleaved 1F1B with v chunks per device: m T + (sum_i - T) / v (Narayanan et al. 2021);
- zero-bubble ZB-H1 (Qi et al. 2024): the backward splits into input-grad B and weight-grad W;
  W is deferred into the bubble, which shrinks to (f + b - 2W) / (f + b) of 1F1B's
  (a third when F = B = W) once m >= p; with fewer micro-batches there are fewer W's to
  fill it with; recompute and communication stay on the critical path.

Each boundary adds a send of activations forward and of gradients backward on the critical
path of the fill and drain: 2 (p v - 1) p2p, with v model chunks per device (1 unless
interleaved). In the steady state every micro-batch's sends (2 per chunk) also wait unless
they run under compute: 2 v m p2p ((1 - hidden) + hidden x slowdown), where ``hidden`` is the
share that runs beside compute (1 on GPUs with a separate communication stream, about 0 on CPU
processes over gloo) and ``slowdown`` what it costs the compute beside it. Both count as
bubble: the stage idles while it waits.
"""

from __future__ import annotations

from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster


def fill_drain_factor(schedule: str, virtual_stages: int, total_s: float,
                      weight_grad_s: float, num_microbatches: int = 1 << 30,
                      stages: int = 2) -> float:
    """The share of the other stages' time that a schedule's fill and drain costs: 1 for
    GPipe and 1F1B, ``1 / v`` for interleaved 1F1B; for zero-bubble (``total`` the stages'
    forward + backward, ``W`` their weight-gradient part) ``(total - 2 W) / total`` once there
    are at least as many micro-batches as stages (ZB-H1, Qi et al. 2024), rising to
    ``(total - W) / total`` for a single micro-batch, whose deferred weight gradients have no
    other work to fill (linear in between)."""
    if schedule == "interleaved" and virtual_stages > 1:
        return 1.0 / virtual_stages
    if schedule == "zero_bubble":
        if not total_s:
            return 1.0
        filled = min(num_microbatches - 1, stages - 1) / max(stages - 1, 1)
        return (total_s - weight_grad_s * (1 + filled)) / total_s
    return 1.0


def pipeline_step_time(fwd_s: list[float], bwd_s: list[float], num_microbatches: int,
                       schedule: str = "1f1b", virtual_stages: int = 1,
                       p2p_s: float = 0.0,
                       weight_grad_s: list[float] | None = None,
                       p2p_hidden: float = 1.0,
                       p2p_slowdown: float = 0.0) -> tuple[float, float]:
    """(step seconds, bubble seconds) of one optimizer step's forward+backward.

    ``weight_grad_s`` is the weight-gradient share of each stage's backward (zero-bubble
    defers it); by default half of the backward. ``p2p_hidden`` is the share of a steady-state
    send that runs beside compute, ``p2p_slowdown`` how much it slows that compute.
    """
    p, m = len(fwd_s), num_microbatches
    per_stage = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    bottleneck = max(per_stage)
    if p == 1:
        return m * bottleneck, 0.0
    w = sum(weight_grad_s) if weight_grad_s is not None else sum(bwd_s) / 2
    fill_drain = (sum(per_stage) - bottleneck) * fill_drain_factor(
        schedule, virtual_stages, sum(per_stage), w, m, p)
    chunks = virtual_stages if schedule == "interleaved" else 1
    steady = 2 * chunks * m * p2p_s * ((1.0 - p2p_hidden) + p2p_hidden * p2p_slowdown)
    # the fill and drain cross every model chunk's boundary once each way
    bubble = fill_drain + 2 * (p * chunks - 1) * p2p_s + steady
    return m * bottleneck + bubble, bubble


def lone_stage_speedup(config: ParallelConfig, cluster: Cluster) -> float:
    """How much faster a pipeline stage computes while the other stages idle, on a node whose
    devices time-share fewer compute slots (CPU processes on fewer cores): 1 on accelerators.

    ``peak_flops`` is the rate with every device of the node busy, ``slots / devices`` of a
    slot each; a stage's ``dp x cp x tp x ep`` devices alone get ``min(1, slots / g)`` each. Only
    when the whole pipeline sits on one node do its stages share the slots."""
    node = cluster.node
    per_node, slots = node.devices_per_node, node.compute_slots
    if config.pp <= 1 or slots >= per_node or config.devices > per_node:
        return 1.0
    group = config.dp * config.tp * config.ep * config.cp
    return min(1.0, slots / group) * per_node / slots


def shared_pipeline_time(fwd_s: list[float], bwd_s: list[float], num_microbatches: int,
                         speedup: float, **schedule) -> tuple[float, float]:
    """(step seconds, bubble seconds) of the pipelined passes when stages share compute
    slots (:func:`lone_stage_speedup` > 1): no faster than the schedule's critical path at a
    lone stage's rate, nor than the node's total work spread over every slot (the mean
    stage's busy time at the all-busy rate). The bubble is what exceeds the slowest stage's
    compute at the lone rate."""
    fast, _ = pipeline_step_time([f / speedup for f in fwd_s], [b / speedup for b in bwd_s],
                                 num_microbatches, **schedule)
    per_stage = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    work = num_microbatches * sum(per_stage) / len(per_stage)
    step = max(fast, work)
    return step, max(step - num_microbatches * max(per_stage) / speedup, 0.0)
