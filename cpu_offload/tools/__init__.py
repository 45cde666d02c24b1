"""Tools built on the backends: the tag-vs-detection audit, the planner and the timeline."""
