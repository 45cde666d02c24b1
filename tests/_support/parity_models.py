"""Models and helpers shared by the parity suite and the V1 tests.

The block is a small GPT layer from plain torch ops (LayerNorm, Linear, scaled_dot_product_attention
followed by ``transpose().reshape()``, GELU MLP). It tags what it saves with the facade's
``mark_activation_offload``, so V1 offloads those tensors while V2 detects activations on its own:
the same model serves both backends and the V1-to-V2 migration test.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cpu_offload
from cpu_offload.compat import cuda_allocated_bytes, make_wrapper_subclass, tree_map
from cpu_offload.core.simulated import SimulatedDevice

# Warnings some test modules cause on purpose (``pytestmark = EXPECTED_WARNINGS``): they keep
# saved tensors alive (to compare them, or to check what is kept), so offloading frees nothing
# and says so (tests/v2/test_stats_verify.py checks that warning); and their small stacks offload
# all layers but one, so the library warns that copies cannot overlap compute
# (tests/integration/test_misuse.py checks that warning).
EXPECTED_WARNINGS = [
    pytest.mark.filterwarnings("ignore:.*freed no GPU memory:UserWarning"),
    pytest.mark.filterwarnings("ignore:num_layers=model_layers-1:UserWarning"),
]


class Block(nn.Module):
    """One transformer layer on a ``(tokens, hidden)`` residual stream; every activation it saves
    for backward is tagged for V1 (2-D inputs, so ``Linear`` saves the tagged tensor itself).

    ``cuda_like_layout`` reproduces the CUDA flash-attention output layout on the CPU: the
    attention output is a ``(B, H, S, D)`` view of a ``(B, S, H, D)`` buffer, so
    ``transpose().reshape()`` yields a contiguous *view* of a non-contiguous base (the case a
    reference V2 implementation gets wrong). ``aux`` adds a branch whose saved tensor never
    reaches backward.
    """

    def __init__(
        self, hidden: int, heads: int, seq: int, cuda_like_layout: bool = True, aux: bool = False
    ):
        super().__init__()
        self.heads, self.seq = heads, seq
        self.cuda_like_layout = cuda_like_layout
        self.aux = aux
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mark = cpu_offload.mark_activation_offload
        t, d = x.shape
        b, s = t // self.seq, self.seq
        mark(x)
        h = self.ln1(x)
        mark(h)
        qkv = self.qkv(h)
        q, k, v = qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        mark(q, k, v)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.cuda_like_layout:
            o = o.transpose(1, 2).contiguous().transpose(1, 2)
        a = o.transpose(1, 2).reshape(t, d)
        mark(a)
        x = x + self.proj(a)
        mark(x)
        h2 = self.ln2(x)
        mark(h2)
        f = self.fc1(h2)
        mark(f)
        g = F.gelu(f)
        mark(g)
        if self.aux:
            side = f * 2
            mark(side)
            torch.sin(side)  # saved for a backward that never comes: dropped right away
        return x + self.fc2(g)


def make_layers(
    n: int = 4,
    hidden: int = 32,
    heads: int = 4,
    seq: int = 16,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **block_kwargs: bool,
) -> nn.ModuleList:
    torch.manual_seed(seed)
    layers = nn.ModuleList(Block(hidden, heads, seq, **block_kwargs) for _ in range(n))
    return layers.to(device, dtype)


def make_input(
    batch: int = 2, seq: int = 16, hidden: int = 32, seed: int = 1, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A ``(batch * seq, hidden)`` input that requires grad (its gradient is compared too)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * seq, hidden, generator=g, dtype=dtype)
    return x.to(device).requires_grad_()


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    ctx: Optional[object] = None,
    sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    on_layer: Optional[Callable[[int, torch.Tensor], None]] = None,
) -> torch.Tensor:
    """The documented usage: each layer under the context, its output through the sync fn."""
    for i, layer in enumerate(layers):
        if ctx is None:
            x = layer(x)
        else:
            with ctx:
                x = layer(x)
        if on_layer is not None:
            on_layer(i, x)
        if sync is not None:
            x = sync(x)
    return x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).pow(2).mean()


def grads_of(layers: nn.ModuleList, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in layers.named_parameters()}
    out["<input>"] = x.grad.detach().clone()
    return out


def zero_grads(layers: nn.ModuleList, x: torch.Tensor) -> None:
    layers.zero_grad(set_to_none=True)
    x.grad = None


def train_step(
    layers: nn.ModuleList,
    x: torch.Tensor,
    ctx: Optional[object] = None,
    sync: Optional[Callable] = None,
    retain_graph: bool = False,
    backwards: int = 1,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Forward, ``backwards`` backward passes; returns (output, gradients)."""
    zero_grads(layers, x)
    out = run_layers(layers, x, ctx, sync)
    loss = loss_of(out)
    for i in range(backwards):
        loss.backward(retain_graph=retain_graph or i + 1 < backwards)
    return out.detach(), grads_of(layers, x)


def allocated_bytes() -> int:
    """``torch.cuda.memory_allocated()`` without its garbage (a reference cycle per call), which
    would mask cycles made by offloading."""
    return cuda_allocated_bytes()


def cyclic_garbage() -> list:
    """Collect, and describe, objects that only the cycle collector could free."""
    import collections
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(6)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return found


def assert_bit_identical(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-identical: {bad}"


class TrackingSimDevice(SimulatedDevice):
    """A simulated device that also remembers (weakly) every buffer it handed out, so tests can
    check that nothing stays alive after a step."""

    def __init__(self, defer: bool = True) -> None:
        super().__init__(defer=defer)
        self._host: List[weakref.ref] = []
        self._dev: List[weakref.ref] = []

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        t = super().alloc_host(nbytes)
        self._host.append(weakref.ref(t))
        return t

    def alloc_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        t = super().alloc_device(nbytes, device)
        self._dev.append(weakref.ref(t))
        return t

    def live_host_buffers(self) -> int:
        return sum(r() is not None for r in self._host)

    def live_device_buffers(self) -> int:
        return sum(r() is not None for r in self._dev)

    def copies(self, stream: Optional[str] = None) -> List[int]:
        return [e[2] for e in self.log if e[0] == "copy" and (stream is None or e[1] == stream)]


class ActivationWatch:
    """Weak references to the outputs of every module of the layers (what gets saved for
    backward, or the bases of what does), to check that all are freed once a step is over."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.refs: List[weakref.ref] = []
        self.handles = [
            m.register_forward_hook(self._hook) for layer in layers for m in layer.modules()
        ]

    def _hook(self, module: nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def clear(self) -> None:
        self.refs = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Scaled(torch.Tensor):
    """A minimal wrapper subclass: low-precision data plus a scale (like a quantized tensor)."""

    @staticmethod
    def __new__(cls, data, scale):
        return make_wrapper_subclass(cls, data, torch.float32)

    def __init__(self, data, scale):
        self._data, self._scale = data, scale

    @classmethod
    def quantize(cls, x, scale=0.5):
        return cls((x / scale).to(torch.float16), scale)

    def dequantize(self):
        return self._data.float() * self._scale

    def __tensor_flatten__(self):
        return ["_data"], {"scale": self._scale}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Scaled(inner["_data"], meta["scale"])

    def __repr__(self):
        return f"Scaled({self._data!r}, scale={self._scale})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return Scaled(func(args[0]._data), args[0]._scale)
        unwrap = lambda t: t.dequantize() if isinstance(t, Scaled) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
