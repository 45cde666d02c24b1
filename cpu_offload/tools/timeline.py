"""A picture of one real step: compute vs copies on the GPU, and activation memory over time.

``TimelineDevice`` is a ``CudaDevice`` that also records timing events: one on the compute stream
at every schedule milestone (layer forward/backward start, release, reload) together with the
allocated memory at that point of the stream, and one pair around every copy on the offload
stream. ``timeline()`` converts them to milliseconds from ``start()``; ``plot_timeline`` draws
the three lanes like the scheduling figures of Transformer Engine's CPU offloading guide.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..api import get_cpu_offload_context
from ..core.device import CudaDevice, Event, OffloadDevice, Stream


def _timed_event(stream: Stream) -> Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class TimelineDevice(CudaDevice):
    """``CudaDevice`` that records when milestones and copies happen on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self._t0: Optional[Event] = None
        self._milestones: list = []  # (what, layer, event, allocated bytes)
        self._copies: list = []  # (direction, nbytes, start event, end event)

    def start(self) -> None:
        """Begin a recording (call right before the step's forward)."""
        self._milestones, self._copies = [], []
        self._t0 = _timed_event(self.current_stream())

    def stop(self) -> None:
        """End the recording (call after backward)."""
        self.trace("end", -1)

    def trace(self, what: str, layer: int) -> None:
        if self._t0 is not None:
            allocated = torch.cuda.memory_allocated()
            self._milestones.append((what, layer, _timed_event(self.current_stream()), allocated))

    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        start = _timed_event(stream) if self._t0 is not None else None
        super().copy(stream, dst, src)
        if start is not None:
            self._copies.append(("d2h" if src.is_cuda else "h2d", src.numel(), start, _timed_event(stream)))

    # One copy at a time through ``copy``, so each is timed (CudaDevice batches them).
    copy_after_compute = OffloadDevice.copy_after_compute
    copy_many = OffloadDevice.copy_many
    copy_and_record = OffloadDevice.copy_and_record

    def timeline(self) -> dict:
        """Milestones and copies in milliseconds from ``start()`` (synchronizes)."""
        torch.cuda.synchronize()
        t0 = self._t0
        return {
            "milestones": [
                {"what": w, "layer": l, "ms": t0.elapsed_time(e), "allocated": a}
                for w, l, e, a in self._milestones
            ],
            "copies": [
                {"dir": d, "bytes": n, "start_ms": t0.elapsed_time(s), "end_ms": t0.elapsed_time(e)}
                for d, n, s, e in self._copies
            ],
        }


def plot_timeline(data: dict, path: Path, title: str = "") -> Optional[Path]:
    """Draw compute, offload stream and activation memory; ``None`` without matplotlib."""
    try:  # matplotlib is optional (the ``bench`` and ``test`` extras): imported only to draw
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ms = data["milestones"]
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 4.5), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1.3]})
    phases = [m for m in ms if m["what"] in ("fwd", "bwd", "end")]
    for cur, nxt in zip(phases, phases[1:]):
        if cur["what"] == "end":
            continue
        color = "#4c72b0" if cur["what"] == "fwd" else "#dd8452"
        ax.barh(1, nxt["ms"] - cur["ms"], left=cur["ms"], color=color, edgecolor="white")
        ax.text((cur["ms"] + nxt["ms"]) / 2, 1, str(cur["layer"]), ha="center", va="center",
                color="white", fontsize=8)
    for c in data["copies"]:
        color = "#55a868" if c["dir"] == "d2h" else "#c44e52"
        ax.barh(0, c["end_ms"] - c["start_ms"], left=c["start_ms"], color=color, edgecolor="white")
    for m in ms:
        if m["what"] in ("release", "reload"):
            ax.axvline(m["ms"], color="grey", lw=0.6, ls=":")
            ax.text(m["ms"], 1.55, f"{m['what'][:3]} {m['layer']}", rotation=90, fontsize=6,
                    va="top", color="grey")
    ax.set_yticks([0, 1], ["offload stream\n(green D2H, red H2D)", "compute\n(blue fwd, orange bwd)"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_title(title)
    mem.step([m["ms"] for m in ms], [m["allocated"] / 2**30 for m in ms], where="post")
    mem.set_ylabel("allocated GiB")
    mem.set_xlabel("ms since step start (CUDA events)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def record_step(model: Any, x: torch.Tensor, num_layers: int, **context_kwargs: Any) -> dict:
    """Run one warm-up and one recorded training step of ``model`` (a ``GPTStack``-like module
    taking ``(x, ctx, sync)``) with ``num_layers`` offloaded; return the timeline."""
    device = TimelineDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=num_layers, model_layers=len(model.layers), device=device,
        **context_kwargs,
    )
    for record in (False, True):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        torch.cuda.synchronize()
        if record:
            device.start()
        out = model(x.detach().requires_grad_(), ctx, sync)
        out.float().square().mean().backward()
        if record:
            device.stop()
    return device.timeline()
