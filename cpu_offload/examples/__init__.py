"""Example code built on the public API: an embedded plain-torch GPT block stack (``gpt``, the
workload of the demo, the benchmarks and the GPU tests), a residual MLP block (``mlp``, the
host-memory benchmark's) and the demo (``demo``: ``python -m cpu_offload``)."""
