"""Planning: measure the user's real step per layer (``profile``), predict the step time and peak
memory of a layout (``model``), and search the fastest layout within a memory budget
(``search``).

``cpu_offload.plan_offloading(step_fn, layers, memory_budget)`` runs all three. To plan one
measured step for several budgets, profile once and search as often as needed::

    prof = cpu_offload.profile_step(step_fn, layers)
    plans = [cpu_offload.plan.plan(prof, budget) for budget in (0.5, 0.7, 0.9)]
"""
from .model import HostCost, LayerProfile, simulate
from .profile import StepProfile, profile_layers, profile_step
from .search import Plan, plan, plan_offloading
from .verify import Trial

__all__ = [
    "HostCost",
    "LayerProfile",
    "Plan",
    "StepProfile",
    "Trial",
    "plan",
    "plan_offloading",
    "profile_layers",
    "profile_step",
    "simulate",
]
