"""Type checks for the arguments of the public API: a flag must be a real ``bool``, a count an
integer (``int``, or any ``numbers.Integral``: NumPy's integers) but not a ``bool``, and the
error names the argument.

Configs read from YAML, JSON, environment variables or the command line often carry ``"False"``
or ``"0"`` as strings. A non-empty string is true, so ``enabled="False"`` would switch offloading
*on*, and ``bool`` is a subclass of ``int``, so ``num_layers=True`` would offload one layer.
Every public entry point runs its flags and counts through these functions before anything else.
"""
from __future__ import annotations

import difflib
import numbers
import os
from typing import Any, Iterable, Optional

from .errors import OffloadConfigError

__all__ = [
    "bool_problem", "check_bool", "check_context_types", "check_int", "check_keywords",
    "env_flag", "int_problem", "is_count",
]


def env_flag(name: str, default: bool = True) -> bool:
    """An on/off switch read from the environment variable ``name``: ``0``, ``false``, ``no``
    and ``off`` (any case) are off, anything else on; ``default`` when it is not set.

    Example::

        >>> import os
        >>> os.environ["CPU_OFFLOAD_EXAMPLE_SWITCH"] = "Off"
        >>> env_flag("CPU_OFFLOAD_EXAMPLE_SWITCH"), env_flag("CPU_OFFLOAD_NOT_SET", default=False)
        (False, False)
        >>> del os.environ["CPU_OFFLOAD_EXAMPLE_SWITCH"]
    """
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def is_count(value: Any) -> bool:
    """Whether ``value`` may be passed where the API takes an ``int``: any ``numbers.Integral``
    (``np.int64(2)`` is one, though not an ``int``: indices from NumPy arrays, configs read with
    NumPy), except a ``bool``, an ``int`` subclass that would count a flag as 0 or 1.

    Example::

        >>> is_count(2), is_count(True), is_count(2.0)
        (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_keywords(caller: str, given: Iterable[str], accepted: Iterable[str], to: str) -> None:
    """``TypeError`` for a keyword ``caller`` forwards to ``to`` that ``to`` does not take, named
    against ``caller`` (the function the user called) with the closest accepted name, before
    anything runs.

    Example::

        >>> check_keywords("apply_offloading", ["min_tensor_size"],
        ...                ["device", "min_tensor_size_to_offload"], "get_cpu_offload_context")
        Traceback (most recent call last):
        ...
        TypeError: apply_offloading() got an unexpected keyword argument 'min_tensor_size' (did you mean 'min_tensor_size_to_offload'?); the keywords it passes on to get_cpu_offload_context are: device, min_tensor_size_to_offload
    """
    accepted = sorted(accepted)
    for name in sorted(set(given) - set(accepted)):
        close = difflib.get_close_matches(name, accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"{caller}() got an unexpected keyword argument {name!r}{hint}; the keywords it "
            f"passes on to {to} are: {', '.join(accepted)}"
        )


def bool_problem(name: str, value: Any, *, allow_none: bool = False) -> Optional[str]:
    """Why ``value`` is not a valid ``bool`` argument ``name`` (``None`` if it is).

    Example::

        >>> print(bool_problem("verify", "yes"))
        verify must be True or False, got 'yes' (a string: any non-empty one counts as True); convert flags read from files or the command line to bool first
        >>> bool_problem("verify", None, allow_none=True) is None
        True
    """
    if isinstance(value, bool) or (allow_none and value is None):
        return None
    allowed = "True, False or None" if allow_none else "True or False"
    message = f"{name} must be {allowed}, got {value!r}"
    if isinstance(value, str):
        message += (
            " (a string: any non-empty one counts as True); convert flags read from files or "
            "the command line to bool first"
        )
    return message


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``OffloadConfigError`` naming ``name`` unless ``value`` is a ``bool`` (or ``None``
    with ``allow_none``).

    Example::

        >>> check_bool("enabled", True)
        >>> check_bool("enabled", "False")
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: enabled must be True or False, got 'False' (a string: any non-empty one counts as True); convert flags read from files or the command line to bool first
    """
    problem = bool_problem(name, value, allow_none=allow_none)
    if problem is not None:
        raise OffloadConfigError(problem)


