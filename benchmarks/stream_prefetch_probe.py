"""How much the streamed part's post-backward time could shrink if its first chunks were copied
in during backward: a plain-torch probe of the link schedule, not the library's code.

The streamed part moves each chunk host -> device into one of three slots, updates it, and moves
it back; a slot is refilled only after the copy out of the chunk before in it. That starts in
``step()``, after backward, so the next forward waits about one link time (each way) for the
last chunk. Copies in do not depend on the gradients, so the first chunks could be copied in
during backward, when the host-to-device direction idles. This probe times the pipeline from
"backward ended" to the last chunk's update and to its last copy out:

- ``none``: every copy in after the start (today's schedule);
- ``slots``: the first three chunks already in their slots (no memory beyond the staging);
- ``extra MiB``: those and further chunks already in buffers of their own (memory held from
  backward on, freed after their copies out).

What the library measured when it built this (thirtieth session, 45b3cff, reverted in the
commit after; benchmarks/RESULTS.md): the three slots copied in during backward saved 1-3 ms of
a 187-190 ms step with everything streamed, and nothing with ``stream_fraction="auto"``, where
the copies also slowed the CPU update by about 11 ms (they share host memory). The 11 ms this
probe gives did not carry over. Not measured apart: in the library each chunk also costs host
time to queue, about as much as the link takes to move it (``stream_update``'s docstring), and
the probe has none. Read its numbers as an upper bound.

Usage (CUDA only)::

    python3 benchmarks/stream_prefetch_probe.py --total-gib 3.0 --slot-mib 128,512
"""
from __future__ import annotations

import argparse
import statistics

import torch

SLOTS = 3


def run(total: int, slot: int, prefetch_extra: int, prefetch_slots: bool, host_in: torch.Tensor,
        host_out: torch.Tensor) -> tuple[float, float]:
    """ms from the start to the last chunk's update, and to its last copy out."""
    dev = torch.device("cuda")
    n = -(-total // slot)
    h2d, d2h, comp = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()
    slots = [torch.empty(slot, dtype=torch.uint8, device=dev) for _ in range(SLOTS)]
    extra_n = prefetch_extra // slot
    extra = [torch.empty(slot, dtype=torch.uint8, device=dev) for _ in range(extra_n)]
    chunks = [(i * slot, min(total, (i + 1) * slot)) for i in range(n)]
    # the prefetched chunks go last in the update order (their updates wait for nothing), the
    # slot chunks first, so that the slots' copies out are not queued behind theirs
    staged = {}  # chunk -> its buffer, copied in before the start
    if prefetch_slots:
        for k in range(min(SLOTS, n)):
            staged[k] = slots[k]
    tail = list(range(n - extra_n, n)) if extra_n else []
    for j, c in enumerate(tail):
        staged[c] = extra[j]
    for c, buf in staged.items():
        lo, hi = chunks[c]
        buf[: hi - lo].copy_(host_in[lo:hi], non_blocking=True)
    torch.cuda.synchronize()
    start, updated, out_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record(comp)
    h2d.wait_stream(comp)
    free = [None] * SLOTS  # per slot: the copy out that last read it
    slot_of = {id(b): k for k, b in enumerate(slots)}
    order = [c for c in range(n) if c not in tail] + tail
    slot_use = 0
    for c in order:
        lo, hi = chunks[c]
        if c in staged:
            buf = staged[c]
            if id(buf) in slot_of:
                slot_use = max(slot_use, slot_of[id(buf)] + 1)
        else:
            s = slot_use % SLOTS
            slot_use += 1
            buf = slots[s]
            with torch.cuda.stream(h2d):
                if free[s] is not None:
                    h2d.wait_event(free[s])
                buf[: hi - lo].copy_(host_in[lo:hi], non_blocking=True)
            comp.wait_stream(h2d)
        buf[: hi - lo].add_(1)  # the update: one pass over the chunk
        done = torch.cuda.Event()
        done.record(comp)
        with torch.cuda.stream(d2h):
            d2h.wait_event(done)
            host_out[lo:hi].copy_(buf[: hi - lo], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(d2h)
        if id(buf) in slot_of:
            free[slot_of[id(buf)]] = ev
    updated.record(comp)
    comp.wait_stream(d2h)
    out_done.record(comp)
    torch.cuda.synchronize()
    return start.elapsed_time(updated), start.elapsed_time(out_done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-gib", type=float, default=3.0, help="bytes streamed each way")
    p.add_argument("--slot-mib", default="128,512", help="comma list of slot sizes")
    p.add_argument("--extra-mib", default="0,1024,2048", help="comma list of memory beyond the slots")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    total = int(args.total_gib * 2**30)
    host_in = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    print(f"{torch.cuda.get_device_name()}, {args.total_gib} GiB each way, 3 slots, "
          f"median of {args.reps}")
    print(f"{'slot MiB':>8} {'prefetched':>16} {'to last update ms':>18} {'to last copy out ms':>20} "
          f"{'update x none':>14}")
    for slot_mib in (int(x) for x in args.slot_mib.split(",")):
        slot = slot_mib * 2**20
        base = None
        rows = [("none", False, 0), ("slots", True, 0)] + [
            (f"slots + {e} MiB", True, e * 2**20) for e in (int(x) for x in args.extra_mib.split(",")) if e]
        for name, pslots, extra in rows:
            run(total, slot, extra, pslots, host_in, host_out)  # warm-up
            times = [run(total, slot, extra, pslots, host_in, host_out) for _ in range(args.reps)]
            upd = statistics.median(t[0] for t in times)
            out = statistics.median(t[1] for t in times)
            base = base if base is not None else upd
            print(f"{slot_mib:>8} {name:>16} {upd:>18.1f} {out:>20.1f} {upd / base:>14.2f}")


if __name__ == "__main__":
    main()
