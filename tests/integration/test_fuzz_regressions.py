"""Regressions the differential fuzzer (tests/fuzz) found after issue 27's fixes, as plain tests.

1. A plan's ``recompute`` layer inside a user's non-reentrant checkpoint region (around the layer,
   or around the whole stack). ``apply_offloading`` ran such a layer under its own checkpoint in
   forward but not in the region's recomputation (a call in backward runs untouched), so the
   region's forward and its recomputation saved different tensors: ``CheckpointError``
   ("Recomputed values ... different metadata"). Fuzz seeds 84 234 260 499 517 572 ...
2. A user's non-reentrant checkpoint around one offloaded or selective layer (findings N2): the
   offload hooks used to shadow the checkpoint's, so the layer was never recomputed (BatchNorm
   statistics differed from the run without offloading). Fixed on main by issue 27's D1 fix;
   kept here as a regression test with BatchNorm, which the D1 tests do not use.
3. Hygiene (fuzz seeds 301 821): a selective layer whose recorded op inputs are changed in
   place (a GRU cell does that) kept its activations alive for good after a backward that
   raised, or when its graph was dropped without a backward: a recipe held such an input with
   its autograd history, which closed a reference cycle through the graph.
4. ``HybridDeviceOptimizer(overlap="backward_copies")``, ``zero_grad()`` after a backward that
   raised (findings N4, fuzz seeds 2181 7087 7925): gradients whose copies were queued into a
   bucket that never closed were freed with the copies still queued (``SimulatedHazard``).

Every program is compared bit for bit (``torch.equal``) with the same program without
offloading.
"""
from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cpu_offload
from cpu_offload import SimulatedDevice, apply_offloading
from cpu_offload.compat import top_saved_tensors_hooks
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload import Plan

D = 16  # width


