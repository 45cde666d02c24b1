"""The benchmark scripts (``benchmarks/``) stay runnable: each runs on the simulated device in
seconds, and the frontier's selection and drift correction are checked on synthetic points."""
from __future__ import annotations

import contextlib
import json
import math
import statistics

import pytest
import torch


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
    # one interleaved timing round (the default on sim): time x is the ratio measured in it
    assert results[0].round_ratios == [1.0] and all(len(r.round_ms) == 1 for r in results)
    assert results[2].time_ratio == results[2].round_ms[0] / results[0].round_ms[0]
    assert all(r.bit_exact is True for r in results)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the exactness step
    assert results[2].offloaded_bytes > 0 and results[2].sim_copies > 0
    assert results[0].sim_copies is None  # no offload context, no simulated device
    assert (tmp_path / "offload_benchmark_sim.json").exists()


def test_optim_benchmark_smoke_sim(tmp_path):
    bench = _benchmark_module("optim_benchmark")
    rows = bench.main([
        "--device", "sim", "--no-microbench", "--rows", "plain,f=1,split f=1", "--layers", "2",
        "--warmup", "1", "--iters", "1", "--out", str(tmp_path),
    ])
    assert [r.label for r in rows] == ["plain", "f=1", "split f=1"]
    assert all(r.error is None for r in rows), rows
    cpu, split = rows[1], rows[2]
    assert cpu.max_loss_diff == 0 and split.max_loss_diff == 0  # the same numbers as plain
    assert cpu.stream_pct is None and 0 < split.stream_pct < 100  # "auto": a real split
    assert split.h2d_ms > 0 and split.d2h_ms > 0 and split.balanced_ms > 0
    # the probe's bound: its own rates, all on the CPU for an f= row, its best share for a split
    assert cpu.probe_share == 0 and 0 <= split.probe_share <= 1
    assert cpu.offloaded == split.offloaded == cpu.params  # fraction 1: every parameter
    for r in (cpu, split):
        assert r.probe_bound_ms >= r.fwd_bwd_ms and r.probe_ratio == r.step_ms / r.probe_bound_ms
    assert (tmp_path / "optim_benchmark_sim.md").exists()


def test_optim_benchmark_stream_fraction_takes_auto_measure_or_a_share(tmp_path, capsys):
    bench = _benchmark_module("optim_benchmark")
    for bad in ("most", "1.5", "nan"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--stream-fraction", bad])
        assert f"--stream-fraction: 'auto', 'measure' or a number in [0, 1], not '{bad}'" in capsys.readouterr().err
    assert bench.parse_args(["--stream-fraction", "0.75"]).stream_fraction == 0.75
    common = ["--device", "sim", "--no-microbench", "--no-probe", "--rows", "split f=1", "--layers", "2",
              "--warmup", "1", "--iters", "1", "--out", str(tmp_path)]
    fixed, = bench.main(common + ["--stream-fraction", "0.75"])
    timed, = bench.main(common + ["--stream-fraction", "measure"])
    assert fixed.error is None and timed.error is None
    assert fixed.stream_pct == 75.0 and fixed.balanced_ms is None  # a fixed share: no plan
    assert 0 <= timed.stream_pct <= 100 and timed.balanced_ms > 0  # planned from the rates


def test_optim_benchmark_bf16_state_rows_equal_their_plain_row_sim(tmp_path):
    """The ``bf16`` rows (``fp32_masters=False``) are compared with plain fused AdamW on the bf16
    weights, not with the master-weight baseline: on the simulated device, the same losses."""
    bench = _benchmark_module("optim_benchmark")
    rows = bench.main([
        "--device", "sim", "--no-microbench", "--no-probe", "--rows", "plain,plain bf16,split f=1 bf16",
        "--layers", "2", "--warmup", "1", "--iters", "2", "--out", str(tmp_path),
    ])
    assert all(r.error is None for r in rows), rows
    _, plain_bf16, split = rows
    assert split.max_loss_diff == 0 and 0 < split.stream_pct < 100
    assert split.losses == plain_bf16.losses


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
        "--warmup", "0", "--iters", "1", "--no-plot", "--out", str(tmp_path), "--verify", "2",
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
        assert any("3 rounds" in n and "none measurements" in n for n in res["notes"])
        for p in points[1:-1]:  # each configuration 3 times (default), interleaved with none
            assert len(p.round_ratios) == 3 and len(p.round_ms) == 3, p
            assert p.time_ratio == sorted(p.round_ratios)[1] and p.spread is not None
        verified = {n.split(":")[0] for n in res["notes"] if ": verified " in n}
        assert verified == {f"plan @{b:g}" for p in points for b in p.budgets} != set()
        assert all(set(r) >= {"pick_minus_winner", "within_spread"} for r in res["frontier"])
    assert not torch.are_deterministic_algorithms_enabled()
    lines = capsys.readouterr().out.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("budget ")]
    assert len(tables) == len(results)
    assert all("pick - winner" in lines[i] for i in tables)
    assert sum(line.lstrip().startswith("configuration ") and "spread %" in line
               for line in lines) == len(results)
    for i in tables:  # header, rule, one row per budget, then the notes
        assert [float(line.split()[0]) for line in lines[i + 2:i + 2 + len(budgets)]] == budgets
        assert lines[i + 2 + len(budgets)].startswith("none drift: ")


