"""What one step of offloading did: counters the V2 hooks keep per layer, read by users.

Counting costs a few integer additions per saved tensor, so it is always on. The one
device-side quantity, the time compute waited for copies, is kept as pairs of events (when
compute reached a wait, when the awaited copy finished) and turned into milliseconds only when
someone reads the statistics, and only for events the device has already passed: reading never
blocks the host.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Optional

logger = logging.getLogger("cpu_offload")

# Pinned host memory reserved beyond this many times the bytes a step held at once is worth a
# warning, if the excess is at least HOST_OVERHEAD_FLOOR (page rounding of a tiny model is not).
HOST_OVERHEAD = 1.10
HOST_OVERHEAD_FLOOR = 1 << 20


def host_overhead(pool: Any, device: Any) -> Optional[str]:
    """What the host-memory warning says once a step is over (``pool.trim`` has let go of
    what it did not need): the pool reserves more than ``HOST_OVERHEAD`` times the bytes the
    step held at once, by ``HOST_OVERHEAD_FLOOR`` or more. None otherwise."""
    reserved, held = pool.reserved_bytes, pool.last_peak_in_use_bytes
    if not held or reserved <= HOST_OVERHEAD * held or reserved - held < HOST_OVERHEAD_FLOOR:
        return None
    return (
        f"{_mib(reserved)} of pinned host memory is reserved for the {_mib(held)} that the "
        f"last step held at once ({_ratio(reserved, held)}, over {HOST_OVERHEAD:.2f}x). Its "
        f"blocks are {device.host_memory_kind()}; buffers still held from an earlier step, "
        "or retain_pinned_cpu_buffers=True (each buffer kept at its largest size), also keep "
        "blocks. See ctx.stats().summary()"
    )


def _ratio(n: int, of: int) -> str:
    return f"{n / of:.2f}x" if of else "-"


def _mib(n: int) -> str:
    """Bytes for humans: KiB below one MiB, GiB from one GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


class LayerStats:
    """Counters of one layer of one step."""

    __slots__ = (
        "offloaded_tensors", "copied_out_bytes", "reloaded_bytes", "freed_bytes",
        "held_elsewhere_bytes", "skipped_bytes", "recipe_tensors", "recipe_bytes",
        "recomputed_bytes",
    )

    def __init__(self) -> None:
        self.offloaded_tensors = 0  # saved tensors stored on the host (views counted each)
        self.copied_out_bytes = 0  # device-to-host bytes (each storage once)
        self.reloaded_bytes = 0  # host-to-device bytes
        self.freed_bytes = 0  # device bytes the release actually freed
        self.held_elsewhere_bytes = 0  # copied, but something else keeps the memory alive
        self.skipped_bytes: dict = defaultdict(int)  # reason -> bytes kept on the device
        # Selective recomputation: saved tensors stored as recipes, their storages' bytes (each
        # once per forward: never stored), and bytes recomputed in backward (recipes whose
        # inputs were themselves recomputed included).
        self.recipe_tensors = 0
        self.recipe_bytes = 0
        self.recomputed_bytes = 0

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["skipped_bytes"] = dict(self.skipped_bytes)
        return out


class _Nothing:
    """Device and pinned pool of ``StepStats.empty()``: nothing timed, nothing pinned."""

    times_events = False
    in_use_bytes = peak_in_use_bytes = reserved_bytes = peak_reserved_bytes = 0

    def host_memory_kind(self) -> str:
        return "none"

    def cached_bytes(self) -> int:
        return 0

    def retained_bytes(self) -> int:
        return 0


