"""Tools built on the backends, one job per module: ``layers`` (the class-swap seam that routes
each layer's call through a driver), ``apply`` (``apply_offloading``: one call, in place),
``audit`` (what V1's tags and V2's detection select) and ``timeline`` (a picture of one real
step on CUDA)."""
