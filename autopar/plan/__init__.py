"""Plan pass output: the serializable, versioned execution plan."""

from autopar.plan.plan import PLAN_VERSION, Plan, Predicted

__all__ = ["PLAN_VERSION", "Plan", "Predicted"]
