"""Transformer Engine's asynchronous V1 handler: bulk offload per group on a D2H stream, bulk
reload per group on an H2D stream, timed by the layer-window map (``window.py``), with optional
double-buffered reloads.

Every cross-stream use is fenced with events and every device buffer is allocated on the compute
stream, so the caching allocator may reuse freed memory at once. Unlike the original, unpacking a
tensor also waits for its own reload (one device-side wait per storage, never a host block), so the
result is correct even where the window map and the actual backward order disagree.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ..core.device import OffloadDevice
from .handlers import Checker, SynchronizedGroupOffloadHandler
from .saved import ReloadBufferSet, StorageRecord
from .window import layer_window_map


class AsyncDoubleBufferGroupOffloadHandler(SynchronizedGroupOffloadHandler):
    """Offload the first ``num_offload_group`` of ``num_model_group`` groups, overlapped."""

    def __init__(
        self,
        num_offload_group: int,
        num_model_group: int,
        tensor_need_offloading_checker: Checker = (lambda t: True),
        double_buffering: bool = False,
        debug: bool = False,
        *,
        device: Optional[OffloadDevice] = None,
    ) -> None:
        self.offloaded_group_count = 0
        super().__init__(
            num_offload_group=num_offload_group,
            tensor_need_offloading_checker=tensor_need_offloading_checker,
            debug=debug,
            device=device,
        )
        self.num_layers = num_model_group
        self.layer_window_map: Dict[int, int] = layer_window_map(num_offload_group, num_model_group)
        self.double_buffering = double_buffering
        self.reload_double_buffer = (ReloadBufferSet(), ReloadBufferSet())
        self.d2h_stream = self.device.new_stream()
        self.h2d_stream = self.device.new_stream()

    # -- step bookkeeping ---------------------------------------------------------------------
    def groupid_reset(self) -> None:
        super().groupid_reset()
        self.offloaded_group_count = 0

    def _fence(self) -> None:
        compute = self.device.current_stream()
        self.device.wait_stream(compute, self.d2h_stream)
        self.device.wait_stream(compute, self.h2d_stream)

    def on_context_enter(self) -> None:
        super().on_context_enter()
        # A forward that ran through all layers and never got a backward (its graph was dropped):
        # this enter starts the next step. Under no_grad nothing is saved, so leave the step be.
        if torch.is_grad_enabled() and self._phase == "forward":
            if self.current_group >= self.num_layers:
                if self._step_graph_alive():
                    warnings.warn(
                        f"the offload context was entered after model_layers={self.num_layers} "
                        "layers while their graph is still alive: a new step starts here (the "
                        "earlier graph still backwards correctly, reloading on demand). If the "
                        "model has more layers, pass model_layers=<number of `with ctx:` blocks "
                        "per step>",
                        UserWarning,
                        stacklevel=3,
                    )
                self._abort_step()

    def _step_graph_alive(self) -> bool:
        return any(r.alive() for records in self._groups.values() for r in records.values())

    # -- push: only record; copies start at group commits ---------------------------------------
    def _on_new_record(self, record: StorageRecord) -> None:
        pass

    # -- forward ------------------------------------------------------------------------------
    def bulk_offload_group(self, group_to_offload: int) -> None:
        """Queue the copies of one group on the D2H stream (already ordered after compute)."""
        records = self._groups.get(group_to_offload)
        if not records:
            return
        live = {key: r for key, r in records.items() if r.alive()}  # dead ones: never copied
        self._groups[group_to_offload] = live
        for record in live.values():
            record.start_offload(self.d2h_stream)
        event = self.device.record_event(self.d2h_stream)
        for record in live.values():
            record.offload_event = event
        self.device.trace("offload", group_to_offload)

    def _release_group(self, group: int) -> None:
        """Drop the device memory of an offloaded group (compute has waited for its copies)."""
        records = self._groups.get(group, {})
        for record in records.values():
            record.release_device()
        self._groups[group] = {key: r for key, r in records.items() if r.alive()}
        self.device.trace("release", group)

    def on_group_commit_forward(self) -> None:
        current = self.current_group
        dev, compute = self.device, self.device.current_stream()
        if self.num_offload_group > 0:
            if current == 0:
                dev.wait_stream(self.d2h_stream, compute)
                self.bulk_offload_group(0)
            if self.layer_window_map.get(self.offloaded_group_count) == current:
                dev.wait_stream(self.d2h_stream, compute)
                dev.wait_stream(compute, self.d2h_stream)
                self._release_group(self.offloaded_group_count)
                if self.offloaded_group_count < self.num_offload_group - 1:
                    self.bulk_offload_group(self.offloaded_group_count + 1)
                self.offloaded_group_count += 1
        self._phase = "forward"
        self._awaiting_commit = self._refused = False
        self.current_group += 1
        self.tensor_count_current_group = 0

    # -- backward -----------------------------------------------------------------------------
    def _reload_buffers(self, group: int, records: List[StorageRecord]) -> List[Tuple]:
        """Device buffers for a group's reload, allocated on the compute stream.

        With double buffering, the set of the group's parity is reused unless the group that
        filled it last has not run its backward yet (Transformer Engine would overwrite it; here
        the group gets fresh buffers instead).
        """
        sizes = [r.nbytes for r in records]
        where = records[0].where
        if self.double_buffering:
            bset = self.reload_double_buffer[group % 2]
            if not bset.busy(self.step, self.current_group):
                bufs = bset.take((self.step, group), sizes, self.device, where)
                return [(b, (bset, bset.generation)) for b in bufs]
        return [(self.device.alloc_device(n, where), None) for n in sizes]

    def bulk_reload_group(self, group_to_reload: int) -> None:
        """Queue the copies of one group back on the H2D stream; the handler then forgets it."""
        assert group_to_reload < self.num_offload_group
        records = [
            r for r in self._groups.pop(group_to_reload, {}).values()
            if r.alive() and r.needs_reload()
        ]
        if not records:
            return
        dev = self.device
        buffers = self._reload_buffers(group_to_reload, records)
        # Allocation may queue work on compute (deterministic mode fills fresh memory): the
        # copies into the new buffers go after it, and after the offload they read from.
        dev.wait_stream(self.h2d_stream, dev.current_stream())
        offload_events = {id(r.offload_event): r.offload_event for r in records}
        for event in offload_events.values():
            if event is not None:
                dev.wait_event(self.h2d_stream, event)
        for record, (buf, slot) in zip(records, buffers):
            record.start_reload(self.h2d_stream, buf, slot)
        self._reloaded += [weakref.ref(r) for r in records]
        event = dev.record_event(self.h2d_stream)
        for record in records:
            record.reload_event = event
        dev.trace("reload", group_to_reload)

    def on_group_commit_backward(self) -> None:
        self.current_group -= 1
        assert self.current_group >= 0
        dev, compute = self.device, self.device.current_stream()
        count = self.offloaded_group_count
        if count > 0 and self.layer_window_map.get(count - 1) == self.current_group:
            dev.wait_stream(self.h2d_stream, compute)
            dev.wait_stream(compute, self.h2d_stream)
            self.bulk_reload_group(count - 1)
            self.offloaded_group_count -= 1 if count > 1 else 0
        if self.current_group == 0:
            dev.wait_stream(compute, self.h2d_stream)
            self._finish_step()
