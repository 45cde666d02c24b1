"""A plain-torch GPT block stack: the workload of the demo, the benchmarks and the GPU tests.

Why it is embedded here instead of taken from a model library: the reference workload must
be built from plain torch (``LayerNorm``, ``Linear``, ``scaled_dot_product_attention``, GELU MLP)
and must exercise exactly the tensor layouts offloading has to survive:

- ``q``, ``k``, ``v`` are views of one fused ``qkv`` output (``split`` + ``view`` + ``transpose``),
  so three saved tensors share one storage (tensor-group processing must offload it once);
- the attention output goes through ``out.transpose(1, 2).reshape(batch, seq, hidden)``. On CUDA the
  flash / memory-efficient kernels lay ``out`` out as (batch, seq, heads, head_dim) behind a
  (batch, heads, seq, head_dim) shape, so the transpose is contiguous and ``reshape`` returns a
  *contiguous view of a non-contiguous base*, which the output projection saves for backward while
  SDPA saves the base itself. A reference implementation of V2 fails on exactly this pattern.

The usage pattern of the library is spelled out once, in ``run_layers``::

    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)

Legacy V1 offloads only tensors tagged ``activation_offloading``. A block with
``tag_activations = True`` tags, right before each op that saves them, the activations it creates
(the block input, both LayerNorm outputs, ``q``/``k``/``v``, the reshaped attention output, the
post-attention residual, the MLP hidden before and after GELU), mirroring what TE layers tag.
Inputs of ``Linear`` are flattened to 2D by the block itself (``GPTBlock._linear``) so that the
tagged object is the one ``addmm`` saves. Tags cannot be put on tensors that an op creates *and*
saves itself (SDPA's output and logsumexp, LayerNorm's mean/rstd), so V1 leaves those on the GPU;
the attention output's storage is still copied once through its tagged reshaped view.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..control import mark_activation_offload

__all__ = [
    "GPTBlock",
    "GPTConfig",
    "GPTStack",
    "build_model",
    "make_input",
    "reference_config",
    "run_layers",
    "tiny_config",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT stack and of the batch it is run on."""

    hidden: int
    heads: int
    seq: int
    batch: int
    layers: int
    dtype: torch.dtype = torch.float32
    mlp_ratio: int = 4
    dropout: float = 0.0

    def with_(self, **changes: Any) -> "GPTConfig":
        """A copy with some fields changed (e.g. fewer layers from a command-line flag)."""
        return replace(self, **changes)

    def input_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.seq, self.hidden)

    def params_per_layer(self) -> int:
        """Parameters of one block: qkv, proj, fc1, fc2 (weights + biases) and two LayerNorms."""
        h, m = self.hidden, self.mlp_ratio
        return (3 * h * h + 3 * h) + (h * h + h) + (m * h * h + m * h) + (m * h * h + h) + 4 * h


def reference_config() -> GPTConfig:
    """The reference workload (README, "Performance"): hidden 4096, 32 heads, sequence 4096,
    batch 1, 8 layers, bf16.

    About 0.5 GiB of offloadable activations per layer (so ~3 GiB each way for k=6) and
    0.4 GB of bf16 weights per layer.
    """
    return GPTConfig(hidden=4096, heads=32, seq=4096, batch=1, layers=8, dtype=torch.bfloat16)


