"""Planning: measure the user's real step per layer (``profile``), predict step time and peak
memory of a layout (``model``), and search the fastest layout within a memory budget
(``search``); ``cpu_offload.plan_offloading`` runs all three."""
