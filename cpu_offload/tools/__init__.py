"""Tools built on the backends: ``apply_offloading`` (one call, in place), ``plan_offloading``
(a plan from the user's real step), the tag-vs-detection audit, the planner and the timeline."""