def tiny_config() -> GPTConfig:
    """A stack small enough for CPU tests (float32 so CPU kernels are exact and fast)."""
    return GPTConfig(hidden=64, heads=4, seq=32, batch=2, layers=4, dtype=torch.float32)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Attention uses one fused ``qkv`` Linear and causal ``scaled_dot_product_attention``; the MLP is
    ``Linear(h, r*h) -> GELU(tanh) -> Linear(r*h, h)``. Dropout modules exist only when
    ``dropout > 0`` so that the default block saves no dropout masks for backward.
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)
        self.attn_drop: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.mlp_drop: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # V1 offloads only tagged tensors; see the module docstring for what gets tagged.
        self.tag_activations = False

    def _tag(self, *tensors: torch.Tensor) -> None:
        if self.tag_activations:
            mark_activation_offload(*tensors)

    def _linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` for a contiguous (batch, seq, features) ``x``, flattened to 2D here.

        torch flattens contiguous 3D inputs to (batch*seq, features) inside ``F.linear`` anyway
        (same ``addmm`` kernel, same saved tensors); doing it here makes the tensor ``Linear``
        saves for backward the very object V1's tag is set on, not an internal view without it.
        """
        flat = x.view(-1, x.shape[-1])
        self._tag(flat)
        return linear(flat).view(*x.shape[:-1], linear.out_features)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of ``h`` (batch, seq, hidden); returns the projected output."""
        b, s, _ = h.shape
        q, k, v = self._linear(self.qkv, h).split(self.hidden, dim=-1)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        self._tag(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # This exact pattern matters (module docstring): a contiguous view of a non-contiguous base.
        out = out.transpose(1, 2).reshape(b, s, self.hidden)
        return self.attn_drop(self._linear(self.proj, out))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        u = self._linear(self.fc1, h)
        self._tag(u)
        return self.mlp_drop(self._linear(self.fc2, self.act(u)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._tag(x)
        x = x + self.attention(self.ln1(x))
        self._tag(x)
        return x + self.mlp(self.ln2(x))


def run_layers(
    layers: Iterable[nn.Module],
    x: torch.Tensor,
    ctx: Optional[ContextManager] = None,
    sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    layer_fn: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Run ``layers`` in sequence exactly as the library's users do.

    ``ctx`` and ``sync`` are what ``get_cpu_offload_context`` returns (defaults: no offloading).
    ``layer_fn(layer, x)`` replaces the plain ``layer(x)`` call, e.g. to wrap each layer in
    ``torch.utils.checkpoint``.
    """
    ctx = ctx if ctx is not None else contextlib.nullcontext()
    for layer in layers:
        with ctx:
            x = layer_fn(layer, x) if layer_fn is not None else layer(x)
        if sync is not None:
            x = sync(x)
    return x


class GPTStack(nn.Module):
    """``n_layers`` identical ``GPTBlock``s in ``.layers`` (an ``nn.ModuleList``)."""

    def __init__(
        self, n_layers: int, hidden: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            GPTBlock(hidden, heads, mlp_ratio, dropout) for _ in range(n_layers)
        )

    def set_tag_activations(self, enabled: bool) -> None:
        """Tag activations for legacy V1 offloading (V2 detects them without tags)."""
        for layer in self.layers:
            layer.tag_activations = enabled

    def forward(
        self,
        x: torch.Tensor,
        ctx: Optional[ContextManager] = None,
        sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        layer_fn: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """See ``run_layers``."""
        return run_layers(self.layers, x, ctx, sync, layer_fn)


def _rng_devices(device: torch.device) -> list[int]:
    """CUDA devices whose RNG state ``fork_rng`` must save and restore."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def build_model(cfg: GPTConfig, device: Any = "cpu", seed: int = 0) -> GPTStack:
    """A ``GPTStack`` for ``cfg`` on ``device``, initialised deterministically from ``seed``.

    Parameters are created directly on ``device`` in float32 (torch's default init, drawn from the
    device's RNG) and then cast to ``cfg.dtype``, one block at a time so the float32 copy of the
    whole model never exists. The caller's RNG state is left untouched (``fork_rng``). The same
    seed on the same device gives bit-identical parameters; CPU and CUDA draw different numbers.
    """
    device = torch.device(device)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        with torch.device(device):
            blocks = []
            for _ in range(cfg.layers):
                blocks.append(
                    GPTBlock(cfg.hidden, cfg.heads, cfg.mlp_ratio, cfg.dropout).to(cfg.dtype)
                )
    model = GPTStack(0, cfg.hidden, cfg.heads, cfg.mlp_ratio, cfg.dropout)
    model.layers.extend(blocks)
    return model


def make_input(
    cfg: GPTConfig, device: Any = "cpu", seed: int = 1, requires_grad: bool = True
) -> torch.Tensor:
    """A standard-normal input batch (batch, seq, hidden) of ``cfg.dtype``, deterministic in ``seed``.

    ``requires_grad`` (default) so benchmarks and tests can compare the input gradient too.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(cfg.input_shape(), generator=gen, device=device, dtype=torch.float32)
    return x.to(cfg.dtype).requires_grad_(requires_grad)