class Block(nn.Module):
    """Linear over pairs of tokens, BatchNorm (running statistics: they show whether a layer was
    recomputed), GELU, residual. ``mark_activation_offload`` tags for V1. The first tensor it
    saves (the linear's input) has another shape than its input: a checkpoint region that pairs
    saved tensors wrongly cannot pass unnoticed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * D, 2 * D)
        self.norm = nn.BatchNorm1d(D)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.reshape(-1, 2 * D)).reshape(x.shape)
        cpu_offload.mark_activation_offload(h)
        return self.act(self.norm(h)) + x


def make_layers(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(n))


def run_step(layers: nn.ModuleList, x0: torch.Tensor, around: str, wrapped=()) -> tuple:
    """One forward and backward. ``around``: ``"stack"`` puts one non-reentrant checkpoint
    around every layer, ``"layer"`` one around each layer in ``wrapped``. Returns the output,
    the input's gradient, every parameter's gradient and every buffer (BatchNorm statistics)."""
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()

    def stack(t: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(layers):
            if around == "layer" and i in wrapped:
                t = checkpoint(layer, t, use_reentrant=False)
            else:
                t = layer(t)
        return t

    out = checkpoint(stack, x, use_reentrant=False) if around == "stack" else stack(x)
    out.square().mean().backward()
    return (
        out.detach(), x.grad,
        [p.grad.clone() for p in layers.parameters()],
        [b.clone() for b in layers.buffers()],
    )


def assert_exact(got: tuple, ref: tuple) -> None:
    assert torch.equal(got[0], ref[0]), "outputs differ"
    assert torch.equal(got[1], ref[1]), "input gradients differ"
    bad = [i for i, (a, b) in enumerate(zip(got[2], ref[2])) if not torch.equal(a, b)]
    assert not bad, f"parameter gradients {bad} differ"
    bad = [i for i, (a, b) in enumerate(zip(got[3], ref[3])) if not torch.equal(a, b)]
    assert not bad, f"buffers {bad} (BatchNorm statistics) differ"


def assert_nothing_left(handle) -> None:
    assert top_saved_tensors_hooks() is None
    assert not cpu_offload.is_cpu_offload_enabled()
    sync = handle.synchronizer
    if sync is not None:
        assert sync.held_device_bytes() == 0 and sync.held_host_bytes() == 0


# --- 1. a plan's recompute layers inside a user's checkpoint region --------------------------

PLANS = {
    # kept layers recomputed; layer 0 offloaded (V1 and V2)
    "recompute_kept": dict(num_layers=1, recompute=(1, 2)),
    # offloaded layers recomputed too (their checkpoint input would move: V2 only)
    "recompute_offloaded": dict(num_layers=2, recompute=(0, 1)),
    # nothing offloaded, only recomputed
    "recompute_only": dict(num_layers=0, recompute=(0, 2)),
}


@pytest.mark.parametrize("around", ["layer", "stack"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_plan_recompute_layers_inside_a_user_checkpoint_are_exact(backend, plan_name, around):
    if backend == "v1" and plan_name == "recompute_offloaded":
        pytest.skip("V1 refuses plans that checkpoint offloaded layers")
    fields = PLANS[plan_name]
    layers, x0 = make_layers(), torch.randn(8, D, generator=torch.Generator().manual_seed(1))
    wrapped = fields["recompute"]  # "layer": the user checkpoints the layers the plan recomputes
    start = {k: v.clone() for k, v in layers.state_dict().items()}
    refs = [run_step(layers, x0, around, wrapped) for _ in range(2)]
    layers.load_state_dict(start)
    plan = Plan(model_layers=3, min_tensor_size_to_offload=0 if backend == "v2" else None,
                **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "freed no GPU memory": all in a region
        handle = apply_offloading(layers, plan=plan, device=SimulatedDevice())
        for ref in refs:  # twice: the second step reuses the context
            assert_exact(run_step(layers, x0, around, wrapped), ref)
            assert_nothing_left(handle)
    handle.remove()


def test_plan_recompute_layer_outside_a_user_checkpoint_still_checkpoints(sim):
    """Stepping aside only inside a region: elsewhere the plan's layers run checkpointed (their
    BatchNorm statistics are updated twice, by forward and by the recomputation, as torch's
    checkpoint does), and gradients stay exact."""
    layers, x0 = make_layers(), torch.randn(8, D)
    ref = run_step(layers, x0, "none")
    layers2 = make_layers()
    handle = apply_offloading(layers2, plan=Plan(num_layers=0, recompute=(1,), model_layers=3),
                              device=sim)
    got = run_step(layers2, x0, "none")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    tracked = [name for name, _ in layers.named_buffers()].index("1.norm.num_batches_tracked")
    assert got[3][tracked].item() == 2 and ref[3][tracked].item() == 1
    handle.remove()


# --- 2. a user's checkpoint around one offloaded or selective layer --------------------------


@pytest.mark.parametrize("what", ["offloaded", "selective"])
def test_user_checkpoint_around_one_layer_recomputes_it(backend, what, sim):
    """The checkpoint recomputes the layer in backward (BatchNorm statistics updated twice, as
    without offloading); offloading and selective recomputation step aside inside it."""
    if backend == "v1" and what == "selective":
        pytest.skip("selective recomputation is V2 only")
    layers, x0 = make_layers(), torch.randn(8, D)
    start = {k: v.clone() for k, v in layers.state_dict().items()}
    refs = [run_step(layers, x0, "layer", wrapped=(0,)) for _ in range(2)]
    layers.load_state_dict(start)
    kwargs = dict(num_layers=1) if what == "offloaded" else dict(num_layers=0, selective=(0,))
    if backend == "v2":
        kwargs["min_tensor_size_to_offload"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = apply_offloading(layers, device=sim, **kwargs)
        for ref in refs:
            assert_exact(run_step(layers, x0, "layer", wrapped=(0,)), ref)
            assert_nothing_left(handle)
    assert not sim.copies("d2h")  # the checkpointed layer keeps nothing to offload
    handle.remove()


# --- 3. nothing held after a backward that raised, or a graph dropped ------------------------


class GruLayer(nn.Module):
    """A GRU cell over a short sequence, residual: the cell's ops change tensors in place that
    its cheap ops (recipes) read, as ``torch.nn.GRUCell`` does on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.view(2, 4, D)
        state = x.new_zeros(2, D)
        outs = []
        for i in range(4):
            state = self.cell(x[:, i], state)
            outs.append(state)
        return h + torch.stack(outs, 1).reshape(8, D)