def test_frontier_marks_a_claim_within_the_spread():
    """"The winner beats the plan" claims nothing when the two differ by less than the wider
    per-round range of their time ratios."""
    bench = _benchmark_module("frontier")
    P = bench.Point

    def pt(label, method, ratios, m):
        p = P(label, names={method: label}, step_ms=100.0, peak_ratio=m, round_ratios=ratios)
        p.time_ratio, p.spread, p.ratio_range = bench.ratio_stats(ratios)
        return p

    sel = pt("sel 4", "sel", [1.03, 1.04, 1.035], 0.4)
    noisy = pt("plan k=3", "plan", [1.02, 1.08, 1.05], 0.45)  # 0.015 slower, range 0.06
    steady = pt("plan k=2", "plan", [1.06, 1.061, 1.062], 0.45)  # 0.026 slower, range 0.002
    rows = bench.frontier([sel, noisy, steady], [0.5, 0.49], {0.5: noisy, 0.49: steady},
                          list(bench.METHODS))
    assert rows[0]["pick_minus_winner"] == pytest.approx(0.015) and rows[0]["within_spread"]
    assert rows[1]["pick_minus_winner"] == pytest.approx(0.026)
    assert rows[1]["within_spread"] is False
    table = bench.frontier_table(rows, list(bench.METHODS)).splitlines()
    assert "+0.015 ~ within spread" in table[2] and "+0.026 " in table[3]
    assert "within spread" not in table[3]


def test_frontier_ranks_by_the_drift_corrected_ratio_not_the_raw_time():
    """A configuration measured while the machine ran slow has the larger raw step time but
    the smaller ratio to the ``none`` measured around it: the ratio, which the tables show,
    decides which is fastest."""
    bench = _benchmark_module("frontier")
    P = bench.Point
    early = P("off 2", names={"off": "off 2"}, step_ms=76.0, time_ratio=1.002, peak_ratio=0.786)
    late = P("plan k=2", names={"plan": "plan k=2"}, step_ms=77.0, time_ratio=0.992,
             peak_ratio=0.786)
    rows = bench.frontier([early, late], [0.8], {0.8: late}, list(bench.METHODS))
    assert rows[0]["winner"] == "plan k=2" and rows[0]["pick_minus_winner"] == 0.0


