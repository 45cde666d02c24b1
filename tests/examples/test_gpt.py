"""The embedded GPT workload (``cpu_offload.examples.gpt``): shapes, determinism, the usage pattern, and
the saved-tensor layouts the benchmarks and GPU tests rely on. CPU only."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from cpu_offload.examples.gpt import (
    GPTBlock,
    GPTStack,
    build_model,
    make_input,
    reference_config,
    run_layers,
    tiny_config,
)


def saved_tensors_of(fn, *args):
    """Run ``fn(*args)`` and return (output, tensors autograd saved for backward, in order)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_configs():
    ref = reference_config()
    assert (ref.hidden, ref.heads, ref.seq, ref.batch, ref.layers) == (4096, 32, 4096, 1, 8)
    assert ref.dtype == torch.bfloat16
    tiny = tiny_config()
    assert tiny.dtype == torch.float32 and tiny.hidden % tiny.heads == 0
    assert tiny.with_(layers=2).layers == 2 and tiny.layers == 4


def test_shapes_and_param_count():
    cfg = tiny_config()
    model = build_model(cfg)
    assert isinstance(model, GPTStack) and isinstance(model.layers, torch.nn.ModuleList)
    assert len(model.layers) == cfg.layers and all(isinstance(b, GPTBlock) for b in model.layers)
    assert sum(p.numel() for p in model.layers[0].parameters()) == cfg.params_per_layer()
    assert all(p.dtype == cfg.dtype for p in model.parameters())
    x = make_input(cfg)
    assert x.shape == cfg.input_shape() and x.requires_grad
    y = model(x)
    assert y.shape == x.shape and y.dtype == cfg.dtype
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in model.parameters())


