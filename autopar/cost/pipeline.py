"""Step time of a pipeline schedule from per-stage forward/backward times of one micro-batch.

With p stages, m micro-batches, stage times f_i + b_i, bottleneck T = max_i(f_i + b_i):

- GPipe and 1F1B: (m - 1) T + sum_i(f_i + b_i): the fill and drain (the bubble) is the sum of
  the other stages' times; 1F1B has GPipe's time with less memory;
- interleaved 1F1B with v chunks per device: m T + (sum_i - T) / v (Narayanan et al. 2021);
- zero-bubble ZB-H1 (Qi et al. 2024): backward split into input-grad B and weight-grad W
  (W = b/2); W fills the bubble so it shrinks to f/(f + b) of 1F1B's.

Each boundary adds a send of activations forward and of gradients backward on the critical
path of the fill and drain: 2 (p - 1) p2p.
"""

from __future__ import annotations


def pipeline_step_time(fwd_s: list[float], bwd_s: list[float], num_microbatches: int,
                       schedule: str = "1f1b", virtual_stages: int = 1,
                       p2p_s: float = 0.0) -> tuple[float, float]:
    """(step seconds, bubble seconds) of one optimizer step's forward+backward."""
    p, m = len(fwd_s), num_microbatches
    per_stage = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    bottleneck = max(per_stage)
    if p == 1:
        return m * bottleneck, 0.0
    fill_drain = sum(per_stage) - bottleneck
    if schedule == "interleaved" and virtual_stages > 1:
        fill_drain /= virtual_stages
    elif schedule == "zero_bubble":
        f, total = sum(fwd_s), sum(per_stage)
        fill_drain *= f / total if total else 1.0
    bubble = fill_drain + 2 * (p - 1) * p2p_s
    return m * bottleneck + bubble, bubble