def test_frontier_times_the_pick_head_to_head_with_the_winner():
    """Where the pick is not the winner, both are timed in turns (``--confirm`` blocks of
    ``--iters`` steps each) and the row holds the ratio of their median steps with its
    interval; a pair shared by two budgets is timed once; the pick that wins is not timed."""
    bench = _benchmark_module("frontier")
    args = bench.parse_args(["--device", "sim", "--layers", "2", "--confirm", "3",
                             "--iters", "2", "--warmup", "0"])
    device = bench.BenchDevice.from_flag("sim")
    wl, _, min_size = bench.build_workload("gpt", args, device)
    P = bench.Point
    off1 = P("off 1", num_layers=1, names={"off": "off 1"})
    ckpt1 = P("ckpt 1", recompute=(0,), names={"ckpt": "ckpt 1"})
    rows = [{"budget": b, "_pick": ckpt1, "_winner": off1, "pick_minus_winner": 0.01,
             "within_spread": True} for b in (0.8, 0.7)]
    rows.append({"budget": 0.6, "_pick": off1, "_winner": off1, "pick_minus_winner": 0.0,
                 "within_spread": False})
    notes: list = []
    bench.head_to_heads(rows, wl, device, args, min_size, notes)
    h = rows[0]["head_to_head"]
    assert h is rows[1]["head_to_head"] and h["steps"] == 3 * 2  # one pair, timed once
    assert h["low"] <= h["ratio"] <= h["high"] and rows[2]["head_to_head"] is None
    assert len(notes) == 2 and notes[0].startswith("@0.8: head to head, ckpt 1 / off 1 = ")
    assert "; head to head " in bench._gap_cell(rows[0])
    assert bench.ratio_interval([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == (2.0, 1.0, 3.0)


def test_hf_llama_benchmark_smoke_sim(tmp_path, capsys):
    """Every row 3 times interleaved with none, its spread, the plan rows verified."""
    pytest.importorskip("transformers")
    bench = _benchmark_module("hf_llama_benchmark")
    rows = bench.main([
        "--device", "sim", "--layers", "4", "--ks", "2", "--budgets", "0.6", "--warmup", "0",
        "--iters", "1", "--rounds", "3", "--verify", "2", "--out", str(tmp_path),
    ])
    assert [r.method for r in rows] == ["none", "hf_ckpt", "apply k=2", "floor k=2", "plan @0.6"]
    assert all(r.error is None and r.exact is True for r in rows), rows
    assert all(len(r.round_ratios) == 3 and r.spread is not None for r in rows), rows
    assert rows[0].round_ratios == [1.0] * 3 and rows[0].time_ratio == 1.0
    assert all(r.time_ratio == sorted(r.round_ratios)[1] for r in rows)
    out = capsys.readouterr().out
    assert "plan @0.6: verified " in out and "spread %" in out
    assert (tmp_path / "hf_llama_benchmark_sim.json").exists()


def test_hf_llama_benchmark_marks_a_comparison_within_the_spread():
    bench = _benchmark_module("hf_llama_benchmark")
    R = bench.Row
    p5 = R("plan @0.5", time_ratio=1.211, peak_bytes=483, round_ratios=[1.19, 1.211, 1.24])
    p4 = R("plan @0.4", time_ratio=1.200, peak_bytes=388, round_ratios=[1.199, 1.200, 1.201])
    p6 = R("plan @0.6", time_ratio=1.300, peak_bytes=600, round_ratios=[1.299, 1.300, 1.301])
    notes = bench.beaten([p5, p4, p6])
    assert notes[0].startswith("plan @0.5 slower than plan @0.4 (at <= peak) by 0.011x")
    assert "within spread" in notes[0] and "not significant" in notes[0]
    assert notes[1].startswith("plan @0.6 slower than plan @0.4") and "spread" not in notes[1]
    assert len(notes) == 2  # plan @0.4 is the fastest at its peak


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


@pytest.mark.filterwarnings("ignore:cpu_offload:UserWarning")  # (the torch rows warn: ~1.5x)
def test_host_memory_benchmark_smoke_sim(tmp_path):
    """The table's rows on the simulation: power-of-two blocks (torch's) cost about 1.5x what
    is offloaded, exact ones within 5%; the old pool's own count missed torch's rounding."""
    bench = _benchmark_module("host_memory")
    out = bench.main(["--device", "sim", "--steps", "2", "--out", str(tmp_path)])
    rows = {r["kind"]: r for r in out["memory"]}
    assert list(rows) == list(bench.KINDS)
    for kind, r in rows.items():
        pinned = max(r["ours"], r["torch"])
        assert r["offloaded"] > 0
        assert pinned <= 1.05 * r["offloaded"] if kind.startswith("exact") else (
            pinned > 1.3 * r["offloaded"])
    assert rows["before"]["ours"] == rows["before"]["offloaded"] < rows["before"]["torch"]
    assert (tmp_path / "host_memory.json").exists()


def test_optim_memory_smoke_sim():
    bench = _benchmark_module("optim_memory")
    results = bench.main(["--sim", "--width", "64", "--layers", "2", "--steps", "2"])
    assert list(results) == ["plain", "f=1 cpu", "f=1 streamed"]


@pytest.mark.gpu
def test_optim_memory_accounts_for_every_byte_on_cuda():
    """README's bound, in units of the parameter bytes P of an fp32 model with small
    activations: plain AdamW peaks at weights + gradients + 2 states (4P); at fraction 1 the
    CPU path at weights + gradients (2P), the streamed path at that plus its staging."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bench = _benchmark_module("optim_memory")
    budget_mib = 64
    r = bench.main(["--budget-mib", str(budget_mib)])
    p_mib = 8 * (2048 * 2048 + 2048) * 4 / 2**20
    assert 3.9 <= r["plain"]["whole step"] <= 4.1, r
    assert 1.9 <= r["f=1 cpu"]["whole step"] <= 2.1, r
    assert r["f=1 cpu"]["between steps"] <= 1.05, r  # the weights only
    assert r["f=1 streamed"]["between steps"] <= 1.05, r
    assert r["f=1 streamed"]["whole step"] <= 2.1 + budget_mib / p_mib, r


def _host_rates(cpu: float, link: float):
    """Rates with the CPU path under DMA at ``cpu`` G params/s and the link under CPU load at
    ``link`` GB/s each way; the other rates are set far off, so using one of them shows."""
    bench = _benchmark_module("host_rates")
    return bench.HostRates(adamw=1e-3, cpu_path=1e-3, h2d=1e-3, d2h=1e-3, both=1e-3,
                           cpu_path_under_dma=cpu, link_under_cpu=link, threads=1, elems=1,
                           cuda=False)


def test_host_rates_smoke_cpu(tmp_path):
    import json
    from dataclasses import asdict

    bench = _benchmark_module("host_rates")
    rates = bench.main(["--elems", "65536", "--reps", "1", "--threads", "1",
                        "--out", str(tmp_path)])
    floats = {k: v for k, v in asdict(rates).items() if k not in ("threads", "elems", "cuda")}
    assert len(floats) == 7
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in floats.values()), rates
    assert (rates.threads, rates.elems) == (1, 65536)
    saved = json.loads((tmp_path / "host_rates.json").read_text())
    assert saved["rates"] == asdict(rates)
    assert [b["fraction"] for b in saved["bounds"]] == [0.25, 0.5, 1.0]
    assert saved["bounds"][2]["params"] == 1_510_000_000


def test_host_rates_split_bound_at_the_crossing():
    """C = 2 G params/s, L = 40 GB/s, P = 1e9: s* = (L - 2C) / (L + 10C) = 36/60 = 0.6, where
    cpu_s = 0.4 * 1e9 / 2e9 = 0.2 s and link_s = 1e9 * (12 * 0.6 + 2 * 0.4) / 40e9 = 0.2 s;
    all on the CPU (0.5 s of CPU) and all streamed (12e9 / 40e9 = 0.3 s of link) are slower."""
    bench = _benchmark_module("host_rates")
    rates = _host_rates(cpu=2.0, link=40.0)
    b = bench.split_bound(10**9, rates)
    assert b.stream_fraction == pytest.approx(0.6, rel=1e-12)
    assert b.cpu_s == pytest.approx(b.link_s, rel=1e-12)
    assert b.seconds == pytest.approx(0.2, rel=1e-12) and b.seconds == max(b.cpu_s, b.link_s)
    assert bench.split_bound(10**9, rates, 0.0).seconds == 0.5
    assert bench.split_bound(10**9, rates, 1.0).seconds == 0.3


def test_host_rates_split_bound_clamps():
    bench = _benchmark_module("host_rates")
    # A very fast CPU: the crossing is below 0, so nothing is streamed; the link carries 2 B/param.
    b = bench.split_bound(10**9, _host_rates(cpu=1000.0, link=40.0))
    assert (b.stream_fraction, b.cpu_s, b.link_s, b.seconds) == (0.0, 0.001, 0.05, 0.05)
    b = bench.split_bound(10**9, _host_rates(cpu=math.inf, link=40.0))
    assert (b.stream_fraction, b.cpu_s, b.link_s, b.seconds) == (0.0, 0.0, 0.05, 0.05)
    # A very fast link: everything is streamed. (Finite, the crossing tends to 1: with C = 1,
    # L = 1199990, s* = 1199988 / 1200000.)
    b = bench.split_bound(10**9, _host_rates(cpu=1.0, link=math.inf))
    assert (b.stream_fraction, b.cpu_s, b.link_s, b.seconds) == (1.0, 0.0, 0.0, 0.0)
    b = bench.split_bound(10**9, _host_rates(cpu=1.0, link=1_199_990.0))
    assert b.stream_fraction == pytest.approx(0.99999, rel=1e-12)


def test_host_rates_split_bound_at_a_given_share():
    """s = 0.25, C = 2, L = 40, P = 1e9: cpu_s = 0.75e9 / 2e9 = 0.375 s; link bytes each way
    1e9 * (12 * 0.25 + 2 * 0.75) = 4.5e9, over 40e9 B/s = 0.1125 s."""
    bench = _benchmark_module("host_rates")
    b = bench.split_bound(10**9, _host_rates(cpu=2.0, link=40.0), stream_fraction=0.25)
    assert (b.stream_fraction, b.cpu_s, b.link_s, b.seconds) == (0.25, 0.375, 0.1125, 0.375)
    with pytest.raises(ValueError, match="stream_fraction"):
        bench.split_bound(10**9, _host_rates(cpu=2.0, link=40.0), stream_fraction=1.5)


def test_host_rates_bound_step_s():
    bench = _benchmark_module("host_rates")
    assert bench.bound_step_s(0.3, 0.2) == 0.3  # the offloaded work hides in forward+backward
    assert bench.bound_step_s(0.15, 0.2) == 0.2  # it does not: it sets the step
    assert bench.bound_step_s(0.15, bench.split_bound(10**9, _host_rates(2.0, 40.0)).seconds) == (
        pytest.approx(0.2, rel=1e-12))


def _span(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_optim_trace_summarizes_one_step_per_stream():
    """Three steps traced (forward annotations at 0, 1000 and 2000 us); the middle window is
    1000..2000 us. Stream 7: two H2D copies (200 us each, 300 us apart) and a kernel that runs
    past the window's end (counted up to it); stream 9: a D2H before the window (left out)."""
    bench = _benchmark_module("optim_trace")
    ev = []
    for t in (0, 1000, 2000):
        ev += [_span("user_annotation", "forward", t, 100), _span("user_annotation", "backward", t + 100, 300),
               _span("user_annotation", "step", t + 400, 500), _span("user_annotation", "zero_grad", t + 900, 50)]
    ev += [_span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1100, 200, tid=7),
           _span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1600, 200, tid=7),
           _span("kernel", "fused_adamw", 1900, 300, tid=7),
           _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 500, 200, tid=9),
           _span("cpu_op", "aten::copy_", 1100, 50)]  # host ops are not stream work
    phases, work = bench.summarize(ev, step_index=1)
    assert [(p.name, p.start_ms, p.end_ms) for p in phases] == [
        ("forward", 0.0, 0.1), ("backward", 0.1, 0.4), ("step", 0.4, 0.9), ("zero_grad", 0.9, 0.95),
        ("forward", 1.0, 1.1)]
    assert [(w.stream, w.kind, w.busy_ms, w.first_ms, w.last_ms, w.ops, w.longest_gap_ms) for w in work] == [
        (7, "H2D", 0.4, 0.1, 0.8, 2, 0.3), (7, "kernel", 0.1, 0.9, 1.0, 1, 0.0)]


