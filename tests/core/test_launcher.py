"""Launchers (host work queued from backward's hooks, ``core.launcher``) and the simulation's
rule for memory handed out on the compute stream.

Launchers: work runs once, in submission order; ``join`` waits for it and raises the first
error (the work queued behind that error is dropped, and the launcher works again after);
``cancel`` drops what has not started; the thread of a ``ThreadLauncher`` runs each work with
its stream current and stops on ``close`` or when the launcher is collected. Which launcher
each device gives. Fresh device buffers: a side stream that writes one must first wait for a
compute event recorded after its allocation. Another stream current (``use_stream``): deferred
work runs with it, memory allocated then is its own, and what work queued there writes
compute reads only once ordered after it."""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from cpu_offload import CudaDevice, SimulatedDevice
from cpu_offload.core.launcher import DeferredLauncher, InlineLauncher, ThreadLauncher
from cpu_offload.core.simulated import SimulatedHazard

LAUNCHERS = {"thread": ThreadLauncher, "deferred": DeferredLauncher}


def fail():
    raise ValueError("work failed")


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_work_runs_once_in_order_and_join_waits_for_it(kind):
    launcher, ran = LAUNCHERS[kind](), []
    for i in range(50):
        launcher.submit(lambda i=i: ran.append(i))
    launcher.join()
    assert ran == list(range(50))
    launcher.join()  # nothing more
    assert ran == list(range(50))
    launcher.close()


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_an_error_is_raised_by_join_and_drops_the_work_behind_it(kind):
    launcher, ran = LAUNCHERS[kind](), []
    launcher.submit(lambda: ran.append(1))
    launcher.submit(fail)
    launcher.submit(lambda: ran.append(3))
    with pytest.raises(ValueError, match="work failed"):
        launcher.join()
    assert ran == [1]
    launcher.submit(lambda: ran.append(4))  # usable again
    launcher.join()
    assert ran == [1, 4]
    launcher.close()


def test_thread_work_runs_off_the_submitting_thread_with_its_stream_current():
    current, seen = [], []
    launcher = ThreadLauncher(setup=lambda: seen.append("setup"), make_current=current.append)
    launcher.submit(lambda: seen.append((threading.current_thread().name, list(current))), "s1")
    launcher.submit(lambda: seen.append(list(current)))
    launcher.join()
    assert seen == ["setup", ("cpu_offload-launch", ["s1"]), ["s1"]]  # no stream: left as is
    launcher.close()


def test_a_failed_setup_runs_no_work_and_every_join_after_a_submit_raises_it():
    def setup():
        raise RuntimeError("no device")

    launcher, ran = ThreadLauncher(setup=setup), []
    for _ in range(2):  # not only the first time: the thread is still not set up
        launcher.submit(lambda: ran.append(1))
        with pytest.raises(RuntimeError, match="no device"):
            launcher.join()
    assert ran == []
    launcher.close()


def test_cancel_drops_the_work_not_started_and_discards_the_error():
    launcher, ran = ThreadLauncher(), []
    started, release = threading.Event(), threading.Event()

    def blocking():
        started.set()
        release.wait(10)
        raise ValueError("dropped with its work")

    launcher.submit(blocking)
    launcher.submit(lambda: ran.append("never"))
    assert started.wait(10)
    threading.Timer(0.05, release.set).start()
    launcher.cancel()  # waits for the running one
    launcher.join()  # its error went with it
    assert ran == []
    launcher.close()


