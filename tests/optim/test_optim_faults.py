"""HybridDeviceOptimizer after a backward that raised: nothing it queued may outlive what it
reads (the simulated device raises ``SimulatedHazard`` on a buffer freed under a queued copy)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_offload import SimulatedDevice
from cpu_offload.optim import HybridDeviceOptimizer


class Boom(RuntimeError):
    pass


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; raises when backward reaches it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("backward raised")


@pytest.mark.parametrize("overlap", ["backward_copies", "backward_update"])
def test_zero_grad_after_a_backward_that_raised_waits_for_the_queued_gradient_copies(overlap):
    # One bucket larger than the model: it never closes, so the copies queued for the gradients
    # that landed before the error have no per-bucket event; zero_grad() frees those gradients.
    torch.manual_seed(0)
    sim = SimulatedDevice()
    first, rest = nn.Linear(8, 16), nn.Sequential(nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 8))
    params = [*first.parameters(), *rest.parameters()]
    opt = HybridDeviceOptimizer(params, offload_fraction=0.75, overlap=overlap,
                                bucket_bytes=64 << 20, lr=1e-2, device=sim)
    x = torch.randn(4, 8)
    loss = rest(RaiseInBackward.apply(first(x))).square().sum()
    with pytest.raises(Boom):
        loss.backward()
    opt.zero_grad()  # before the fix: SimulatedHazard (a gradient freed under its queued copy)
    del loss
    sim.synchronize()
    # The optimizer still works, and equals the wrapped class from here on.
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    for ps, o in ((params, opt), (ref_params, ref)):
        w1, b1, w2, b2, w3, b3 = ps
        h = torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2
        (h @ w3.T + b3).square().sum().backward()
        o.step()
        o.zero_grad()
    sim.synchronize()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    opt.close()