def test_bf16_builds():
    cfg = tiny_config().with_(dtype=torch.bfloat16, layers=1)
    model = build_model(cfg)
    assert all(p.dtype == torch.bfloat16 and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert model(make_input(cfg)).dtype == torch.bfloat16


def test_deterministic_init_and_input():
    cfg = tiny_config()
    a, b, c = build_model(cfg, seed=0), build_model(cfg, seed=0), build_model(cfg, seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.layers[0].qkv.weight, c.layers[0].qkv.weight)
    assert torch.equal(make_input(cfg, seed=3), make_input(cfg, seed=3))
    assert not torch.equal(make_input(cfg, seed=3), make_input(cfg, seed=4))


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(tiny_config(), seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_runs_are_bit_identical():
    cfg = tiny_config()

    def step():
        model, x = build_model(cfg), make_input(cfg)
        out = model(x)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad] + [p.grad for p in model.parameters()]

    for r1, r2 in zip(step(), step()):
        assert torch.equal(r1, r2)


def test_run_layers_usage_pattern():
    """``with ctx: x = layer(x)`` then ``x = sync(x)``, once per layer, in order."""
    cfg = tiny_config()
    model, x = build_model(cfg), make_input(cfg, requires_grad=False)
    events: list[str] = []

    class Ctx:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")
            return False

    def sync(t):
        events.append("sync")
        return t

    def layer_fn(layer, t):
        events.append(f"layer{list(model.layers).index(layer)}")
        return layer(t)

    out = run_layers(model.layers, x, Ctx(), sync, layer_fn)
    expected = []
    for i in range(cfg.layers):
        expected += ["enter", f"layer{i}", "exit", "sync"]
    assert events == expected
    assert torch.equal(out, model(x))
    assert torch.equal(out, model(x, ctx=Ctx(), sync=sync))


def test_checkpoint_layer_fn_is_exact():
    cfg = tiny_config()
    model, x = build_model(cfg), make_input(cfg)

    def ckpt(layer, t):
        return torch.utils.checkpoint.checkpoint(layer, t, use_reentrant=False)

    ref = model(x)
    ref.sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    out = model(x, layer_fn=ckpt)
    out.sum().backward()
    assert torch.equal(out, ref)
    for g, r in zip([x.grad] + [p.grad for p in model.parameters()], ref_grads):
        assert torch.equal(g, r)


def test_attention_saves_views_of_shared_bases():
    """q, k, v are saved as views of one qkv storage, and the output projection saves a view of
    the storage SDPA saved its output in (CPU's flash kernel lays it out (b, s, h, d), as CUDA's
    do, so ``transpose(1, 2).reshape`` is a contiguous view of a non-contiguous base)."""
    cfg = tiny_config()
    block = build_model(cfg.with_(layers=1)).layers[0]
    _, saved = saved_tensors_of(block, make_input(cfg))
    four_d = [t for t in saved if t.dim() == 4]
    q, k, v = four_d[:3]
    base = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == base == v.untyped_storage().data_ptr()
    assert not q.is_contiguous()
    if len(four_d) == 4:  # SDPA saved its output: the projection input must share its storage
        out = four_d[3]
        shared = [
            t for t in saved
            if t.dim() == 2 and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        ]
        assert shared and shared[0].is_contiguous() and not out.is_contiguous()


def test_tag_activations_marks_the_saved_activations():
    """With tags on, every large non-parameter tensor saved for backward carries the V1 tag,
    except the ones an op creates and saves itself (SDPA output/logsumexp, LayerNorm stats)."""
    cfg = tiny_config()
    model = build_model(cfg.with_(layers=1))
    block = model.layers[0]
    x = make_input(cfg)
    _, untagged = saved_tensors_of(block, x)
    assert not any(getattr(t, "activation_offloading", False) for t in untagged)

    model.set_tag_activations(True)
    _, saved = saved_tensors_of(block, make_input(cfg))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = [
        t for t in saved if t.untyped_storage().data_ptr() not in params and t.numel() >= cfg.hidden * cfg.seq
    ]
    tagged = [t for t in activations if getattr(t, "activation_offloading", False)]
    # x, ln1 out, q, k, v, attention out (reshaped), residual, ln2 out, fc1 out, gelu out.
    assert len(tagged) == 10
    assert len(activations) - len(tagged) <= 1  # SDPA's own saved output (if it saves one)


# --- the benchmark scripts built on this workload stay runnable (simulated device, seconds) ---

def _benchmark_module(name: str):
    import importlib
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    return importlib.import_module(name)


def test_offload_benchmark_smoke_sim(tmp_path):
    bench = _benchmark_module("offload_benchmark")
    results = bench.main([
        "--device", "sim", "--methods", "none,checkpoint,v2", "--ks", "2", "--warmup", "0",
        "--iters", "1", "--no-link", "--no-recheck", "--no-plot",
        "--layers", "4", "--out", str(tmp_path),
    ])
    assert [r.label for r in results] == ["none", "checkpoint", "v2 k=2"]
    assert all(r.error is None and r.exact_error is None for r in results), results
    assert all(r.bit_exact is True for r in results)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the exactness step
    assert results[2].offloaded_bytes > 0 and results[2].sim_copies > 0
    assert results[0].sim_copies is None  # no offload context, no simulated device
    assert (tmp_path / "offload_benchmark_sim.json").exists()


def test_hook_overhead_smoke_sim(tmp_path):
    bench = _benchmark_module("hook_overhead")
    payload = bench.main([
        "--device", "sim", "--methods", "none,v2", "--layers", "4", "--width", "8",
        "--batch", "2", "--warmup", "1", "--iters", "2", "--rounds", "1", "--out", str(tmp_path),
    ])
    assert payload["saved"]["total"] == 4 * 3  # per layer: input, weight.t(), GELU input
    assert all("error" not in r for r in payload["results"].values())


def test_frontier_time_ratios_use_the_none_time_measured_around_each_configuration():
    """A machine that slows down 10% over the run must not make late configurations look 10%
    slower: each ratio is to none interpolated between the none measurements around it."""
    bench = _benchmark_module("frontier")
    none = bench.Point("none", step_ms=100.0, peak_bytes=1000)
    points = [none] + [bench.Point(f"off {k}", step_ms=100.0 + 10.0 * k / 4.5, peak_bytes=900)
                       for k in range(1, 5)]
    bench.derive(points, none, [(0.0, 100.0), (4.5, 110.0)])
    assert [round(p.time_ratio, 6) for p in points] == [1.0] * 5
    assert [p.peak_ratio for p in points[1:]] == [0.9] * 4
    assert bench.interpolate([(0.0, 10.0), (4.0, 14.0)], 1.0) == 11.0
    assert bench.interpolate([(0.0, 10.0), (4.0, 14.0)], 9.0) == 14.0


def test_frontier_smoke_sim(tmp_path, capsys):
    """Every configuration of both workloads runs and is bit-exact on the simulated device.

    Peak memory is not measured there, so no configuration fits a budget: the per-budget cells
    are "-", but the table still has one row per budget. A slow assumed link makes the planner
    mix recompute and partial offload, so those plans run too."""
    import importlib.util

    bench = _benchmark_module("frontier")
    have_hf = importlib.util.find_spec("transformers") is not None
    budgets = [0.9, 0.7, 0.5, 0.3]
    results = bench.main([
        "--device", "sim", "--workload", "both" if have_hf else "gpt", "--layers", "4",
        "--budgets", ",".join(map(str, budgets)), "--link-gbps", "0.03",
        "--warmup", "0", "--iters", "1", "--no-plot", "--out", str(tmp_path),
    ])
    assert sorted(results) == (["gpt", "hf"] if have_hf else ["gpt"])
    for name, res in results.items():
        points = res["point_objects"]
        labels = [p.label for p in points]
        assert labels[0] == "none" and labels[-1] == "none (end)"
        assert {f"ckpt {k}" for k in range(1, 5)} | {f"off {k}" for k in range(1, 4)} <= set(labels)
        assert {f"sel {k}" for k in range(4)} <= set(labels)
        assert all(p.error is None and p.step_ms is not None for p in points), points
        assert all(p.exact is True for p in points[1:]), points  # none (end): none vs itself
        assert any("plan" in p.names for p in points)
        for p in points:
            assert (p.sim_copies or 0) > 0 if p.num_layers else not p.sim_copies, p
        assert [r["budget"] for r in res["frontier"]] == budgets
        assert all(r["winner"] is None for r in res["frontier"])  # no peak measured on sim
        assert (tmp_path / f"frontier_{name}_sim.json").exists()
        assert all(p.baseline_ms for p in points)  # every ratio has its local none time
        assert any("none measurements" in n for n in res["notes"])
    assert not torch.are_deterministic_algorithms_enabled()
    lines = capsys.readouterr().out.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("budget ")]
    assert len(tables) == len(results)
    for i in tables:  # header, rule, one row per budget, then the notes
        assert [float(line.split()[0]) for line in lines[i + 2:i + 2 + len(budgets)]] == budgets
        assert lines[i + 2 + len(budgets)].startswith("none drift: ")


