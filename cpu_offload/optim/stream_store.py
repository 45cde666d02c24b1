"""Host memory of a streamed part: its masters and optimizer state in pinned memory.

Pinned memory is taken at construction, in large blocks (``transfer.pack_pinned``: torch's
pinned allocator rounds every allocation up to a power of two, and allocating it later would
stall a step). A ``HostCopy`` is one full copy: per parameter its master (bf16/fp16 parameters;
an fp32/fp64 parameter is its own master and stays on the device) and room for its per-element
state tensors; small state (AdamW's ``step``) comes from a pool. A part has one; with updates
started in backward (``stream_backward``) a second, the *spare*, which those updates write so
that the current values stay untouched until ``step()`` keeps them.

A ``PieceHost`` is one piece's view of those copies: the ``current`` side (where the latest
values are: the one copies in read) and the ``spare`` side, which trade places when ``step()``
keeps an update started in backward (``flip``), and trade back, values copied, before the host
reads state (``settle``): readers always find the latest values in the first copy.

``ParamIO`` moves low-precision parameters to and from their masters outside the update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from ..core.device import OffloadDevice, Stream
from .cpu_update import master_dtype
from .transfer import flat_bytes, pack_pinned

SMALL_STATE_BYTES = 64  # host bytes reserved per small (not per-element) state tensor
IO_BYTES = 16 * 2**20  # pinned buffer for reading/writing low-precision parameters (load, reload)


class HostCopy:
    """One copy of the masters and state of ``params`` in pinned host memory (see the module
    docstring): ``masters[i]`` (``None`` where parameter ``i`` is its own master), per-element
    state from buffers reserved per parameter, small state from a pool (``reserve_small``)."""

    def __init__(self, device: OffloadDevice, params: Sequence[torch.Tensor], state_elems: int,
                 fp32_masters: bool = True) -> None:
        self.device = device
        self.params = list(params)
        self.fp32_masters = fp32_masters  # else every parameter is its own master (master_dtype)
        sizes = []
        for p in self.params:
            md = master_dtype(p.dtype, fp32_masters)
            sizes += [p.numel() * md.itemsize] * ((md != p.dtype) + state_elems)
        bufs = iter(pack_pinned(device, sizes))
        self.masters: list[Optional[torch.Tensor]] = []  # typed, the parameter's shape
        self._master_raw: list[Optional[torch.Tensor]] = []  # the same bytes, as carved
        self._free: list[list[torch.Tensor]] = []  # per param: buffers for its per-element state
        for p in self.params:
            md = master_dtype(p.dtype, fp32_masters)
            raw = next(bufs) if md != p.dtype else None
            self._master_raw.append(raw)
            self.masters.append(raw.view(md).view(p.shape) if raw is not None else None)
            self._free.append([next(bufs) for _ in range(state_elems)])
        self._full: dict[tuple[int, str], torch.Tensor] = {}  # (param, name) -> its state tensor
        self._raw: dict[tuple[int, str], torch.Tensor] = {}  # the same bytes, as carved
        self._small: list[torch.Tensor] = []

    def reserve_small(self, count: int) -> None:
        """A pool of two small-state buffers per piece (``count`` pieces)."""
        pool = self.device.alloc_host(count * 2 * SMALL_STATE_BYTES) if count else None
        self._small = [pool[k: k + SMALL_STATE_BYTES]
                       for k in range(0, count * 2 * SMALL_STATE_BYTES, SMALL_STATE_BYTES)]

    def full(self, index: int, name: str) -> Optional[torch.Tensor]:
        """Per-element state ``name`` of parameter ``index`` (its shape), if it has one here."""
        return self._full.get((index, name))

    def per_element(self, index: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Per-element state ``name`` of parameter ``index`` (of ``dtype``, the parameter's
        shape): one tensor per parameter, its pieces take slices; made at first use, from the
        buffers reserved for the parameter where one fits."""
        full = self._full.get((index, name))
        if full is None or full.dtype != dtype:
            p = self.params[index]
            nbytes = p.numel() * dtype.itemsize
            fits = [b for b in self._free[index] if b.numel() == nbytes]
            if fits:
                self._free[index].remove(fits[0])
            raw = self._raw[(index, name)] = fits[0] if fits else self.device.alloc_host(nbytes)
            full = self._full[(index, name)] = raw.view(dtype).view(p.shape)
        return full

    def per_element_bytes(self, index: int, name: str, dtype: torch.dtype, start: int,
                          stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``per_element(index, name, dtype)``, as a slice of the
        pinned buffer itself (a copy sees it as host memory)."""
        self.per_element(index, name, dtype)
        return self._raw[(index, name)][start * dtype.itemsize: stop * dtype.itemsize]

    def master_bytes(self, index: int, start: int, stop: int) -> Optional[torch.Tensor]:
        """Elements ``[start, stop)`` of ``masters[index]``, as a slice of the pinned buffer
        itself (``None`` where the parameter is its own master)."""
        raw, m = self._master_raw[index], self.masters[index]
        return raw[start * m.element_size(): stop * m.element_size()] if raw is not None else None

    def small(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for a small state tensor: from the pool where it fits."""
        if self._small and nbytes <= SMALL_STATE_BYTES:
            return self._small.pop()[:nbytes]
        return self.device.alloc_host(nbytes)


@dataclass(eq=False)
class HostSide:
    """One host copy of a piece: its master's bytes (``None``: its parameter is its own master)
    and the bytes of each streamed state tensor, by name."""

    master: Optional[torch.Tensor] = None
    state: dict = field(default_factory=dict)


@dataclass(eq=False)
class PieceHost:
    """Where one piece's master and state live on the host (see the module docstring)."""

    current: HostSide  # the latest values: what the next copy in reads
    spare: HostSide = field(default_factory=HostSide)  # written by updates started in backward
    streamed: dict = field(default_factory=dict)  # name -> state tensor in the first copy (typed)
    kept: dict = field(default_factory=dict)  # state entries that stay where they are
    previous: dict = field(default_factory=dict)  # ``streamed`` before load_state_dict: reused
    spare_previous: dict = field(default_factory=dict)  # ``spare.state`` before it: reused
    prepared: bool = False  # has its spare copy (updated in a step() before)
    flipped: bool = False  # the spare copy is the first one now (until ``settle``)

    @classmethod
    def of(cls, master: Optional[torch.Tensor]) -> "PieceHost":
        """A piece's host side, its master (``None``: its parameter is its own) in the first copy."""
        return cls(HostSide(flat_bytes(master) if master is not None else None))

    def add_streamed(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """State ``name`` is streamed from now on, kept in ``host`` (first copy); its bytes."""
        self.streamed[name] = host
        self.current.state[name] = flat = flat_bytes(host)
        return flat

    def flip(self) -> None:
        """The two copies trade places (``step()`` kept an update that wrote the spare)."""
        self.current, self.spare = self.spare, self.current
        self.flipped = not self.flipped

    def settle(self) -> None:
        """Bring the latest values back to the first copy (the host reads it: state dicts)."""
        if not self.flipped:
            return
        if self.spare.master is not None:
            self.spare.master.copy_(self.current.master)
        for name, flat in self.current.state.items():
            self.spare.state[name].copy_(flat)
        self.flip()

    def forget_state(self) -> None:
        """Before ``load_state_dict``: no state streamed or kept; its host memory is reused."""
        self.previous, self.streamed, self.kept = self.streamed, {}, {}
        self.spare_previous = self.spare.state
        self.current.state, self.spare.state = {}, {}

    def previous_of(self, name: str, dtype: torch.dtype, shape: torch.Size) -> Optional[torch.Tensor]:
        """Host memory state ``name`` had before ``load_state_dict``, if it fits."""
        prev = self.previous.pop(name, None)
        return prev if prev is not None and prev.dtype == dtype and prev.shape == shape else None

    def spare_previous_of(self, name: str, nbytes: int) -> Optional[torch.Tensor]:
        """The spare's host memory of state ``name`` before ``load_state_dict``, if it fits."""
        old = self.spare_previous.pop(name, None)
        return old if old is not None and old.numel() == nbytes else None


class ParamIO:
    """Low-precision parameters <-> their masters outside the update (construction,
    ``reload_master_weights``, ``load_state_dict``): through one pinned buffer of at most
    ``IO_BYTES``, taken at construction, a slice at a time; the host waits for each."""

    def __init__(self, device: OffloadDevice, params: Sequence[torch.Tensor],
                 masters: Sequence[Optional[torch.Tensor]]) -> None:
        self.device = device
        self.pairs = [(p, m) for p, m in zip(params, masters) if m is not None]
        sizes = [p.numel() * p.element_size() for p, _ in self.pairs]
        self.buffer = device.alloc_host(min(IO_BYTES, max(sizes))) if sizes else None

    def _slices(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(parameter bytes, master elements, buffer bytes, buffer typed) per slice."""
        for p, m in self.pairs:
            step = max(1, IO_BYTES // p.element_size())
            flat, mflat = flat_bytes(p), m.view(-1)
            for start in range(0, p.numel(), step):
                n = min(step, p.numel() - start)
                raw = self.buffer[: n * p.element_size()]
                yield flat[start * p.element_size(): (start + n) * p.element_size()], \
                    mflat[start: start + n], raw, raw.view(p.dtype)

    def read(self, d2h: Stream) -> None:
        """Masters from the parameters as the compute stream leaves them (copies on ``d2h``)."""
        dev = self.device
        dev.wait_event(d2h, dev.record_event(dev.current_stream()))
        for pbytes, mpiece, raw, typed in self._slices():
            dev.copy(d2h, raw, pbytes)
            dev.wait_host(dev.record_event(d2h))
            mpiece.copy_(typed)

    def write(self, h2d: Stream) -> None:
        """Parameters from the masters (copies on ``h2d``); the compute stream waits for them."""
        dev = self.device
        dev.wait_event(h2d, dev.record_event(dev.current_stream()))
        for pbytes, mpiece, raw, typed in self._slices():
            dev.wait_host(dev.record_event(h2d))  # the previous slice has left the buffer
            typed.copy_(mpiece)
            dev.copy(h2d, pbytes, raw)
        dev.wait_event(dev.current_stream(), dev.record_event(h2d))
        dev.wait_host(dev.record_event(h2d))
