"""Timeline recording (GPU) and drawing (CPU, synthetic data)."""
import pytest
import torch

from cpu_offload.examples.gpt import GPTConfig, build_model, make_input
from cpu_offload.tools.timeline import plot_timeline, record_step


def test_plot_draws_compute_copies_and_memory(tmp_path):
    pytest.importorskip("matplotlib")
    data = {
        "milestones": [
            {"what": "fwd", "layer": 0, "ms": 0.0, "allocated": 1 << 30},
            {"what": "release", "layer": 0, "ms": 1.0, "allocated": 1 << 30},
            {"what": "fwd", "layer": 1, "ms": 1.0, "allocated": 1 << 29},
            {"what": "bwd", "layer": 1, "ms": 2.0, "allocated": 1 << 29},
            {"what": "reload", "layer": 0, "ms": 3.0, "allocated": 1 << 30},
            {"what": "bwd", "layer": 0, "ms": 3.0, "allocated": 1 << 30},
            {"what": "end", "layer": -1, "ms": 4.0, "allocated": 0},
        ],
        "copies": [
            {"dir": "d2h", "bytes": 10, "start_ms": 0.1, "end_ms": 0.9},
            {"dir": "h2d", "bytes": 10, "start_ms": 2.0, "end_ms": 2.9},
        ],
    }
    path = plot_timeline(data, tmp_path / "t.png", "synthetic")
    assert path.exists() and path.stat().st_size > 10_000


@pytest.mark.gpu
def test_recorded_timeline_orders_copies_and_milestones():
    cfg = GPTConfig(hidden=512, heads=8, seq=512, batch=2, layers=4, dtype=torch.bfloat16)
    model = build_model(cfg, device="cuda")
    data = record_step(model, make_input(cfg, device="cuda", requires_grad=False), 2,
                       min_tensor_size_to_offload=0)
    kinds = [(m["what"], m["layer"]) for m in data["milestones"]]
    assert kinds.index(("release", 0)) < kinds.index(("fwd", 2))
    assert kinds.index(("reload", 0)) < kinds.index(("bwd", 0))
    d2h = [c for c in data["copies"] if c["dir"] == "d2h"]
    h2d = [c for c in data["copies"] if c["dir"] == "h2d"]
    # Everything that left comes back, except the step input: the caller holds it, so backward
    # uses it where it is.
    assert d2h and 0 < len(h2d) < len(d2h)
    assert max(c["end_ms"] for c in d2h) <= min(c["start_ms"] for c in h2d)
    assert all(c["end_ms"] >= c["start_ms"] for c in data["copies"])
