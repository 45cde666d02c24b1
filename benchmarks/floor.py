"""The minimal exact offloader: the floor that V2's cost is measured against.

``hook_overhead.py`` (64 small layers) and ``hf_llama_benchmark.py`` (a Hugging Face Llama) time
it beside V2, in the same run and on the same layers, so that a missed target can be told apart
from the cost that any offloader pays on this host. It does only the work that no exact offloader
can skip:

- per saved tensor: the hook pair, a pinned allocation and one device-to-host copy in forward,
  and one device allocation and one host-to-device copy in backward;
- per offloaded layer: one stream wait and one event each way, events reused every step.

Two schedules for the first ``k`` of ``n`` layers:

- ``on_demand`` (``hook_overhead.py``, the issue's floor): compute waits for a layer's copies as
  soon as they are queued (its device tensors are dropped then), and a layer is reloaded by its
  first unpack. The fewest host calls; on a real model the GPU would wait for every copy.
- ``ahead`` (``hf_llama_benchmark.py``): V2's default schedule. Layer ``i`` is released (compute
  waits for its copies, then its device tensors are dropped) when layer ``n-k+i`` begins its
  forward, and reloaded when layer ``n-k+i-1`` begins its backward (a gradient hook on that
  layer's output: one more hook per layer).

It has no deduplication of shared storages, no view handling (a tensor comes back contiguous), no
in-place check, no statistics and no error handling. So it is exact on the models these
benchmarks build (their exactness step checks it), not in general. Parameters, their views and
tensors under ``min_elements`` stay on the device. On the CPU (no CUDA) the copies are plain
synchronous copies: a smoke test of the scripts only.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
from torch import nn

from cpu_offload.v2.selection import DEFAULT_MIN_TENSOR_SIZE


class FloorOffloader:
    """Offload the first ``num_layers`` of ``model_layers`` layers with the least work.

    Call ``before(i)`` and ``after(i, output)`` around layer ``i`` (a benchmark's own layer loop),
    or ``attach(layers)`` to do it with module hooks; ``remove()`` detaches them.
    ``schedule``: ``"on_demand"`` or ``"ahead"`` (the module docstring).
    """

    def __init__(self, num_layers: int, model_layers: int, cuda: bool,
                 min_elements: int = DEFAULT_MIN_TENSOR_SIZE, schedule: str = "ahead") -> None:
        if not 1 <= num_layers < model_layers:
            raise ValueError(f"the floor offloads 1 to {model_layers - 1} layers, got {num_layers}")
        if schedule not in ("on_demand", "ahead"):
            raise ValueError(f"schedule must be 'on_demand' or 'ahead', got {schedule!r}")
        self.k, self.n, self.cuda, self.min_elements = num_layers, model_layers, cuda, min_elements
        self.ahead = schedule == "ahead"
        self.stream = torch.cuda.Stream() if cuda else None
        self.out_events = [torch.cuda.Event() for _ in range(num_layers)] if cuda else []
        self.in_events = [torch.cuda.Event() for _ in range(num_layers)] if cuda else []
        self.layers: dict[int, list] = {}  # offloaded layer -> [slots, device tensors, reloaded, waited, index]
        self.hooks: Any = None
        self.handles: list = []

    # -- forward -------------------------------------------------------------------------------
    def before(self, i: int) -> None:
        if self.ahead:
            j = i - (self.n - self.k)  # layer i's forward releases offloaded layer j
            if 0 <= j < self.k and j in self.layers:
                if self.cuda:
                    torch.cuda.current_stream().wait_event(self.out_events[j])
                self.layers[j][1] = None
        if i < self.k:
            slots: list = []
            state = self.layers[i] = [slots, None, False, False, i]
            minimum = self.min_elements

            def pack(t: torch.Tensor) -> Any:
                if (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                        or t.numel() < minimum):
                    return t
                slot = [t, state]
                slots.append(slot)
                return slot

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)
            self.hooks.__enter__()

    def after(self, i: int, output: Any) -> None:
        if i < self.k:
            self.hooks.__exit__(None, None, None)
            self.copy_out(i, self.layers[i])
        if self.ahead:
            j = i - (self.n - self.k) + 1  # layer i's backward start reloads offloaded layer j
            if 0 <= j < self.k:
                out = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(partial(self.copy_in, j))

    def copy_out(self, i: int, state: list) -> None:
        slots = state[0]
        if not self.cuda:
            for slot in slots:
                slot[0] = slot[0].to("cpu", copy=True)
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        if self.ahead:
            state[1] = [slot[0] for slot in slots]  # the device tensors, kept until the release
        with torch.cuda.stream(self.stream):
            for slot in slots:
                t = slot[0]
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                slot[0] = host
            self.out_events[i].record()
        if not self.ahead:
            # Released now: memory the allocator hands out again is written only after this.
            compute.wait_event(self.out_events[i])

    # -- backward ------------------------------------------------------------------------------
    def copy_in(self, j: int, grad: Any = None) -> None:
        state = self.layers[j]
        if state[2]:
            return None
        state[2] = True
        slots = state[0]
        if not self.cuda:
            for slot in slots:
                slot[0] = slot[0].clone()
            return None
        compute = torch.cuda.current_stream()
        buffers = [torch.empty(s[0].shape, dtype=s[0].dtype, device="cuda") for s in slots]
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for slot, buf in zip(slots, buffers):
                buf.copy_(slot[0], non_blocking=True)
                slot[0] = buf
            self.in_events[j].record()
        return None

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not list:
            return packed
        state = packed[1]
        if not state[2]:  # on demand, or its trigger never fired (an output went unused)
            self.copy_in(state[4])
        if not state[3]:
            state[3] = True
            if self.cuda:
                torch.cuda.current_stream().wait_event(self.in_events[state[4]])
        return packed[0]

    # -- on a model's own layers ---------------------------------------------------------------
    def attach(self, layers: Sequence[nn.Module]) -> "FloorOffloader":
        """Run ``before``/``after`` from forward hooks on ``layers`` (their order is the index)."""
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(
                lambda module, args, i=i: self.before(i)))
            self.handles.append(layer.register_forward_hook(
                lambda module, args, out, i=i: self.after(i, out)))
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.layers.clear()