def test_optim_trace_timeline_splits_work_over_its_bins():
    """The middle window is 1000..2000 us in 500 us bins: an H2D copy on stream 7 from 1250 to
    1750 us is half of each bin; a kernel on stream 9 from 900 to 1100 us counts only from the
    window's start (100 of the first bin's 500 us); host ops are no stream's work."""
    bench = _benchmark_module("optim_trace")
    ev = [_span("user_annotation", "forward", t, 10) for t in (0, 1000, 2000)]
    ev += [_span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1250, 500, tid=7),
           _span("kernel", "k", 900, 200, tid=9), _span("cpu_op", "aten::copy_", 1000, 900)]
    names, rows = bench.timeline(ev, step_index=1, bin_ms=0.5)
    assert names == ["H2D@7", "kernel@9"]
    assert rows == [[0.0, 50.0, 20.0], [0.5, 50.0, 0.0]]
    with pytest.raises(ValueError,
                       match=r"timeline needs 3 forward annotations \(trace 3 steps or more\), found 2"):
        bench.timeline(ev[:2], step_index=1)
    with pytest.raises(SystemExit):
        bench.parse_args(["--bins", "-1"])


@pytest.mark.parametrize("overlap", ["none", "backward_update"])
def test_optim_trace_clock_times_every_cpu_bucket_update_and_restores_the_method(overlap):
    """Every offloaded parameter of the simulated CPU part is counted once per step; updates
    inside ``step()`` (``"none"``) start without undo copies (those started in backward may or
    may not, as the worker's timing falls); leaving the clock puts ``CpuBucket.update`` back."""
    import cpu_offload
    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.cpu_update import CpuBucket

    bench = _benchmark_module("optim_trace")
    original = CpuBucket.update
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, overlap=overlap, stream_fraction=0,
                                lr=1e-3, device=cpu_offload.SimulatedDevice())
    try:
        with bench.CpuUpdateClock() as clock:
            assert CpuBucket.update is not original
            for _ in range(3):
                model(torch.randn(8, 32)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        summary = clock.summary(3)
    finally:
        opt.close()
    assert CpuBucket.update is original
    total = sum(p.numel() for p in model.parameters())
    assert summary["all_params_per_step"] == total
    assert summary["kept_params_per_step"] + summary["plain_params_per_step"] == total
    if overlap == "none":
        assert summary["kept_params_per_step"] == 0
    assert summary["all_busy_ms_per_step"] > 0 and summary["all_g_params_per_s"] > 0


@pytest.mark.parametrize("count_calls", [False, True])
@pytest.mark.parametrize("during_backward", [False, True])
def test_optim_trace_chunk_clock_counts_every_streamed_chunk_where_it_was_queued(during_backward, count_calls):
    """Every chunk of a part that streams everything is queued once per step: inside ``step()``,
    or in backward with ``stream_during_backward`` (kept there: nothing changed the gradients);
    leaving the clock puts both methods back. With ``count_calls`` each launch also counts the
    torch operations it dispatched (none otherwise), and counting changes no result: the
    parameters equal those of the same steps without the clock, bit for bit."""
    import cpu_offload
    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.stream_backward import BackwardUpdates
    from cpu_offload.optim.stream_update import StreamedPart

    bench = _benchmark_module("optim_trace")
    originals = (StreamedPart._queue_chunk, BackwardUpdates._launch)

    def run(clock):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]).to(torch.bfloat16)
        opt = HybridDeviceOptimizer(model.parameters(), 1.0, overlap="backward_update", stream_fraction=1.0,
                                    stream_budget_bytes=98304, stream_during_backward=during_backward,
                                    lr=1e-3, device=cpu_offload.SimulatedDevice())
        chunks = len(opt._parts[0].chunks)
        try:
            model(torch.randn(8, 32, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()  # the first step creates the state: no early update before it
            opt.zero_grad()
            with clock:
                for _ in range(3):
                    model(torch.randn(8, 32, dtype=torch.bfloat16)).float().square().mean().backward()
                    opt.step()
                    opt.zero_grad()
        finally:
            opt.close()
        return chunks, [p.detach().clone() for p in model.parameters()]

    clock = bench.ChunkLaunchClock(count_calls=count_calls)
    chunks, params = run(clock)
    summary = clock.summary(3)
    assert (StreamedPart._queue_chunk, BackwardUpdates._launch) == originals
    assert chunks > 1
    where, other = ("backward", "step") if during_backward else ("step", "backward")
    assert summary[f"{where}_chunks_per_step"] == chunks
    assert summary[f"{other}_chunks_per_step"] == 0
    assert summary[f"{where}_median_ms"] > 0
    assert summary[f"{where}_ms_per_step"] >= summary[f"{where}_median_ms"]
    counts = [n for _, _, n in clock.calls]
    if count_calls:
        assert min(counts) > 0 and summary[f"{where}_median_torch_calls"] == statistics.median(counts)
    else:
        assert counts == [0] * len(counts) and summary[f"{where}_median_torch_calls"] == 0
    _, unclocked = run(contextlib.nullcontext())
    assert all(torch.equal(a, b) for a, b in zip(params, unclocked))


def test_optim_trace_needs_a_window():
    bench = _benchmark_module("optim_trace")
    ev = [_span("user_annotation", "forward", t, 10) for t in (0, 100)]
    with pytest.raises(ValueError, match=r"needs 3 forward annotations \(trace 3 steps or more\), found 2"):
        bench.summarize(ev, step_index=1)
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--stream-fraction", "most"])
    with pytest.raises(SystemExit):  # the same check as optim_benchmark.py's
        bench.parse_args(["--stream-fraction", "1.5"])
    assert bench.parse_args(["--stream-fraction", "0.5"]).stream_fraction == 0.5


def test_optim_trace_smoke_sim(tmp_path, capsys):
    import gzip
    import json

    bench = _benchmark_module("optim_trace")
    result = bench.main(["--device", "cpu", "--warmup", "1", "--steps", "3", "--out", str(tmp_path)])
    assert [p["name"] for p in result["phases"]] == ["forward", "backward", "step", "zero_grad", "forward"]
    assert result["streams"] == []  # the simulated device has no CUDA streams
    assert set(result["untraced_host_ms"]) == {"forward", "backward", "step", "zero_grad"}
    assert all(v > 0 for v in result["untraced_host_ms"].values())
    assert result["cpu_updates"]["all_params_per_step"] > 0  # the CPU part's updates were timed
    assert json.loads((tmp_path / "optim_trace_summary.json").read_text())["phases"] == result["phases"]
    assert json.loads(gzip.open(tmp_path / "optim_trace.json.gz").read())["traceEvents"]
    assert "untraced host ms per phase" in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(torch.distributed, "is_available") or not torch.distributed.is_available(),
                    reason="needs torch.distributed")
def test_fsdp2_host_overhead_smoke_cpu(capsys):
    from cpu_offload import compat

    if compat.TORCH_VERSION < compat.Version("2.8"):
        pytest.skip("FSDP2 runs on gloo from torch 2.8")
    bench = _benchmark_module("fsdp2_host_overhead")
    r = bench.main(["--layers", "4", "--k", "1", "--steps", "2", "--rounds", "1"])
    # both wrappers offload the same activations; times are measured, not checked
    assert r["plain_offloaded"] == r["fsdp2_offloaded"] and r["plain_offloaded"][0] > 0, r
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("plain_ms", "fsdp2_ms")), r
    assert "offload ms x plain" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()  # its own process group, destroyed


