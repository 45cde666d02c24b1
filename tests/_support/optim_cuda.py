"""HybridDeviceOptimizer on CUDA for its ``gpu``-marked tests: a small bf16 GPT stack, the
optimizer with small buckets and chunks, and the same fused AdamW run on the CPU to compare
with."""
from __future__ import annotations

import torch

from cpu_offload.core.device import CudaDevice
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input
from cpu_offload.optim import HybridDeviceOptimizer

CFG = GPTConfig(hidden=256, heads=4, seq=128, batch=2, layers=4, dtype=torch.bfloat16)
KW = dict(lr=1e-3, weight_decay=0.1)
BUCKET = 256 * 1024
CHUNK = 64 * 1024  # fp32 bytes: the larger matrices are updated in split pieces
# Device part vs the same AdamW on the CPU (fp32 masters, then cast to bf16): CPU and CUDA fused
# kernels round differently, so a bf16 parameter may differ by one bf16 ulp (2**-7 relative).
GPU_PART_RTOL = 2 ** -7


class CountingCuda(CudaDevice):
    def __init__(self) -> None:
        super().__init__()
        self.host_allocs = 0

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        self.host_allocs += 1
        return super().alloc_host(nbytes)


def model():
    return build_model(CFG, device="cuda", seed=0)


def loss_of(m, i):
    return m(make_input(CFG, "cuda", seed=100 + i, requires_grad=False)).float().square().mean()


def hybrid(m, fraction, overlap, **kw):
    # the CPU path (compared with the CPU class): nothing streamed unless asked
    opt = HybridDeviceOptimizer(m.parameters(), fraction, overlap=overlap, bucket_bytes=BUCKET,
                                cpu_chunk_bytes=CHUNK, **{**KW, "stream_fraction": 0, **kw})
    if overlap == "next_forward":
        opt.register_forward_waits(m)
    return opt


class CpuReference:
    """The same fused AdamW run on the CPU over fp32 masters, fed the GPU's gradients."""

    def __init__(self, m):
        self.masters = [p.detach().float().cpu() for p in m.parameters()]
        self.opt = torch.optim.AdamW(self.masters, fused=True, **KW)

    def step(self, grads):
        for mp, g in zip(self.masters, grads):
            mp.grad = g.float().cpu()
        self.opt.step()
        return [mp.to(torch.bfloat16) for mp in self.masters]


def train(m, opt, steps, ref=None):
    """``steps`` steps; with ``ref`` returns (params, reference params) after each step."""
    out = []
    for i in range(steps):
        loss_of(m, i).backward()
        grads = [p.grad.clone() for p in m.parameters()] if ref else None
        opt.step()
        opt.zero_grad()
        if ref:
            expected = ref.step(grads)
            opt.wait_params()
            out.append(([p.detach().to("cpu", copy=True) for p in m.parameters()], expected))
    opt.wait_params()
    return out