def test_the_thread_stops_on_close_and_when_the_launcher_is_collected():
    def launch_threads():
        return [t for t in threading.enumerate() if t.name == "cpu_offload-launch"]

    before = len(launch_threads())
    closed = ThreadLauncher()
    closed.submit(lambda: None)
    closed.close()
    with pytest.raises(RuntimeError, match="after close"):
        closed.submit(lambda: None)
    dropped = ThreadLauncher()
    dropped.submit(lambda: None)
    dropped.join()
    del dropped
    gc.collect()
    deadline = time.monotonic() + 10
    while len(launch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(launch_threads()) == before


def test_deferred_work_waits_for_join_and_cancel_drops_it():
    launcher, ran = DeferredLauncher(), []
    launcher.submit(lambda: ran.append(1))
    assert (ran, launcher.pending) == ([], 1)
    launcher.cancel()
    launcher.join()
    assert (ran, launcher.pending) == ([], 0)


def test_each_device_gives_its_launcher():
    where = torch.device("cpu")
    assert isinstance(SimulatedDevice().host_launcher(where), DeferredLauncher)
    assert isinstance(SimulatedDevice(defer_launches=False).host_launcher(where), InlineLauncher)
    cuda = CudaDevice().host_launcher(torch.device("cuda", 0))  # no CUDA call until work runs
    assert isinstance(cuda, ThreadLauncher)
    cuda.close()


# ---------------------------------------------------------------------------------------------
# the simulation: memory handed out on the compute stream


def test_a_side_stream_writing_a_fresh_buffer_waits_for_compute_after_its_allocation():
    sim = SimulatedDevice()
    side, other = sim.new_stream(), sim.new_stream()
    before = sim.record_event(sim.current_stream())  # the hook's event: before the allocation
    buf = sim.alloc_device(8, torch.device("cpu"))
    host = sim.alloc_host(8)
    sim.wait_event(side, before)
    with pytest.raises(SimulatedHazard, match="allocated on the compute stream"):
        sim.copy(side, buf[:4], host[:4])  # a view of it counts
    with pytest.raises(SimulatedHazard, match="allocated on the compute stream"):
        sim.run_on(side, lambda: None, writes=[buf])
    sim.wait_event(other, sim.record_event(sim.current_stream()))  # after the allocation
    sim.copy(other, buf, host)
    sim.wait_event(side, sim.record_event(other))  # ordered after it through ``other``
    sim.copy(side, buf, host)
    sim.copy(sim.current_stream(), buf, host)  # the compute stream itself: in order anyway
    sim.copy(side, host, buf)  # reading it into host memory: not a write of it
    sim.synchronize()


# ---------------------------------------------------------------------------------------------
# the simulation: another stream current (FSDP2's hooks), and reads of what it wrote


def test_deferred_work_runs_with_the_stream_it_was_submitted_with_current():
    sim = SimulatedDevice()
    side = sim.new_stream()
    launcher, seen = sim.host_launcher(torch.device("cpu")), []
    with sim.use_stream(side):
        assert sim.current_stream() is side
        launcher.submit(lambda: seen.append(sim.current_stream()), sim.current_stream())
    launcher.submit(lambda: seen.append(sim.current_stream()))  # no stream: the joiner's
    assert sim.current_stream() is sim.compute
    launcher.join()
    assert seen == [side, sim.compute] and sim.current_stream() is sim.compute


def test_memory_allocated_with_a_side_stream_current_is_that_streams_to_write():
    sim = SimulatedDevice()
    side, other = sim.new_stream(), sim.new_stream()
    with sim.use_stream(side):
        buf = sim.alloc_device(8, torch.device("cpu"))
        ready = sim.record_event(side)
    sim.run_on(side, lambda: None, writes=[buf])  # its own pool: in its order
    with pytest.raises(SimulatedHazard, match="or on the stream current then"):
        sim.run_on(other, lambda: None, writes=[buf])
    sim.wait_event(other, ready)
    sim.run_on(other, lambda: None, writes=[buf])
    sim.synchronize()


@pytest.mark.parametrize("how", ["direct", "through_another", "host", "synchronize"])
def test_compute_reads_a_queued_write_only_once_ordered_after_it(how):
    """``queued_write``: even after the writing stream has run (a later ``run_on`` on it runs
    its queue), compute may read the tensor only once it waited for an event recorded after
    the write: directly, through another stream, on the host, or by synchronizing."""
    sim = SimulatedDevice()
    side, other = sim.new_stream(), sim.new_stream()
    early = sim.record_event(side)
    sums = torch.zeros(4, dtype=torch.float64)
    sim.queued_write(side, sums)
    sim.run_on(side, lambda: None)  # the stream ran its queue: the write is done, not ordered
    sim.wait_event(sim.compute, early)  # an event from before the write orders nothing
    with pytest.raises(SimulatedHazard, match="has not waited for an event on"):
        sim.will_read(sums[1:2])
    sim.will_read(torch.zeros(4))  # another buffer
    after = sim.record_event(side)
    if how == "direct":
        sim.wait_event(sim.compute, after)
    elif how == "through_another":
        sim.wait_event(other, after)
        sim.wait_event(sim.compute, sim.record_event(other))
    elif how == "host":
        sim.wait_host(after)
    else:
        sim.synchronize()
    sim.will_read(sums)
