"""Exceptions raised for misuse, so callers can catch configuration mistakes specifically."""


class OffloadConfigError(ValueError):
    """An argument combination of ``get_cpu_offload_context`` (or a config) that cannot work."""


class OffloadUsageError(RuntimeError):
    """The context or sync function was used out of order (e.g. sync function not called)."""