def test_fsdp2_host_overhead_checks_k():
    bench = _benchmark_module("fsdp2_host_overhead")
    with pytest.raises(SystemExit):
        bench.parse_args(["--layers", "4", "--k", "4"])


@pytest.mark.parametrize("name", ["plain_table", "launch_queue_probe", "optim_trace", "optim_benchmark",
                                  "ab_trees"])
def test_probe_docstring_examples_run(name):
    """The examples in these modules' docstrings run (``benchmarks/`` is outside the doctest
    collection of ``setup.cfg``)."""
    import doctest

    result = doctest.testmod(_benchmark_module(name))
    assert result.attempted > 0 and result.failed == 0


def test_launch_queue_probe_finds_the_first_blocked_launch(capsys):
    bench = _benchmark_module("launch_queue_probe")
    assert bench.first_blocked([4e-6, 9e-6, 2e-3, 0.3]) == 2
    assert bench.first_blocked([4e-6, 9e-4]) is None
    assert bench.first_blocked([4e-6, 9e-4], threshold_s=5e-4) == 1
    if not torch.cuda.is_available():
        assert bench.main([]) == []
        assert "needs CUDA" in capsys.readouterr().out


def test_gil_probe_times_every_case_and_restores_the_switch_interval(capsys):
    import sys

    bench = _benchmark_module("gil_probe")
    before = sys.getswitchinterval()
    rows = bench.main(["--elems", "4096", "--chunk", "1024", "--threads", "1", "--rounds", "1",
                       "--intervals-ms", "2"])
    assert sys.getswitchinterval() == before
    assert [(r["path"], r["main thread"]) for r in rows] == [
        (path, case) for path in ("kernel", "optimizer") for case in bench.CASES]
    assert rows[0]["x idle"] == 1.0 and all(r["update ms"] > 0 for r in rows)
    assert "x idle" in capsys.readouterr().out


