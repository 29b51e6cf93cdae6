"""A plan's pipeline schedule in one label, as the sweep's rows and its report name it."""

from __future__ import annotations

from autopar.plan.plan import Plan


def schedule_label(p: Plan) -> str:
    """``none`` without a pipeline (a one-stage plan still records ``1f1b``), else the
    schedule: ``1f1b``, or ``interleaved x2`` with its model chunks per device."""
    if p.mesh["pp"] == 1:
        return "none"
    return p.schedule + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