def int_problem(
    name: str,
    value: Any,
    *,
    minimum: Optional[int] = None,
    allow_none: bool = False,
    meaning: str = "",
    unit: str = "",
) -> Optional[str]:
    """Why ``value`` is not a valid ``int`` argument ``name`` (``None`` if it is). A ``bool`` is
    not an ``int`` here. ``meaning`` says what the count is, ``unit`` what it counts.

    Example::

        >>> print(int_problem("num_layers", True, minimum=0, meaning="the number of layers to offload"))
        num_layers must be the number of layers to offload (an int >= 0), got True (a bool, not a count)
        >>> print(int_problem("max_host_bytes", -1, minimum=0, allow_none=True, unit="bytes"))
        max_host_bytes must be None or an int >= 0 (bytes), got -1
    """
    if allow_none and value is None:
        return None
    if is_count(value) and (minimum is None or value >= minimum):
        return None
    kind = "an int" + (f" >= {minimum}" if minimum is not None else "")
    if allow_none:
        kind = "None or " + kind
    if meaning:
        spec = f"{meaning} ({kind}{', ' + unit if unit else ''})"
    else:
        spec = kind + (f" ({unit})" if unit else "")
    message = f"{name} must be {spec}, got {value!r}"
    if isinstance(value, bool):
        message += " (a bool, not a count)"
    elif isinstance(value, str):
        message += " (a string); convert values read from files or the command line to int first"
    return message


def check_int(
    name: str,
    value: Any,
    *,
    minimum: Optional[int] = None,
    allow_none: bool = False,
    meaning: str = "",
    unit: str = "",
) -> None:
    """Raise ``OffloadConfigError`` naming ``name`` unless ``value`` is an ``int`` (not a
    ``bool``) of at least ``minimum`` (or ``None`` with ``allow_none``); see ``int_problem``.

    Example::

        >>> check_int("repeats", 3, minimum=1)
        >>> check_int("repeats", "3", minimum=1)
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: repeats must be an int >= 1, got '3' (a string); convert values read from files or the command line to int first
    """
    problem = int_problem(
        name, value, minimum=minimum, allow_none=allow_none, meaning=meaning, unit=unit
    )
    if problem is not None:
        raise OffloadConfigError(problem)


def check_context_types(
    *,
    enabled: Any,
    num_layers: Any = None,
    model_layers: Any = 1,
    offload_activations: Any = True,
    offload_weights: Any = False,
    double_buffering: Any = False,
    manual_synchronization: Any = False,
    retain_pinned_cpu_buffers: Any = False,
    min_tensor_size_to_offload: Any = 0,
    verify: Any = None,
    max_host_bytes: Any = None,
) -> None:
    """The types of ``get_cpu_offload_context``'s arguments (facade, V1 and V2): flags are
    bools and counts ints, also for a disabled context (``enabled="False"`` is true). Their
    ranges only when enabled: a disabled context never raises for a value or a combination,
    as in the reference (the backends check the combinations).

    Example::

        >>> check_context_types(enabled=True, num_layers=2, model_layers=4)
        >>> check_context_types(enabled=False, retain_pinned_cpu_buffers="False")
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: retain_pinned_cpu_buffers must be True or False, got 'False' (a string: any non-empty one counts as True); convert flags read from files or the command line to bool first
    """
    for name, value in (
        ("enabled", enabled), ("offload_activations", offload_activations),
        ("offload_weights", offload_weights), ("double_buffering", double_buffering),
        ("manual_synchronization", manual_synchronization),
        ("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers),
    ):
        check_bool(name, value)
    check_bool("verify", verify, allow_none=True)
    low = (lambda m: m) if enabled else (lambda m: None)  # ranges: only when enabled
    check_int("num_layers", num_layers, minimum=low(0), allow_none=True,
              meaning="the number of layers to offload")
    check_int("model_layers", model_layers, minimum=low(1), meaning="the total number of layers")
    check_int("min_tensor_size_to_offload", min_tensor_size_to_offload, minimum=low(0),
              unit="elements")
    check_int("max_host_bytes", max_host_bytes, minimum=low(0), allow_none=True,
              unit="bytes of pinned host memory; None: no limit")