def test_undo_probe_paths_make_the_same_update_and_print_the_table(capsys):
    """The three paths differ only in where the step runs: same new parameters, bit for bit."""
    import torch

    bench = _benchmark_module("undo_probe")
    outs = []
    for path in ("plain", "undo copy", "spare"):
        t = bench.make(10_000)
        for _ in range(2):
            bench.run(path, t, 4096, torch.empty(4096), [torch.zeros(())])
            if path == "spare":  # the spare side becomes current, as the CPU part swaps them
                for a, b in (("p", "sp"), ("m", "sm"), ("v", "sv")):
                    t[a], t[b] = t[b], t[a]
        outs.append(t["out16"])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    rates = bench.main(["--elems", "8192", "--chunk-mib", "0.01", "--threads", "1", "--rounds", "1"])
    assert list(rates) == ["plain", "undo copy", "spare"] and all(r[0] > 0 for r in rates.values())
    assert "median rate / plain" in capsys.readouterr().out


def test_gil_probe_chunked_update_is_fused_adamw_over_the_whole_bucket():
    """Both paths compute what one fused AdamW step over the whole bucket does."""
    bench = _benchmark_module("gil_probe")
    whole = bench.ChunkedUpdate(5000, 5000)
    whole.run()
    assert torch.isfinite(whole.master).all() and whole.master.abs().sum() > 0
    for optimizer in (False, True):
        chunked = bench.ChunkedUpdate(5000, 1024, optimizer=optimizer)
        chunked.grad.copy_(whole.grad)
        chunked.run()
        assert torch.equal(chunked.master, whole.master), optimizer
        assert torch.equal(chunked.param, whole.param), optimizer


