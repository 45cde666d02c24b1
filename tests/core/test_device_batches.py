"""The device's batched calls (``copy_batch``, ``reload_batch``, ``compute_wait``): one call per
layer and direction for the schedulers, with every copy, wait and allocation in them checked by
the simulation as when made one by one, and the same effects on CUDA."""
from __future__ import annotations

import pytest
import torch

from cpu_offload import CudaDevice, SimulatedDevice
from cpu_offload.core.simulated import POISON, SimulatedHazard


def _pairs(dev, sizes, device=None):
    """(pinned host buffer, device buffer with known bytes) per size."""
    pairs = []
    for i, n in enumerate(sizes):
        src = torch.arange(n, dtype=torch.int64).add_(7 * i).to(torch.uint8)
        if device is not None:
            src = src.to(device)
        pairs.append((dev.alloc_host(n), src))
    return pairs


def test_copy_batch_queues_after_compute_and_returns_the_event_that_ends_it():
    sim = SimulatedDevice()  # side streams deferred: nothing runs until waited for
    side = sim.new_stream()
    pairs = _pairs(sim, [16, 40, 8])
    event = sim.copy_batch(side, pairs, milestone=("offload", 3))
    assert [e[0] for e in sim.log[-5:]] == ["wait", "copy", "copy", "copy", "offload"]
    assert sim.pending_ops() == 4  # the stream wait and three copies, none run yet
    assert not sim.event_done(event)
    waits: list = []
    sim.compute_wait(event, waits, ("release", 3))
    assert sim.event_done(event) and sim.pending_ops() == 0
    assert all(torch.equal(dst, src) for dst, src in pairs)
    assert len(waits) == 1 and waits[0][1] is event  # timed: (compute reached it, awaited)
    assert sim.log[-1] == ("release", 3)
    # Nothing to copy: no stream wait, only the event (a layer whose storages an earlier
    # layer copied).
    before = len(sim.log)
    assert sim.event_done(sim.copy_batch(side, []))
    assert sim.log[before:] == []


def test_reload_batch_allocates_before_copying_and_compute_must_wait():
    sim = SimulatedDevice()
    side = sim.new_stream()
    hosts = [(torch.full((n,), i + 1, dtype=torch.uint8), torch.device("cpu"))
             for i, n in enumerate([24, 64])]
    for buf, _ in hosts:
        sim._host_bufs[buf.data_ptr()] = buf  # as alloc_host registers its buffers
    buffers, event = sim.reload_batch(side, hosts, milestone=("reload", 0))
    assert sim.device_allocs == 2 and [b.numel() for b in buffers] == [24, 64]
    assert all(bool((b == POISON).all()) for b in buffers)  # not copied yet
    with pytest.raises(SimulatedHazard, match="still writes"):
        sim.will_read(buffers[0])
    sim.compute_wait(event)
    assert [torch.equal(b, h) for b, (h, _) in zip(buffers, hosts)] == [True, True]
    sim.will_read(buffers[1])


@pytest.mark.gpu
def test_cuda_batches_copy_reload_and_reuse_the_layer_event():
    dev = CudaDevice(time_waits=False)  # (timed events are one per record, never reused)
    side = dev.new_stream()
    pairs = _pairs(dev, [4096, 1 << 20, 12], device="cuda")
    event = dev.copy_batch(side, pairs)
    again = dev.copy_batch(side, [], event)  # re-recorded, not a new event
    assert again is event
    dev.compute_wait(event)
    torch.cuda.synchronize()
    assert all(torch.equal(dst, src.cpu()) for dst, src in pairs)
    buffers, back = dev.reload_batch(side, [(dst, torch.device("cuda")) for dst, _ in pairs])
    dev.compute_wait(back)
    assert all(b.is_cuda and torch.equal(b, src) for b, (_, src) in zip(buffers, pairs))


def test_a_batch_may_name_device_storages_and_holds_neither_buffer():
    """``copy_after_compute`` (and the batches built on it) take a device storage as a source,
    as V2's copies out do, and hold it only weakly, as the driver does not hold it: a storage
    freed before its copy ran leaves garbage in the host buffer. Its pinned host buffers must
    stay referenced until the copies are done."""
    sim = SimulatedDevice()
    side = sim.new_stream()
    kept = torch.arange(32, dtype=torch.uint8)
    dropped = torch.arange(16, dtype=torch.uint8).add_(100)
    dst = [sim.alloc_host(32), sim.alloc_host(16)]
    sim.copy_after_compute(side, [(dst[0], kept.untyped_storage()),
                                  (dst[1], dropped.untyped_storage())])
    del dropped
    sim.synchronize()
    assert torch.equal(dst[0], kept)
    assert bool((dst[1] == POISON).all())

    host = sim.alloc_host(8).fill_(3)
    buffers, event = sim.reload_batch(side, [(host, torch.device("cpu"))])
    del host  # the only reference to the pinned source
    with pytest.raises(SimulatedHazard, match="pinned host buffer that was let go"):
        sim.compute_wait(event)


def test_a_single_copy_tells_the_pinned_allocator():
    """``copy`` goes through torch, whose pinned allocator keeps a block until its copies are
    done: dropping the host buffer early is safe there."""
    sim = SimulatedDevice()
    side = sim.new_stream()
    host = sim.alloc_host(8).fill_(3)
    dev = sim.alloc_device(8, torch.device("cpu"))
    sim.wait_stream(side, sim.current_stream())  # the fresh buffer: after compute got there
    sim.copy(side, dev, host)
    del host
    sim.synchronize()
    assert bool((dev == 3).all())


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["driver", "driver refuses", "torch"])
def test_cuda_copy_batches_from_storages(monkeypatch, path):
    """V2's copies out name the saved storages; on CUDA they go through the driver, or through
    torch where it is unavailable or refuses a copy (then that copy and the rest)."""
    from cpu_offload.core import device as device_module
    from cpu_offload.core.driver import driver_copy_async

    if path == "torch":
        monkeypatch.setattr(device_module, "driver_copy_async", lambda: None)
    elif path == "driver refuses":
        real, calls = driver_copy_async(), []

        def refuse_the_second(*args):
            calls.append(args)
            return 1 if len(calls) == 2 else real(*args)

        monkeypatch.setattr(device_module, "driver_copy_async", lambda: refuse_the_second)
    elif driver_copy_async() is None:
        pytest.skip("no CUDA driver library to call")
    dev = CudaDevice(time_waits=False)
    side = dev.new_stream()
    sources = [torch.randn(n, device="cuda") for n in (1, 1000, 1 << 18)]
    hosts = [dev.alloc_host(t.nbytes) for t in sources]
    event = dev.copy_batch(side, [(h, t.untyped_storage()) for h, t in zip(hosts, sources)])
    dev.compute_wait(event)
    buffers, back = dev.reload_batch(side, [(h, torch.device("cuda")) for h in hosts])
    dev.compute_wait(back)
    torch.cuda.synchronize()
    for t, h, b in zip(sources, hosts, buffers):
        assert torch.equal(h.view(torch.float32), t.cpu())
        assert torch.equal(b.view(torch.float32), t)
