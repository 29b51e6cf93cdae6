"""One optimizer step, simulated per stage from the plan's per-stage times, for the Gantt chart.

Each device runs its operations in the schedule's order (GPipe: all forwards then all
backwards; 1F1B: warm-up forwards, then one forward one backward, then the cool-down;
interleaved 1F1B: Megatron's order over ``v`` model chunks; zero-bubble: 1F1B with each
backward split into input-gradient B and weight-gradient W; up to p W's are held back and one
runs whenever the device would otherwise wait for at least half a W). An operation starts when
its device is free and its input has arrived (one point-to-point send between devices). After
the pipelined part come the exposed data-parallel communication, the optimizer step and the
offload transfers. Gaps are bubbles.

The simulation is a picture of the cost model's numbers; its length can differ slightly from
the predicted step time, whose bubble formula is exact only for equal stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plan import Plan


@dataclass(frozen=True)
class Segment:
    stage: int
    start: float
    duration: float
    kind: str  # forward | backward | weight | comm | bubble | dp_comm | optimizer | offload
    microbatch: int = -1
    chunk: int = 0


def _order(schedule: str, p: int, m: int, v: int, d: int, train: bool) -> list[tuple]:
    """(kind, microbatch, chunk) in the order device ``d`` runs them."""
    if not train:
        return [("F", j, c) for j in range(m) for c in range(v)]
    if schedule == "interleaved" and v > 1 and m % p == 0:
        def fwd(k: int) -> tuple:
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def bwd(k: int) -> tuple:
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        total = m * v
        warm = min((p - d - 1) * 2 + (v - 1) * p, total)
        ops = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            ops += [fwd(warm + i), bwd(i)]
        return ops + [bwd(k) for k in range(total - warm, total)]
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    warm = min(p - d - 1, m)
    ops = [("F", j, 0) for j in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i, 0), ("B", i, 0)]
    return ops + [("B", j, 0) for j in range(m - warm, m)]


def simulate(fwd_s: list[float], bwd_s: list[float], weight_s: list[float], m: int,
             schedule: str, virtual_stages: int, p2p_s: float, train: bool = True,
             send_cost_s: float = 0.0) -> list[Segment]:
    """The pipelined forward/backward of one step as segments per stage (bubbles included)."""
    p = len(fwd_s)
    v = virtual_stages if schedule == "interleaved" and m % p == 0 else 1
    zb = schedule == "zero_bubble" and train
    last = p * v - 1
    queues = [_order(schedule, p, m, v, d, train) for d in range(p)]
    pos = [0] * p
    free = [0.0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    done: dict[tuple, float] = {}  # (kind, virtual stage, microbatch) -> end time
    segments: list[Segment] = []

    def duration(kind: str, d: int) -> float:
        w = weight_s[d] if zb else 0.0
        # every forward and input-gradient backward sends once; ``send_cost_s`` is what a
        # steady-state send costs its stage (the cost model's steady-state term)
        send = send_cost_s if kind != "W" and p > 1 else 0.0
        return {"F": fwd_s[d], "B": bwd_s[d] - w, "W": w}[kind] / v + send

    def ready(kind: str, vs: int, j: int) -> float | None:
        if kind == "F":
            dep = ("F", vs - 1, j) if vs > 0 else None
        else:
            dep = ("B", vs + 1, j) if vs < last else ("F", vs, j)
        if dep is None:
            return 0.0
        if dep not in done:
            return None
        hop = p2p_s if (kind == "F" and vs > 0) or (kind == "B" and vs < last) else 0.0
        return done[dep] + hop

    def run(d: int, kind: str, j: int, chunk: int, start: float) -> None:
        t = duration(kind, d)
        segments.append(Segment(d, start, t, {"F": "forward", "B": "backward",
                                               "W": "weight"}[kind], j, chunk))
        free[d] = start + t
        done[(kind, chunk * p + d, j)] = free[d]
        if kind == "B" and zb:
            pending_w[d].append((j, chunk))
            if len(pending_w[d]) > p:  # hold back no more W's than the drain can absorb
                wj, wc = pending_w[d].pop(0)
                run(d, "W", wj, wc, free[d])

    while any(pos[d] < len(queues[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            while pos[d] < len(queues[d]):
                kind, j, chunk = queues[d][pos[d]]
                at = ready(kind, chunk * p + d, j)
                if at is None:
                    break
                # fill a wait with a deferred weight gradient, unless the wait is so short
                # (a send) that the W would mostly delay the next operation
                if pending_w[d] and at - free[d] >= 0.5 * duration("W", d):
                    wj, wc = pending_w[d].pop(0)
                    run(d, "W", wj, wc, free[d])
                    progressed = True
                    continue
                run(d, kind, j, chunk, max(at, free[d]))
                pos[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked in the timeline simulation")
    for d in range(p):
        for wj, wc in pending_w[d]:
            run(d, "W", wj, wc, free[d])
    return segments


def _with_gaps(segments: list[Segment], p: int, end: float) -> list[Segment]:
    out = list(segments)
    for d in range(p):
        t = 0.0
        for s in sorted((s for s in segments if s.stage == d), key=lambda s: s.start):
            if s.start > t + 1e-12:
                out.append(Segment(d, t, s.start - t, "bubble"))
            t = max(t, s.start + s.duration)
        if end > t + 1e-12:
            out.append(Segment(d, t, end - t, "bubble"))
    return out


def plan_timeline(plan: Plan) -> tuple[list[Segment], float]:
    """Segments of one step of ``plan`` (pipeline, bubbles, then the per-step tail) and the
    simulated step length."""
    pred = plan.predicted
    stages = pred.stages
    train = plan.task != "infer"
    fwd = [s["fwd_s"] for s in stages]
    bwd = [s["bwd_s"] for s in stages]
    weight = [s.get("weight_grad_s", s["bwd_s"] / 2) for s in stages]
    segs = simulate(fwd, bwd, weight, plan.num_microbatches, plan.schedule,
                    plan.virtual_stages, pred.p2p_s, train, pred.p2p_steady_s)
    pipe_end = max((s.start + s.duration for s in segs), default=0.0)
    segs = _with_gaps(segs, len(stages), pipe_end)
    # each stage's tail: its once-per-step data-parallel collectives, offload transfers and
    # optimizer update (plans before format 3 record one optimizer and offload time for all)
    end = pipe_end
    for d, s in enumerate(stages):
        t = pipe_end
        tail = (("dp_comm", s["dp_exposed_s"]),
                ("offload", s.get("offload_s", pred.offload_s)),
                ("optimizer", s.get("optimizer_s", pred.optimizer_s)))
        for kind, seconds in tail:
            if seconds:
                segs.append(Segment(d, t, seconds, kind))
                t += seconds
        end = max(end, t)
    return segs, end