def test_ab_trees_summary_gives_each_trees_median_and_its_ratio_to_the_first():
    ab = _benchmark_module("ab_trees")
    runs = {"old": [{"plain": 100.0, "split": 160.0}, {"plain": 102.0, "split": 170.0},
                    {"plain": 101.0, "split": 150.0}],
            "new": [{"plain": 100.0, "split": 120.0}, {"plain": 100.0, "split": None}, {}]}
    got = {(s["row"], s["arm"]): s for s in ab.summarize(["old", "new"], runs)}
    assert list(got) == [("plain", "old"), ("plain", "new"), ("split", "old"), ("split", "new")]
    old, new = got["split", "old"], got["split", "new"]
    assert old["rounds_ms"] == [160.0, 170.0, 150.0] and old["median_ms"] == 160.0
    assert old["vs_first"] == 1.0 and old["x_plain"] == 1.6  # of 1.6, 1.667, 1.485
    # a failed row and a failed run count as missing rounds, not as zeros
    assert new["rounds_ms"] == [120.0, None, None] and new["median_ms"] == 120.0
    assert new["vs_first"] == 0.75 and new["x_plain"] == 1.2
    assert "failed" in ab.table(list(got.values()))


def test_ab_trees_runs_each_tree_from_its_own_code_interleaved_sim(tmp_path):
    ab = _benchmark_module("ab_trees")
    summary = ab.main(["--trees", "HEAD", ".", "--rounds", "2", "--out", str(tmp_path), "--",
                       "--device", "sim", "--no-microbench", "--no-probe", "--rows", "plain",
                       "--layers", "2", "--warmup", "1", "--iters", "1"])
    assert [(s["row"], s["arm"]) for s in summary] == [("plain", "HEAD"), ("plain", ".")]
    assert all(len(s["rounds_ms"]) == 2 and all(t > 0 for t in s["rounds_ms"]) for s in summary)
    assert (tmp_path / "tree0" / "cpu_offload" / "__init__.py").exists()  # HEAD, unpacked
    assert ab.unpack(str(tmp_path / "tree0"), tmp_path / "unused") == (tmp_path / "tree0").resolve()
    assert json.loads((tmp_path / "ab_trees.json").read_text())["summary"] == summary


