"""The ground floor both backends and the optimizer stand on: the device seam (``device``,
``simulated``, ``driver``), byte-exact storage capture (``storage``), pinned host buffers
(``pinned_pool``, carved by ``free_space`` from blocks of ``host_memory``, placed by ``numa``),
tensor marks and the per-module policy stack (``markers``), wrapper subclasses flattened into
their inner tensors (``subclass``), sizes for humans (``units``), and the exceptions (``errors``).

Nothing here imports a backend, a tool or the package's public face."""
