"""What a step did (statistics, log line, "did nothing" warnings), verify mode, and the host
memory budget, on the simulated device where every byte can be counted exactly."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from cpu_offload import (
    OffloadUsageError,
    SimulatedDevice,
    get_cpu_offload_context,
)
from cpu_offload.core.errors import OffloadVerifyError

from _support import gpt_cuda

D, ROWS = 8, 4
NBYTES = D * ROWS * 4  # every saved storage below: (4, 8) float32


class Sep(nn.Module):
    """Saves its input (Linear) and its exp output; returns a fresh tensor (``* 1.0``)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.exp(self.lin(x) * 0.1) * 1.0


def forward(layers, ctx, sync, keep=None):
    """``(x, h)``: the input and the output of one forward through ``layers``."""
    x = torch.randn(ROWS, D, requires_grad=True)
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
        if keep is not None:
            keep.append(h)
    return x, h


def step(layers, ctx, sync, keep=None):
    x, h = forward(layers, ctx, sync, keep)
    h.sum().backward()
    return x


def reference_grads(layers, seed):
    """The input's and every parameter's gradient without offloading (input drawn from seed)."""
    torch.manual_seed(seed)
    x = step(layers, *get_cpu_offload_context(enabled=False))
    grads = [x.grad] + [p.grad.clone() for p in layers.parameters()]
    for p in layers.parameters():
        p.grad = None
    return grads