def test_frontier_selection_and_plot(tmp_path):
    """Per budget the fastest point within it, per method; the Pareto lines and the plot."""
    bench = _benchmark_module("frontier")
    P = bench.Point

    def pt(label, method, t, m, **kw):
        return P(label, names={method: label}, step_ms=100 * t, time_ratio=t, peak_ratio=m, **kw)

    points = [
        P("none", step_ms=100.0, time_ratio=1.0, peak_ratio=1.0),
        pt("ckpt 1", "ckpt", 1.05, 0.8), pt("ckpt 2", "ckpt", 1.10, 0.6),
        pt("off 1", "off", 1.01, 0.85), pt("off 2", "off", 1.30, 0.78), pt("off 3", "off", 1.2, 0.75),
        pt("plan k=1 rec=[1]", "plan", 1.04, 0.55, predicted_time_ratio=1.03,
           predicted_peak_ratio=0.5),
    ]
    rows = bench.frontier(points, [0.9, 0.8, 0.5], {0.9: points[6]}, list(bench.METHODS))
    assert rows[0]["best"] == {"ckpt": "ckpt 1", "off": "off 1", "sel": None,
                               "plan": "plan k=1 rec=[1]"}
    assert rows[0]["winner"] == "off 1"
    assert rows[1]["best"]["off"] == "off 3" and rows[1]["winner"] == "plan k=1 rec=[1]"
    assert rows[2]["best"] == {"ckpt": None, "off": None, "sel": None, "plan": None}
    assert rows[2]["winner"] is None and rows[0]["planner_pick_over_budget"] is False
    table = bench.frontier_table(rows, list(bench.METHODS)).splitlines()
    assert len(table) == 2 + 3 and "1.040 / 0.550 plan k=1 rec=[1]" in table[2]
    offs = [p for p in points if "off" in p.names]
    assert [p.label for p in bench.pareto(offs)] == ["off 3", "off 1"]  # off 2: slower and larger
    pytest.importorskip("matplotlib")
    bench.plot(points, [0.9, 0.5], list(bench.METHODS), tmp_path / "f.png", "test")
    assert (tmp_path / "f.png").stat().st_size > 0