class StepStats:
    """Per-layer counters of one forward pass and its backward passes, plus copy waits."""

    def __init__(self, device: Any, pool: Any) -> None:
        self._device = device
        self._pool = pool
        self.layers: dict[int, LayerStats] = {}
        self.layers_without_grad = 0  # offloaded positions entered with grad disabled
        # Offloaded positions run inside a non-reentrant checkpoint region: it keeps none of
        # their activations (recomputed in backward), so there is nothing to offload.
        self.layers_in_checkpoint = 0
        self.waits: list = []  # (compute reached the wait, awaited copy done) event pairs
        self.checked = False  # the "did nothing" warning was considered for this step

    @classmethod
    def empty(cls) -> "StepStats":
        """The statistics of a step that offloaded nothing (no offload context was needed)."""
        return cls(_Nothing(), _Nothing())

    def layer(self, index: int) -> LayerStats:
        stats = self.layers.get(index)
        if stats is None:
            stats = self.layers[index] = LayerStats()
        return stats

    @property
    def timed(self) -> bool:
        return self._device.times_events

    # -- reading ---------------------------------------------------------------------------------
    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.layers.values())

    def skipped(self) -> dict:
        out: dict = defaultdict(int)
        for s in self.layers.values():
            for reason, n in s.skipped_bytes.items():
                out[reason] += n
        return dict(out)

    def wait_ms(self) -> tuple[float, int]:
        """(milliseconds compute waited for copies, waits not finished yet). Never blocks."""
        total, pending = 0.0, 0
        for arrived, done in self.waits:
            ms = self._device.elapsed_ms(arrived, done)
            if ms is None:
                pending += 1
            else:
                total += max(ms, 0.0)
        return total, pending

    def to_dict(self) -> dict:
        """Everything, for loggers and dashboards."""
        wait, pending = self.wait_ms() if self.timed else (None, 0)
        return {
            "layers": {i: s.to_dict() for i, s in sorted(self.layers.items())},
            "offloaded_tensors": self.total("offloaded_tensors"),
            "copied_out_bytes": self.total("copied_out_bytes"),
            "reloaded_bytes": self.total("reloaded_bytes"),
            "freed_bytes": self.total("freed_bytes"),
            "held_elsewhere_bytes": self.total("held_elsewhere_bytes"),
            "skipped_bytes": self.skipped(),
            "recipe_tensors": self.total("recipe_tensors"),
            "recipe_bytes": self.total("recipe_bytes"),
            "recomputed_bytes": self.total("recomputed_bytes"),
            "pinned_host_bytes_in_use": self._pool.in_use_bytes,
            "pinned_host_bytes_peak": self._pool.peak_in_use_bytes,
            "pinned_host_bytes_cached": self._pool.cached_bytes() + self._pool.retained_bytes(),
            # What the host reserved (blocks, page rounding included), now and at most this
            # step; and about what a step needs, with what max_host_bytes kept on the device.
            "pinned_host_bytes_reserved": self._pool.reserved_bytes,
            "pinned_host_bytes_reserved_peak": self._pool.peak_reserved_bytes,
            "pinned_host_bytes_needed": self._pool.peak_reserved_bytes
            + self.skipped().get("over max_host_bytes", 0),
            "pinned_host_memory": self._device.host_memory_kind(),
            "compute_wait_ms": wait,
            "waits_pending": pending,
            "layers_without_grad": self.layers_without_grad,
            "layers_in_checkpoint": self.layers_in_checkpoint,
        }

    def summary(self) -> str:
        """A few lines for humans."""
        d = self.to_dict()
        if d["compute_wait_ms"] is None:
            wait = "not timed (CPU_OFFLOAD_TIME_WAITS=1 to time it)"
        else:
            wait = f"{d['compute_wait_ms']:.2f} ms"
        if d["waits_pending"]:
            wait += f" (+{d['waits_pending']} copies still running)"
        where = getattr(self._device, "display_name", "device")
        lines = [
            f"offloaded {d['offloaded_tensors']} saved tensors in {len(self.layers)} layers: "
            f"{_mib(d['copied_out_bytes'])} out, {_mib(d['reloaded_bytes'])} back; "
            f"freed {_mib(d['freed_bytes'])} of {where} memory"
            + (f" ({_mib(d['held_elsewhere_bytes'])} copied but held elsewhere)"
               if d["held_elsewhere_bytes"] else ""),
            f"pinned host memory: peak {_mib(d['pinned_host_bytes_peak'])}, in use now "
            f"{_mib(d['pinned_host_bytes_in_use'])}; compute waited for copies {wait}",
            f"pinned host memory reserved: {_mib(d['pinned_host_bytes_reserved_peak'])} at "
            f"most ({_ratio(d['pinned_host_bytes_reserved_peak'], d['pinned_host_bytes_peak'])}"
            f" the peak in use), {_mib(d['pinned_host_bytes_reserved'])} now; "
            f"{d['pinned_host_memory']}",
        ]
        if d["skipped_bytes"]:
            why = ", ".join(f"{r}: {_mib(n)}" for r, n in sorted(d["skipped_bytes"].items()))
            lines.append(f"kept on the {where}: {why}")
        if d["recipe_tensors"]:
            lines.append(
                f"recomputed instead of stored (selective): {d['recipe_tensors']} saved tensors, "
                f"{_mib(d['recipe_bytes'])} never stored; {_mib(d['recomputed_bytes'])} "
                "recomputed in backward"
            )
        for i, s in sorted(self.layers.items()):
            lines.append(
                f"  layer {i}: {s.offloaded_tensors} tensors, {_mib(s.copied_out_bytes)} out, "
                f"{_mib(s.reloaded_bytes)} back, {_mib(s.freed_bytes)} freed"
                + (f", {_mib(s.recipe_bytes)} recomputed instead" if s.recipe_tensors else "")
            )
        return "\n".join(lines)

    def nothing_done_reason(self, threshold: int) -> Optional[str]:
        """Why this step freed no GPU memory (None if it freed some, or offloaded no layer)."""
        if not self.layers and not self.layers_without_grad and not self.layers_in_checkpoint:
            return None
        for s in self.layers.values():
            if s.freed_bytes > 0 or s.recipe_bytes > 0:
                return None  # (asked after every step's backward: no sums for the common answer)
        if self.total("held_elsewhere_bytes"):
            return (
                f"it copied {_mib(self.total('held_elsewhere_bytes'))} to the host, but every "
                "copied tensor is also held elsewhere (by the caller, or saved by a layer that is "
                "not offloaded), so dropping it freed nothing"
            )
        skipped = {r: n for r, n in self.skipped().items() if r not in ("parameter", "weight mark")}
        if skipped:
            reason = max(skipped, key=skipped.get)
            hint = {
                "too small": f"below min_tensor_size_to_offload={threshold} elements; lower it",
                "parameter": "weights are never offloaded",
                "module opted out": "set_activation_offloading(module, False) / offload_opt_out",
                "mark_not_offload": "marked with mark_not_offload",
            }.get(reason, reason)
            return f"every saved tensor stayed on the GPU ({hint})"
        if self.layers_in_checkpoint and not self.total("offloaded_tensors"):
            return (
                "the offloaded layers ran inside a non-reentrant torch.utils.checkpoint region, "
                "which keeps none of their activations (it recomputes them in backward), so there "
                "was nothing to offload; to offload, checkpoint inside each `with ctx:` block, "
                "not around the stack of them"
            )
        if self.layers_without_grad:
            return (
                "the offloaded layers ran without grad, so they saved nothing: a reentrant "
                "checkpoint (use_reentrant=True) hides the saved tensors from the offload hooks; "
                "use use_reentrant=False"
            )
        return "the offloaded layers saved no tensor for backward"

    def log(self) -> None:
        """One INFO line on the ``cpu_offload`` logger (when INFO is enabled for it)."""
        if logger.isEnabledFor(logging.INFO):
            d = self.to_dict()
            logger.info(
                "offload step: %d tensors, %s out, %s back, %s freed, %s pinned at peak, "
                "compute waited %s ms",
                d["offloaded_tensors"], _mib(d["copied_out_bytes"]), _mib(d["reloaded_bytes"]),
                _mib(d["freed_bytes"]), _mib(d["pinned_host_bytes_peak"]),
                "?" if d["compute_wait_ms"] is None else f"{d['compute_wait_ms']:.2f}",
            )