class InplaceAfterTanh(nn.Module):
    """``t = tanh(a)`` saves ``t`` as a recipe on the tiny ``a``, which then changes in place
    (legal: nothing saved ``a``) to a value that depends on ``t``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.lin(h)
        t = torch.tanh(a)
        a.add_(t)
        return h + a * 2


class Boom(RuntimeError):
    pass


def _boom(grad: torch.Tensor) -> None:
    raise Boom("a gradient hook raised in backward")


@pytest.mark.parametrize("layer_cls", [GruLayer, InplaceAfterTanh])
@pytest.mark.parametrize("how", ["backward_raises", "graph_dropped"])
def test_selective_layer_holds_nothing_after_a_failed_or_missing_backward(layer_cls, how, sim):
    torch.manual_seed(0)
    layers = nn.ModuleList([layer_cls(), Block(), Block()])
    handle = apply_offloading(layers, num_layers=1, selective=(0,), selective_scope="layer",
                              min_tensor_size_to_offload=0, device=sim)
    outputs: list = []
    hooks = [m.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
             for m in layers.modules()]

    def attempt() -> None:
        x = torch.randn(8, D, requires_grad=True)
        h = layers[2](layers[1](layers[0](x)))
        if how == "backward_raises":
            h.register_hook(_boom)
            with pytest.raises(Boom):
                h.square().mean().backward()
        # graph_dropped: the forward's graph goes when this returns, without a backward

    run_step(layers, torch.randn(8, D), "none")  # first calls import lazily: frames in cycles
    outputs.clear()
    gc.disable()  # only reference counting: a cycle would keep them alive (exact count)
    try:
        attempt()
        alive = sum(r() is not None for r in outputs)
    finally:
        gc.enable()
        for hook in hooks:
            hook.remove()
    assert alive == 0, f"{alive} of {len(outputs)} activations are still alive"
    # and the next step is exact
    layers_ref = nn.ModuleList([layer_cls(), Block(), Block()])
    layers_ref.load_state_dict({k: v for k, v in layers.state_dict().items()})
    x0 = torch.randn(8, D)
    got, ref = run_step(layers, x0, "none"), run_step(layers_ref, x0, "none")
    assert_exact(got, ref)
    assert_nothing_left(handle)
    handle.remove()


# --- 4. the hybrid optimizer after a backward that raised ----------------------------------


def _steps_after_a_failed_backward(fraction: float, device, where: str = "cpu") -> None:
    """The second linear's gradients are copied (queued) as backward produces them; the hook on
    the first linear's output raises before that bucket is complete. ``zero_grad()`` frees the
    gradients only after their queued copies, and the next steps equal torch's AdamW (on CUDA,
    where the CPU part's AdamW is not the GPU's to the bit: the same hybrid optimizer that never
    saw the failed backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)).to(where)
    ref = copy.deepcopy(model)
    opt = HybridDeviceOptimizer(model.parameters(), fraction, overlap="backward_copies",
                                bucket_bytes=1 << 20, lr=0.01, device=device)
    if where == "cuda":
        ref_opt = HybridDeviceOptimizer(ref.parameters(), fraction, overlap="backward_copies",
                                        bucket_bytes=1 << 20, lr=0.01, device=device)
    else:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    h = model[0](torch.randn(8, D, device=where))
    h.register_hook(_boom)
    with pytest.raises(Boom):
        model[2](model[1](h)).square().mean().backward()
    opt.zero_grad()
    for i in range(2):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(i)).to(where)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    opt.wait_params()
    bad = [n for (n, a), b in zip(model.named_parameters(), ref.parameters())
           if not torch.equal(a, b)]
    assert not bad, f"parameters {bad} differ from the reference optimizer's"
    opt.close()
    if where == "cuda":
        ref_opt.close()


@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_hybrid_optimizer_zero_grad_after_a_backward_that_raised(fraction, sim):
    _steps_after_a_failed_backward(fraction, sim)
    assert sim.pending_ops() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_hybrid_optimizer_zero_grad_after_a_backward_that_raised_on_cuda(fraction, deterministic):
    _steps_after_a_failed_backward(fraction, None, "cuda")
    torch.cuda.synchronize()