def test_ab_trees_compares_options_on_one_tree_sim(tmp_path):
    """``--variant``: arms of one tree that differ by options, each run with its own."""
    ab = _benchmark_module("ab_trees")
    summary = ab.main(["--variant", "one=--iters 1", "--variant", "two=--iters 2", "--rounds", "1",
                       "--out", str(tmp_path),
                       "--", "--device", "sim", "--no-microbench", "--no-probe", "--rows", "plain",
                       "--layers", "2", "--warmup", "1"])
    assert [s["arm"] for s in summary] == ["one", "two"]
    runs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("run*/optim_benchmark_sim.json"))]
    assert [r["args"]["iters"] for r in runs] == [1, 2]


def test_ab_trees_refuses_what_it_cannot_compare(tmp_path, capsys):
    ab = _benchmark_module("ab_trees")
    with pytest.raises(SystemExit):
        ab.parse_args(["--trees", "HEAD"])
    assert "compare at least two arms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["--variant", "--iters 2", "--variant", "b=--iters 3"])
    assert "--variant takes NAME=ARGS, got '--iters 2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["--trees", "HEAD", ".", "--", "--out", "x"])
    assert "give --out before '--'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="would import cpu_offload from"):
        ab.check_imports(tmp_path)  # no package there: another copy (or none) would answer
    with pytest.raises(SystemExit, match="git archive 'no-such-revision' failed"):
        ab.unpack("no-such-revision", tmp_path / "t")
    with pytest.raises(SystemExit, match="holds no benchmarks/optim_benchmark.py"):
        ab.unpack(str(tmp_path), tmp_path / "t")