def assert_grads(x, layers, ref):
    got = [x.grad] + [p.grad for p in layers.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def no_nothing_freed_warning(record):
    return not [w for w in record if "freed no GPU memory" in str(w.message)]


def test_step_statistics_count_every_byte(sim):
    layers = nn.ModuleList([Sep(i) for i in range(5)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=5, min_tensor_size_to_offload=0, device=sim
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step(layers, ctx, sync)
    assert no_nothing_freed_warning(record)
    d = ctx.stats().to_dict()
    assert sorted(d["layers"]) == [0, 1, 2]
    for i in range(3):
        layer = d["layers"][i]
        assert layer["offloaded_tensors"] == 2 and layer["copied_out_bytes"] == 2 * NBYTES
        # Layer 0's input is the caller's x: copied, but it stays alive, so it is not reloaded.
        held = NBYTES if i == 0 else 0
        assert layer["held_elsewhere_bytes"] == held
        assert layer["freed_bytes"] == 2 * NBYTES - held
        assert layer["reloaded_bytes"] == 2 * NBYTES - held
    assert d["copied_out_bytes"] == sum(c[2] for c in sim.copies("d2h"))
    assert d["reloaded_bytes"] == sum(c[2] for c in sim.copies("h2d"))
    assert d["pinned_host_bytes_in_use"] == 0  # the graph is gone: every buffer is back
    # Every host copy is held from its forward to its backward: all of them at once at the peak.
    assert d["pinned_host_bytes_peak"] == d["copied_out_bytes"]
    assert d["waits_pending"] == 0 and d["compute_wait_ms"] == 0.0
    text = ctx.stats().summary()
    assert "offloaded 6 saved tensors in 3 layers" in text and "layer 2:" in text
    assert f"pinned host memory: peak {6 * NBYTES / 1024:.1f} KiB, in use now 0.0 KiB" in text


def test_a_layers_host_copies_share_one_pinned_buffer_given_back_with_the_last(sim):
    """The storages a layer copies at its end go into slices of one pinned buffer (one pool
    call per layer): it is in use until the last of them is dropped, then back in the pool,
    reused by the next step."""
    seen = []

    class Probe(Sep):
        def forward(self, x):
            y = self.lin(x)  # saves x (addmm)
            if y.requires_grad:  # runs after exp's backward, before addmm's
                y.register_hook(lambda g: seen.append(pool.in_use_bytes))
            return torch.exp(y * 0.1) * 1.0  # saves exp's output

    layers = nn.ModuleList([Probe(0), Sep(1), Sep(2)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=0, device=sim
    )
    pool = ctx.synchronizer.rt.pool
    ref = reference_grads(layers, 0)
    seen.clear()
    for _ in range(2):
        torch.manual_seed(0)
        assert_grads(step(layers, ctx, sync), layers, ref)
        for p in layers.parameters():
            p.grad = None
        assert pool.in_use_bytes == 0
    assert sim.host_allocs == 1 and sim.host_bytes_allocated == 2 * NBYTES
    # exp's saved output was dropped by then, x's was not: the buffer stayed in use whole.
    assert seen == [2 * NBYTES, 2 * NBYTES]


def test_the_summary_names_the_device_in_use(sim):
    """A summary on the simulated device speaks of its memory, not of a GPU there is none of."""
    layers = nn.ModuleList([Sep(i) for i in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=D * ROWS + 1,
        device=sim,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing is large enough to offload: it says so
        step(layers, ctx, sync)
    text = ctx.stats().summary()
    assert "of simulated device memory" in text and "kept on the simulated device: " in text
    assert "GPU" not in text


def test_one_log_line_per_step(sim, caplog):
    layers = nn.ModuleList([Sep(i) for i in range(4)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=4, min_tensor_size_to_offload=0, device=sim
    )
    with caplog.at_level(logging.INFO, logger="cpu_offload"):
        for _ in range(3):
            step(layers, ctx, sync)
    lines = [r.getMessage() for r in caplog.records if r.name == "cpu_offload"]
    assert len(lines) == 2  # a step is logged when the next one starts (its copies are done)
    assert all(line.startswith("offload step: 4 tensors") for line in lines)


def test_warns_once_when_everything_is_below_the_threshold(sim):
    layers = nn.ModuleList([Sep(i) for i in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=D * ROWS + 1,
        device=sim,
    )
    with pytest.warns(UserWarning, match=r"freed no GPU memory.*min_tensor_size_to_offload=33"):
        step(layers, ctx, sync)
    assert ctx.stats().to_dict()["skipped_bytes"] == {"too small": 2 * NBYTES, "parameter": D * D * 4}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step(layers, ctx, sync)
    assert no_nothing_freed_warning(record)  # once per context


def test_warns_when_copies_free_nothing_because_the_caller_holds_them(sim):
    layers = nn.ModuleList([Sep(i) for i in range(4)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=4, min_tensor_size_to_offload=0, device=sim
    )
    keep = []
    layers[0].register_forward_hook(lambda m, a, out: keep.extend(a))  # holds layer 0's input

    class Keep(nn.Module):  # and its exp output
        def forward(self, x):
            e = torch.exp(x)
            keep.append(e)
            return e * 1.0

    layers[0] = Keep()
    with pytest.warns(UserWarning, match="held elsewhere"):
        step(layers, ctx, sync)
    assert ctx.stats().to_dict()["freed_bytes"] == 0


def test_v1_warns_once_when_no_tensor_is_tagged(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    layers = nn.ModuleList([Sep(i) for i in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, device=SimulatedDevice()
    )
    with pytest.warns(UserWarning, match="mark_activation_offload"):
        step(layers, ctx, sync)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step(layers, ctx, sync)
    assert not [w for w in record if "none is tagged" in str(w.message)]


# --- verify mode ---------------------------------------------------------------------------------


def racy(sim, monkeypatch):
    """Make unpack skip the wait for its reload (an injected stream race)."""
    wait = sim.wait_event

    def skip_reload_waits(stream, event):
        if stream is sim.compute and event.stream is not sim.compute and sim.in_backward:
            return
        wait(stream, event)

    sim.in_backward = False
    monkeypatch.setattr(sim, "wait_event", skip_reload_waits)


@pytest.mark.parametrize("via_env", [False, True])
def test_verify_mode_catches_a_reload_that_skips_its_wait(sim, monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv("CPU_OFFLOAD_VERIFY", "1")
    layers = nn.ModuleList([Sep(i) for i in range(4)])
    kw = {} if via_env else {"verify": True}
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=4, min_tensor_size_to_offload=0, device=sim, **kw
    )
    racy(sim, monkeypatch)
    _, h = forward(layers, ctx, sync)
    sim.in_backward = True
    with pytest.raises(OffloadVerifyError, match=r"saved by layer [01] came back different"):
        h.sum().backward()


def test_verify_mode_passes_on_a_correct_schedule(sim):
    layers = nn.ModuleList([Sep(i) for i in range(4)])
    ref = reference_grads(layers, 5)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=4, min_tensor_size_to_offload=0, device=sim,
        verify=True,
    )
    torch.manual_seed(5)
    assert_grads(step(layers, ctx, sync), layers, ref)


# --- host memory budget ----------------------------------------------------------------------------


def test_max_host_bytes_keeps_the_rest_on_the_gpu_and_warns_once(sim):
    layers = nn.ModuleList([Sep(i) for i in range(5)])
    ref = reference_grads(layers, 3)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=5, min_tensor_size_to_offload=0, device=sim,
        max_host_bytes=3 * NBYTES,
    )
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="max_host_bytes=384"):
        x = step(layers, ctx, sync)
    d = ctx.stats().to_dict()
    assert d["copied_out_bytes"] == 3 * NBYTES
    assert d["skipped_bytes"] == {"over max_host_bytes": 3 * NBYTES, "parameter": 3 * D * D * 4}
    assert_grads(x, layers, ref)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_host_bytes_must_be_a_byte_count(bad):
    from cpu_offload import OffloadConfigError

    with pytest.raises(OffloadConfigError, match="max_host_bytes"):
        get_cpu_offload_context(
            enabled=True, num_layers=1, model_layers=3, device=SimulatedDevice(),
            max_host_bytes=bad,
        )


def test_failed_pinned_allocation_names_the_bytes_and_the_option():
    class NoPinned(SimulatedDevice):
        def alloc_host(self, nbytes):
            raise RuntimeError("cudaHostAlloc failed")

    layers = nn.ModuleList([Sep(i) for i in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=0,
        device=NoPinned(),
    )
    # (the layer's two storages are copied into one pinned buffer, allocated at its end)
    with pytest.raises(OffloadUsageError,
                       match=rf"allocating {2 * NBYTES} bytes of pinned.*max_host_bytes"):
        step(layers, ctx, sync)


def test_untimed_device_reports_the_wait_as_not_timed(monkeypatch):
    sim = SimulatedDevice()
    monkeypatch.setattr(sim, "times_events", False)
    layers = nn.ModuleList([Sep(i) for i in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=0, device=sim
    )
    step(layers, ctx, sync)
    assert ctx.stats().to_dict()["compute_wait_ms"] is None
    assert "not timed (CPU_OFFLOAD_TIME_WAITS=1" in ctx.stats().summary()


# --- on CUDA (marked gpu): the GPT stack of _support/gpt_cuda.py, real streams and kernels ---


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_stats_count_every_byte_and_reading_them_never_blocks_the_next_step(gpt_model, gpt_x0):
    from cpu_offload import CudaDevice

    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=gpt_cuda.CFG.layers,
        device=CudaDevice(time_waits=True),
    )
    gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)  # warm-up: pinned buffers allocated once
    torch.cuda.synchronize()
    gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
    torch.cuda.synchronize()
    d = ctx.stats().to_dict()
    assert sorted(d["layers"]) == [0, 1]
    for i, layer in d["layers"].items():
        held = gpt_x0.nbytes if i == 0 else 0  # the caller's input, copied but not freed
        assert layer["held_elsewhere_bytes"] == held and layer["copied_out_bytes"] > 0
        assert layer["freed_bytes"] == layer["reloaded_bytes"] == layer["copied_out_bytes"] - held
    assert d["pinned_host_bytes_peak"] == d["copied_out_bytes"]
    assert d["pinned_host_bytes_in_use"] == 0 and d["waits_pending"] == 0
    assert d["compute_wait_ms"] is not None and d["compute_wait_ms"] >= 0.0
    # Read the statistics while the next step's work is still queued: nothing may sync the host.
    for p in gpt_model.parameters():
        p.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = gpt_x0.clone().requires_grad_()
        out = gpt_model(x, ctx, sync)
        ctx.stats().summary()
        ctx.stats().to_dict()
        out.float().square().mean().backward()
        ctx.stats().summary()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_verify_mode_is_exact_and_catches_a_corrupted_host_copy(gpt_model, gpt_x0):
    from cpu_offload import OffloadVerifyError

    ref = gpt_cuda.step(gpt_model, gpt_x0)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=gpt_cuda.CFG.layers, verify=True
    )
    for _ in range(2):
        gpt_cuda.assert_bit_identical(gpt_cuda.step(gpt_model, gpt_x0, ctx, sync), ref)
    for p in gpt_model.parameters():
        p.grad = None
    out = gpt_model(gpt_x0.clone().requires_grad_(), ctx, sync)
    torch.cuda.synchronize()  # every copy to the host has landed
    entry = next(e for e in ctx.synchronizer.step.layers[1].entries if e.cpu is not None)
    entry.cpu.bitwise_not_()  # what a racing writer or a reused host buffer would do
    with pytest.raises(OffloadVerifyError, match="saved by layer 1 came back different"):
        out.float().square().mean().backward()
