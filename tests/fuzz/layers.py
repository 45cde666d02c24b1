"""The layer types the fuzzer combines. Each class is self-contained: a reproducer inlines the
source of the classes it uses (``inspect.getsource``), so keep every class's code in its body.

Every layer maps a ``(tokens, width)`` hidden state to one of the same shape (``tokens = 2 *
SEQ``), saves tensors of its own kind for backward, and tags them with
``cpu_offload.mark_activation_offload`` (the legacy V1 backend offloads only tagged tensors; V2
ignores the tags). ``out`` chooses what it returns: the hidden state, ``(hidden, aux)`` or
``{"hidden_states": hidden, "aux": aux}``; ``armed`` makes its forward raise ``Boom`` after it
has saved its tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import cpu_offload

SEQ = 4  # tokens per sequence; the batch is 2 sequences


class Boom(RuntimeError):
    """The exception a program raises on purpose."""


class FuzzLayer(nn.Module):
    def __init__(self, out: str = "tensor"):
        super().__init__()
        self.out = out
        self.armed = False

    def forward(self, h):
        y, aux = self.body(h)
        if self.armed:
            raise Boom("a layer raised in forward")
        if self.out == "tuple":
            return y, aux
        if self.out == "dict":
            return {"hidden_states": y, "aux": aux}
        return y


class Mlp(FuzzLayer):
    """Linear + GELU + Linear, residual."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def body(self, h):
        f = self.fc1(h)
        g = F.gelu(f)
        cpu_offload.mark_activation_offload(h, f, g)
        return h + self.fc2(g), f


class Attention(FuzzLayer):
    """LayerNorm, qkv projection, scaled_dot_product_attention, then ``transpose().reshape()``.
    ``cuda_layout`` gives the attention output CUDA flash attention's layout (a (B, H, S, D)
    view of a (B, S, H, D) buffer), so the reshape is a contiguous view of a non-contiguous
    base."""

    def __init__(self, width, heads=2, causal=True, cuda_layout=True, out="tensor"):
        super().__init__(out)
        self.heads, self.causal, self.cuda_layout = heads, causal, cuda_layout
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def body(self, h):
        t, d = h.shape
        b, s = t // SEQ, SEQ
        n = self.norm(h)
        qkv = self.qkv(n)
        q, k, v = qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        if self.cuda_layout:
            o = o.transpose(1, 2).contiguous().transpose(1, 2)
        a = o.transpose(1, 2).reshape(t, d)
        cpu_offload.mark_activation_offload(h, n, q, k, v, o, a)
        return h + self.proj(a), a


