"""Pinned staging buffers and the copies between them and the device (device interface only).

Each bucket of CPU-updated parameters gets one host buffer, allocated once at construction; every
parameter owns a 64-byte-aligned slice of it. A gradient is copied into its slice during backward
(model dtype, flat bytes), the CPU update reads it there and writes the new parameter value back
into the parameter slice (the same slice when grads and params are both pinned or both pageable),
and the parameter streams back from it. Nothing pinned is allocated after construction.

Ordering (all device side, the launching thread never blocks):

- a gradient copy waits for the compute stream at the moment the gradient became final;
- the CPU reads a bucket after ``wait_host`` on the bucket's last gradient copy;
- a bucket's parameter copy to the device waits for that same event. Every backward use of a
  parameter is queued before its gradient is final, so the copy cannot overwrite the parameter
  under a kernel that still reads it;
- the compute stream waits for a bucket's parameter copy before the parameter is used again, and
  for the gradient copies before gradients may be freed or zeroed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.device import Event, OffloadDevice

ALIGN = 64


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (what ``OffloadDevice.copy`` moves).
    No more views than needed: a chunk's launch takes this of every state tensor it copies."""
    if t.requires_grad:
        t = t.detach()
    return (t if t.dim() == 1 else t.reshape(-1)).view(torch.uint8)


class Staging:
    """Host slices for the parameters of each bucket (pinned through the device, or pageable)."""

    def __init__(self, device: OffloadDevice, pinned: bool) -> None:
        self._device = device
        self.pinned = pinned
        self._slices: dict[int, torch.Tensor] = {}

    def add_bucket(self, params: Sequence[torch.Tensor]) -> None:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        if self.pinned:
            buf = self._device.alloc_host(total)
        else:
            buf = torch.empty(total, dtype=torch.uint8)
        for p, off in zip(params, offsets):
            self._slices[id(p)] = buf[off: off + p.numel() * p.element_size()]

    def bytes(self, p: torch.Tensor) -> torch.Tensor:
        return self._slices[id(p)]

    def typed(self, p: torch.Tensor) -> torch.Tensor:
        """The slice of ``p`` viewed with ``p``'s dtype and shape."""
        return self._slices[id(p)].view(p.dtype).view(p.shape)


class TransferEngine:
    """The two copy streams and the events that order them against compute and the CPU."""

    def __init__(self, device: OffloadDevice, pin_grads: bool, pin_params: bool) -> None:
        self.device = device
        self.grads = Staging(device, pin_grads)
        self.params = self.grads if pin_params == pin_grads else Staging(device, pin_params)
        self.d2h = device.new_stream()
        self.h2d = device.new_stream()
        self.bytes_out = 0
        self.bytes_in = 0

    def add_bucket(self, params: Sequence[torch.Tensor]) -> None:
        self.grads.add_bucket(params)
        if self.params is not self.grads:
            self.params.add_bucket(params)

    def compute_event(self) -> Event:
        return self.device.record_event(self.device.current_stream())

    def read_params(self, params: Sequence[torch.Tensor]) -> None:
        """Copy the current parameter values into their param slices and wait (construction and
        ``reload_master_weights`` only)."""
        self.device.wait_event(self.d2h, self.compute_event())
        for p in params:
            self.device.copy(self.d2h, self.params.bytes(p), flat_bytes(p))
        self.device.wait_host(self.device.record_event(self.d2h))

    def grad_out(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Queue the copy of ``p``'s final gradient (contiguous, ``p``'s dtype) to its slice."""
        self.device.wait_event(self.d2h, self.compute_event())
        self.device.copy(self.d2h, self.grads.bytes(p), flat_bytes(grad))
        self.bytes_out += grad.numel() * grad.element_size()

    def mark_landed(self) -> Event:
        """An event after every gradient copy queued so far."""
        return self.device.record_event(self.d2h)

    def wait_landed(self, event: Event) -> None:
        """Block the calling (worker) thread until the copies before ``event`` have landed."""
        self.device.wait_host(event)

    def params_in(self, params: Sequence[torch.Tensor], after: Event) -> Optional[Event]:
        """Queue the copies of the updated ``params`` back into the device parameters, after
        ``after`` (the bucket's landed event); returns the event to wait for before using them."""
        if not params:
            return None
        self.device.wait_event(self.h2d, after)
        for p in params:
            self.device.copy(self.h2d, flat_bytes(p), self.params.bytes(p))
            self.bytes_in += p.numel() * p.element_size()
        return self.device.record_event(self.h2d)

    def fence_compute(self, event: Optional[Event]) -> None:
        """Make the compute stream wait for ``event`` (device side)."""
        if event is not None:
            self.device.wait_event(self.device.current_stream(), event)


HOST_BLOCK_BYTES = 2**30
PIN_ALIGN = 256  # bytes: every buffer ``pack_pinned`` carves starts aligned


def pack_pinned(device: OffloadDevice, sizes: Sequence[int], block: int = HOST_BLOCK_BYTES) -> list[torch.Tensor]:
    """Pinned host buffers of ``sizes`` bytes (in order), carved from blocks of ``block`` bytes
    (a size over ``block`` gets its own allocation; the last block only what it holds)."""
    plan, used, cur = [], [], None  # plan: (block, offset) per size; used: bytes per block
    for n in sizes:
        n_al = -(-n // PIN_ALIGN) * PIN_ALIGN
        if n_al > block:
            plan.append((len(used), 0))
            used.append(n_al)
            continue
        if cur is None or used[cur] + n_al > block:
            cur = len(used)
            used.append(0)
        plan.append((cur, used[cur]))
        used[cur] += n_al
    blocks = [device.alloc_host(block if i != cur and u <= block else u) for i, u in enumerate(used)]
    return [blocks[b][off: off + n] for (b, off), n in zip(plan, sizes)]
