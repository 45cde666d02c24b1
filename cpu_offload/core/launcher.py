"""Host work queued from backward's hooks, run off backward's own thread.

A post-accumulate-grad hook runs on the thread that drives backward (on CUDA, autograd's device
thread). Host work done inside it -- say the 1 ms of Python and driver calls that queue one
chunk of the streamed optimizer update -- delays every backward kernel queued after it, and the
GPU goes idle once backward's host time exceeds its device time. A ``Launcher`` takes such work
from the hook and runs it later, in submission order:

- ``ThreadLauncher`` (``CudaDevice``): on a thread of its own, so backward's kernels keep being
  queued meanwhile. torch's ops release the GIL while they run, so the two threads interleave
  at op granularity.
- ``DeferredLauncher`` (``SimulatedDevice``): when someone waits for it (``join``), on the
  waiting thread: the latest the work can run, deterministic, so tests see what happens when
  backward (and the user's code after it) moved on before the work ran.
- ``InlineLauncher``: at once, on the submitting thread.

Work submitted with a stream runs with that stream current on the launcher's thread, so memory
it allocates comes from that stream's pool, as it would in the hook. The rule for the work
itself: it may run after anything the submitter did later, so it takes the values it needs at
submission (not ``.grad`` as it is when it runs), and orders its device work after the
submitter's with an event recorded *when it runs*, after its allocations (memory the caching
allocator hands out may still be in use by compute work queued before).

An error in submitted work is raised by the next ``join`` (and the work queued after it is
dropped); ``cancel`` drops what has not started and discards such an error (the caller is
abandoning the work).
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable, Optional

Work = Callable[[], None]


class InlineLauncher:
    """Runs work at once, on the submitting thread (errors raise from ``submit``).

    Example::

        >>> from cpu_offload.core.launcher import InlineLauncher
        >>> ran = []
        >>> InlineLauncher().submit(lambda: ran.append(1))
        >>> ran
        [1]
    """

    def submit(self, work: Work, stream: Any = None) -> None:
        work()

    def join(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


class DeferredLauncher:
    """Queues work; ``join`` runs it, in order, on the joining thread (each with the stream it
    was submitted with current, through ``current(stream)``, a context manager, if given).

    Example::

        >>> from cpu_offload.core.launcher import DeferredLauncher
        >>> ran, launcher = [], DeferredLauncher()
        >>> launcher.submit(lambda: ran.append(1))
        >>> ran, launcher.pending
        ([], 1)
        >>> launcher.join()
        >>> ran
        [1]
    """

    def __init__(self, current: Optional[Callable[[Any], Any]] = None) -> None:
        self._queue: deque = deque()
        self._lock = threading.RLock()  # submit (a hook) and join (the caller) may be two threads
        self._current = current

    @property
    def pending(self) -> int:
        """Work submitted and not run yet."""
        return len(self._queue)

    def submit(self, work: Work, stream: Any = None) -> None:
        with self._lock:
            self._queue.append((work, stream))

    def join(self) -> None:
        with self._lock:
            try:
                while self._queue:
                    work, stream = self._queue.popleft()
                    if stream is None or self._current is None:
                        work()
                        continue
                    with self._current(stream):
                        work()
            finally:
                self._queue.clear()  # after an error: the work queued behind it is dropped

    def cancel(self) -> None:
        with self._lock:
            self._queue.clear()

    def close(self) -> None:
        self.cancel()


class _Shared:
    """What ``ThreadLauncher`` and its thread share (the thread holds this, not the launcher,
    so a launcher nobody references is collected, and its finalizer stops the thread)."""

    def __init__(self, setup: Callable[[], None], make_current: Callable[[Any], None]) -> None:
        self.setup, self.make_current = setup, make_current
        self.cv = threading.Condition()
        self.queue: deque = deque()
        self.running = False
        self.error: Optional[BaseException] = None
        self.closed = False


def _serve(shared: _Shared) -> None:
    """The launcher thread: run queued work in order until closed. If ``setup`` failed, no
    work runs, and the join after each submission raises its error (work on a thread not set
    up, e.g. on another device, would be wrong)."""
    broken: Optional[BaseException] = None
    try:
        shared.setup()
    except BaseException as exc:  # noqa: BLE001 - raised by every join from now on
        broken = exc
    while True:
        with shared.cv:
            while not shared.queue and not shared.closed:
                shared.cv.wait()
            if not shared.queue:
                return
            work, stream = shared.queue.popleft()
            shared.running = True
        try:
            if broken is not None:
                raise broken
            if shared.error is None:
                if stream is not None:
                    shared.make_current(stream)
                work()
        except BaseException as exc:  # noqa: BLE001 - raised by the next join
            with shared.cv:
                shared.error = exc
                shared.queue.clear()
        finally:
            del work
            with shared.cv:
                shared.running = False
                shared.cv.notify_all()


def _stop(shared: _Shared) -> None:
    with shared.cv:
        shared.closed = True
        shared.queue.clear()
        shared.cv.notify_all()


class ThreadLauncher:
    """Runs work on a thread of its own, in submission order (started at the first
    ``submit``, stopped by ``close`` or when the launcher is collected).

    Args:
        setup: called once on the thread before any work (``CudaDevice``: select the device).
        make_current: called with a submission's stream before its work (``CudaDevice``:
            ``torch.cuda.set_stream``).

    Example::

        >>> import threading
        >>> from cpu_offload.core.launcher import ThreadLauncher
        >>> names, launcher = [], ThreadLauncher()
        >>> launcher.submit(lambda: names.append(threading.current_thread().name))
        >>> launcher.join()
        >>> names
        ['cpu_offload-launch']
        >>> launcher.close()
    """

    def __init__(self, setup: Callable[[], None] = lambda: None,
                 make_current: Callable[[Any], None] = lambda stream: None) -> None:
        self._shared = _Shared(setup, make_current)
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(self, _stop, self._shared)

    def submit(self, work: Work, stream: Any = None) -> None:
        s = self._shared
        with s.cv:
            if s.closed:
                raise RuntimeError("ThreadLauncher.submit after close()")
            if s.error is not None:
                return  # dropped: join raises the error that stopped the queue
            s.queue.append((work, stream))
            s.cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(s,), name="cpu_offload-launch",
                                            daemon=True)
            self._thread.start()

    def join(self) -> None:
        """Wait until every submitted work has run; raise the first error one raised."""
        s = self._shared
        with s.cv:
            while s.queue or s.running:
                s.cv.wait()
            error, s.error = s.error, None
        if error is not None:
            raise error

    def cancel(self) -> None:
        """Drop the work not started yet, wait for the one running, and discard its error."""
        s = self._shared
        with s.cv:
            s.queue.clear()
            while s.running:
                s.cv.wait()
            s.error = None

    def close(self) -> None:
        """``cancel``, then stop the thread."""
        self.cancel()
        _stop(self._shared)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None


Launcher = Any  # InlineLauncher | DeferredLauncher | ThreadLauncher: submit, join, cancel, close

__all__ = ["DeferredLauncher", "InlineLauncher", "Launcher", "ThreadLauncher"]