class Conv1dNorm(FuzzLayer):
    """Conv1d over the sequence, GroupNorm, SiLU, residual."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)

    def body(self, h):
        t, d = h.shape
        c = h.view(t // SEQ, SEQ, d).transpose(1, 2)
        y = self.conv(c)
        z = self.norm(y)
        a = F.silu(z)
        cpu_offload.mark_activation_offload(c, y, z, a)
        return h + a.transpose(1, 2).reshape(t, d), y


class Conv2dNorm(FuzzLayer):
    """Each token as a (width/4, 2, 2) image: Conv2d, BatchNorm2d, ReLU, residual."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.conv = nn.Conv2d(width // 4, width // 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(width // 4)

    def body(self, h):
        t, d = h.shape
        img = h.view(t, d // 4, 2, 2)
        y = self.conv(img)
        z = torch.relu(self.norm(y))
        cpu_offload.mark_activation_offload(img, y, z)
        return h + z.reshape(t, d), z.flatten(1)


class RnnCell(FuzzLayer):
    """A GRU (or tanh RNN) cell run over the sequence, residual."""

    def __init__(self, width, gru=True, out="tensor"):
        super().__init__(out)
        self.cell = nn.GRUCell(width, width) if gru else nn.RNNCell(width, width)

    def body(self, h):
        t, d = h.shape
        x = h.view(t // SEQ, SEQ, d)
        state = x.new_zeros(t // SEQ, d)
        outs = []
        for i in range(SEQ):
            state = self.cell(x[:, i], state)
            cpu_offload.mark_activation_offload(state)
            outs.append(state)
        y = torch.stack(outs, 1).reshape(t, d)
        return h + y, state


class _TanhMatmul(torch.autograd.Function):
    """y = tanh(x @ w), saving x, w and y with ``ctx.save_for_backward``."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gy = g * (1 - y * y)
        return gy @ w.t(), x.t() @ gy


class CustomFunction(FuzzLayer):
    """A custom ``autograd.Function`` that saves its input (a slice, so a view), its weight and its
    output."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.w = nn.Parameter(torch.randn(width, width) * 0.3)

    def body(self, h):
        x = h[:, : h.shape[1]]  # a view of the input
        y = _TanhMatmul.apply(x, self.w)
        cpu_offload.mark_activation_offload(x, y)
        return h + y, y


class InPlace(FuzzLayer):
    """``relu_`` on a Linear output that is saved three times afterwards, and ``mul_``/``add_``
    on a sibling that nothing saves."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.lin = nn.Linear(width, width)

    def body(self, h):
        a = self.lin(h).relu_()
        t = a * a
        b = a + 1
        b.mul_(0.5)
        b.add_(h)
        cpu_offload.mark_activation_offload(a, t, b)
        return t + b, b


class InPlaceAfterRecipe(FuzzLayer):
    """A norm output feeds a tanh whose output is saved, then is changed in place (legal: the
    norm output itself is not saved). ``module_act``: the tanh is an ``nn.Tanh`` module."""

    def __init__(self, width, module_act=False, out="tensor"):
        super().__init__(out)
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.Tanh() if module_act else torch.tanh

    def body(self, h):
        a = self.norm(self.lin(h))
        t = self.act(a)
        a.mul_(0.5)
        cpu_offload.mark_activation_offload(t)
        return t * 3 + a + h, t


class Views(FuzzLayer):
    """Saved tensors that share storage: two halves of one Linear output, an ``expand`` of the
    input, strided slices; the hidden state and the aux output are two views of one base."""

    def __init__(self, width, out="tensor"):
        super().__init__(out)
        self.lin = nn.Linear(width, 2 * width)

    def body(self, h):
        d = h.shape[1]
        y = self.lin(h)
        a, b = y.split(d, dim=-1)
        p = a * torch.sigmoid(b)
        e = h[:, :1].expand(-1, d)
        q = p * e
        z = torch.tanh(y[:, 1::2]) * y[:, ::2]
        cpu_offload.mark_activation_offload(y, a, b, p, e, z)
        both = torch.stack([h + q, z])
        hidden, aux = both.unbind(0)
        return hidden, aux


class OddParams(FuzzLayer):
    """The parameters optimizers must handle besides matrices and vectors: a 0-dim gain, a
    zero-size parameter (used in forward, so its gradient is a zero-size tensor, or not:
    ``use_empty=False``, no gradient) and a frozen one (``requires_grad=False``), around a
    Linear and tanh, residual."""

    def __init__(self, width, use_empty=True, out="tensor"):
        super().__init__(out)
        self.lin = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Parameter(torch.zeros(0, width))
        self.frozen = nn.Parameter(torch.linspace(-0.1, 0.1, width), requires_grad=False)
        self.use_empty = use_empty

    def body(self, h):
        f = self.lin(h) * self.gain + self.frozen
        t = torch.tanh(f)
        cpu_offload.mark_activation_offload(f, t)
        y = h + t
        if self.use_empty:
            y = y + self.empty.sum(0)  # zeros(width); the gradient of ``empty`` has size 0
        return y, f


LAYER_CLASSES = {
    "mlp": Mlp,
    "attention": Attention,
    "conv1d": Conv1dNorm,
    "conv2d": Conv2dNorm,
    "rnn": RnnCell,
    "custom_function": CustomFunction,
    "inplace": InPlace,
    "inplace_after_recipe": InPlaceAfterRecipe,
    "views": Views,
    "odd_params": OddParams,  # drawn on its own (spec.generate), not among the kinds above
}
