"""Selective recomputation (``apply_offloading(..., selective=...)``): cheap saved tensors are
recomputed in backward from saved inputs instead of stored. Bit-exact against no offloading,
alone and with offloading, on the GPT block, a tiny HF Llama and adversarial layers."""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import OffloadConfigError, apply_offloading, get_cpu_offload_context
from cpu_offload.compat import current_dispatch_mode, top_saved_tensors_hooks
from cpu_offload.examples.gpt import build_model, make_input, tiny_config
from cpu_offload.v2 import recompute

from _support import gpt_cuda
from _support.parity_models import EXPECTED_WARNINGS, TrackingSimDevice, allocated_bytes

pytestmark = EXPECTED_WARNINGS


def gpt_step(layers, x0):
    layers.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_()
    h = x
    for layer in layers:
        h = layer(h)
    h.square().sum().backward()
    grads = [torch.zeros(0) if p.grad is None else p.grad.clone() for p in layers.parameters()]
    return [h.detach(), x.grad] + grads


def assert_equal(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def layer_bytes(stats, i):
    s = stats.layers[i]
    kept = s.skipped_bytes.get("too small", 0)
    return s.recipe_bytes, s.copied_out_bytes + s.recipe_bytes + kept


@pytest.mark.parametrize("k", [0, 2])
def test_gpt_blocks_recompute_norm_and_gelu_outputs_exactly(k, sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    ref = gpt_step(model.layers, x0)
    handle = apply_offloading(
        model.layers, num_layers=k, selective=True, min_tensor_size_to_offload=1024, device=sim
    )
    assert "selective [0, 1, 2, 3]" in repr(handle)
    for _ in range(2):
        assert_equal(gpt_step(model.layers, x0), ref)
    stats = handle.stats()
    d = stats.to_dict()
    # Per block: both LayerNorm outputs (1 + 1 units of batch*seq*hidden) and the GELU output
    # (4 units) are recomputed; the layer input, qkv, attention output, residual and fc1 output
    # (10 units) are stored (offloaded in the first k blocks).
    unit = cfg.batch * cfg.seq * cfg.hidden * 4
    assert [stats.layers[i].recipe_bytes for i in range(4)] == [6 * unit] * 4
    assert d["recipe_tensors"] == 4 * 3 and d["recomputed_bytes"] == 4 * 6 * unit
    assert [stats.layers[i].copied_out_bytes for i in range(4)] == [10 * unit] * k + [0] * (4 - k)
    assert "recomputed instead of stored (selective): 12 saved tensors" in stats.summary()
    handle.remove()
    assert_equal(gpt_step(model.layers, x0), ref)


class LinearNormLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def test_a_multi_output_op_is_rerun_once_for_all_its_recipe_outputs(sim):
    """LayerNorm saves its output (for the next Linear) and its mean and rstd (for its own
    backward): all three are recipes of one native_layer_norm call, rerun once per backward."""
    from cpu_offload.compat import TorchDispatchMode

    class CountNorms(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.native_layer_norm.default:
                CountNorms.calls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layers = nn.ModuleList(LinearNormLinear(16) for _ in range(3))
    x0 = torch.randn(8, 16)
    ref = gpt_step(layers, x0)
    handle = apply_offloading(layers, num_layers=0, selective=True, min_tensor_size_to_offload=1,
                              device=sim)
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    h = x
    for layer in layers:
        h = layer(h)
    with CountNorms():
        h.square().sum().backward()
    assert CountNorms.calls == 3  # one rerun per layer, not one per saved output
    d = handle.stats().to_dict()
    assert d["recipe_tensors"] == 3 * 3  # out, mean, rstd of each norm
    assert d["recomputed_bytes"] == 3 * (8 * 16 + 8 + 8) * 4
    assert_equal(gpt_step(layers, x0), ref)
    handle.remove()


def test_selective_and_offloading_move_fewer_bytes(sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    copied = {}
    for selective in (False, True):
        with apply_offloading(model.layers, num_layers=2, selective=selective,
                              min_tensor_size_to_offload=1024, device=TrackingSimDevice()) as h:
            gpt_step(model.layers, x0)
            copied[selective] = h.stats().to_dict()["copied_out_bytes"]
    assert copied[True] == copied[False] * 10 // 16


# --- a tiny Hugging Face Llama: RMSNorm in Python, chains of recipes -----------------------------


@pytest.mark.parametrize("scope", ["modules", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_llama_recomputes_rmsnorm_and_mlp_chains_exactly(dtype, scope, sim):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ref = step()
    layers = model.model.layers
    with apply_offloading(layers, num_layers=1, selective=True, min_tensor_size_to_offload=2048,
                          selective_scope=scope, device=sim) as handle:
        for _ in range(2):
            assert_equal(step(), ref)
        stats = handle.stats()
    tokens, size = ids.numel(), torch.finfo(dtype).bits // 8
    modules = (2 * cfg.hidden_size + cfg.intermediate_size) * tokens * size
    for i in range(3):
        removed, saved = layer_bytes(stats, i)
        if scope == "modules":  # both RMSNorm outputs and the SiLU output: the modules' outputs
            assert removed >= modules, (i, removed, saved)
        else:  # ... and the gated product, and chains inside RMSNorm
            assert removed >= saved // 4 and removed > modules, (i, removed, saved)


# --- adversarial layers -----------------------------------------------------------------------


class Case(nn.Module):
    """One layer whose forward is a small program given as a function of (self, x)."""

    def __init__(self, program, width=64):
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)
        self.w = nn.Parameter(torch.randn(width))
        self.program = program

    def forward(self, x):
        return self.program(self, x)


def run_case(program, sim, n=3, selective=True, num_layers=0, scope="layer"):
    """Three ``Case`` layers against the same without offloading; ``scope="layer"`` records
    the functional ops these programs call outside modules."""
    torch.manual_seed(0)
    layers = nn.ModuleList(Case(program) for _ in range(n))
    x0 = torch.randn(4, 16, 64)
    ref = gpt_step(layers, x0)
    handle = apply_offloading(layers, num_layers=num_layers, selective=selective,
                              selective_scope=scope, min_tensor_size_to_offload=256, device=sim)
    got = gpt_step(layers, x0)
    stats = handle.stats()
    handle.remove()
    assert_equal(got, ref)
    return stats


def test_a_recipe_output_changed_in_place_before_it_is_saved_is_stored(sim):
    def program(m, x):
        a = torch.nn.functional.gelu(m.lin1(x))
        a.mul_(2.0)  # the GELU recipe no longer describes a
        return m.lin2(a) + x

    assert run_case(program, sim).to_dict()["recipe_tensors"] == 0


def test_a_recipe_input_changed_before_it_is_saved_is_not_used(sim):
    def program(m, x):
        h = m.lin1(x)
        a = h * 3.0  # no input saved for this mul
        h.add_(1.0)
        g = h * m.w  # saves h at its new version
        return m.lin2(a) + g

    assert run_case(program, sim, num_layers=1).to_dict()["recipe_tensors"] == 0


def test_a_recipe_whose_input_is_not_saved_is_stored(sim):
    def program(m, x):
        a = m.lin1(x) * 2.0  # lin1's output is saved by nobody
        return m.lin2(a) + x

    assert run_case(program, sim, num_layers=2).to_dict()["recipe_tensors"] == 0


def test_views_and_transposes_of_recipe_outputs_come_back_exactly(sim):
    def program(m, x):
        u = m.lin1(x)
        a = torch.tanh(u) * m.w  # tanh saves its output; a = mul(tanh(u), w)
        b = a.transpose(-1, -2)  # saved by matmul as a transposed view
        s = torch.sigmoid(u)
        return m.lin2(s) + x @ (b @ s) * 1e-3

    stats = run_case(program, sim, num_layers=1)
    assert stats.to_dict()["recipe_tensors"] >= 1


def test_a_recipe_output_changed_after_it_was_saved_raises_as_autograd_does(sim):
    def program(m, x):
        a = torch.nn.functional.gelu(m.lin1(x))
        y = m.lin2(a)
        a.mul_(2.0)
        return y

    torch.manual_seed(0)
    layers = nn.ModuleList(Case(program) for _ in range(2))
    x0 = torch.randn(4, 16, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gpt_step(layers, x0)
    with apply_offloading(layers, num_layers=0, selective=True, min_tensor_size_to_offload=256,
                          device=sim):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gpt_step(layers, x0)


def test_dropout_outputs_are_never_recipes_and_stay_exact(sim):
    cfg = tiny_config().with_(dropout=0.1)
    model = build_model(cfg).train()
    x0 = make_input(cfg)
    torch.manual_seed(5)
    ref = gpt_step(model.layers, x0)
    with apply_offloading(model.layers, num_layers=1, selective=True,
                          min_tensor_size_to_offload=1024, device=sim) as handle:
        torch.manual_seed(5)
        assert_equal(gpt_step(model.layers, x0), ref)
        assert handle.stats().to_dict()["recipe_tensors"] > 0


def test_retain_graph_backward_twice_is_exact(sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)

    def twice():
        model.zero_grad(set_to_none=True)
        h = x0.detach()
        for layer in model.layers:
            h = layer(h)
        loss = h.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = twice()
    with apply_offloading(model.layers, num_layers=1, selective=True,
                          min_tensor_size_to_offload=1024, device=sim) as handle:
        assert_equal(twice(), ref)
        assert handle.stats().to_dict()["recomputed_bytes"] > handle.stats().to_dict()["recipe_bytes"]


class Boom(Exception):
    pass


def test_an_exception_mid_forward_leaves_no_hooks_no_mode_and_holds_nothing(sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    ref = gpt_step(model.layers, x0)
    fail = {"on": True}

    def boom(module, args, out):
        if fail["on"]:
            raise Boom()

    hook = model.layers[2].ln2.register_forward_hook(boom)
    entries = []
    real_init = recompute.RecomputeEntry.__init__

    def tracking_init(self, *a, **kw):
        real_init(self, *a, **kw)
        entries.append(weakref.ref(self))

    recompute.RecomputeEntry.__init__ = tracking_init
    try:
        with apply_offloading(model.layers, num_layers=2, selective=True,
                              min_tensor_size_to_offload=1024, device=sim):
            with pytest.raises(Boom):
                gpt_step(model.layers, x0)
            assert top_saved_tensors_hooks() is None and current_dispatch_mode() is None
            gc.collect()
            assert entries and all(e() is None for e in entries)
            fail["on"] = False
            assert_equal(gpt_step(model.layers, x0), ref)
    finally:
        recompute.RecomputeEntry.__init__ = real_init
        hook.remove()


def test_no_reference_cycles_and_no_entry_outlives_its_step(sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    ref = gpt_step(model.layers, x0)
    with apply_offloading(model.layers, num_layers=2, selective=True,
                          min_tensor_size_to_offload=1024, device=TrackingSimDevice()) as handle:
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                assert_equal(gpt_step(model.layers, x0), ref)
                selective = handle.synchronizer.step.selective
                assert all(e() is None for s in selective.values() for e in s.entries)
                assert handle.synchronizer.rt.device.live_device_buffers() == 0
            assert gc.collect() == 0
        finally:
            gc.enable()


def test_no_grad_forwards_record_nothing(sim):
    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    with apply_offloading(model.layers, num_layers=0, selective=True, device=sim):
        with torch.no_grad():
            h = x0
            for layer in model.layers:
                h = layer(h)
                assert current_dispatch_mode() is None


# --- scope: modules (the default) or the whole layer -------------------------------------------


def test_module_scope_records_only_inside_norm_and_activation_modules(sim):
    """The default scope pays the dispatch mode only inside norm and activation modules: a GELU
    module's output is recomputed, the same op called functionally outside modules is not."""

    def program(m, x):
        a = m.act(m.lin1(x))  # nn.GELU: recorded
        b = torch.nn.functional.gelu(m.lin1(x) * 0.5)  # functional, outside modules: not
        return m.lin2(a) + m.lin2(b) + x

    def with_act(program):
        def run(m, x):
            if not hasattr(m, "act"):
                m.act = nn.GELU()
            return program(m, x)
        return run

    modules = run_case(with_act(program), sim, scope="modules").to_dict()
    layer = run_case(with_act(program), sim, scope="layer").to_dict()
    assert modules["recipe_tensors"] == 3  # one GELU output per layer
    assert layer["recipe_tensors"] > modules["recipe_tensors"]


class Probe(nn.LayerNorm):
    """A LayerNorm (recomputable by type) that notes the dispatch mode it runs under and can
    fail inside its forward."""

    seen: list = []
    fail = False

    def forward(self, x):
        Probe.seen.append(current_dispatch_mode())
        out = super().forward(x)
        if Probe.fail:
            raise Boom()
        return out


def test_an_exception_inside_a_recorded_module_leaves_no_mode_and_no_module_hooks(sim):
    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 64), Probe(64), nn.Linear(64, 64)) for _ in range(3)
    )
    x0 = torch.randn(4, 16, 64)
    ref = gpt_step(layers, x0)
    Probe.seen.clear()
    with apply_offloading(layers, num_layers=1, selective=True,
                          min_tensor_size_to_offload=256, device=sim) as handle:
        assert_equal(gpt_step(layers, x0), ref)
        assert all(mode is not None for mode in Probe.seen)  # recorded inside every Probe
        assert handle.stats().to_dict()["recipe_tensors"] == 3
        Probe.fail = True
        try:
            with pytest.raises(Boom):
                gpt_step(layers, x0)
        finally:
            Probe.fail = False
        assert current_dispatch_mode() is None
        Probe.seen.clear()
        layers[0][1](x0)  # outside any layer's forward: no global hook enters the mode
        assert Probe.seen == [None]
        assert_equal(gpt_step(layers, x0), ref)
    Probe.seen.clear()
    layers[0](x0)
    assert Probe.seen == [None]


def test_which_modules_are_recorded_and_bad_scopes_name_the_fix(sim):
    class LlamaishRMSNorm(nn.Module):
        def forward(self, x):
            return x

    assert recompute.is_recomputable_module(nn.LayerNorm(4))
    assert recompute.is_recomputable_module(nn.SiLU())
    assert recompute.is_recomputable_module(LlamaishRMSNorm())
    assert not recompute.is_recomputable_module(nn.Linear(4, 4))
    assert not recompute.is_recomputable_module(nn.Dropout())
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    with pytest.raises(OffloadConfigError, match="'modules' records ops inside norm"):
        apply_offloading(layers, num_layers=1, selective=True, selective_scope="ops", device=sim)
    assert all(type(m) is nn.Linear for m in layers)


# --- misuse -------------------------------------------------------------------------------------


def test_bad_selective_arguments_name_the_fix(sim, monkeypatch):
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    with pytest.raises(OffloadConfigError, match=r"indices in \[0, 3\)"):
        apply_offloading(layers, num_layers=1, selective=[3], device=sim)
    with pytest.raises(OffloadConfigError, match="True .every layer. or layer indices"):
        apply_offloading(layers, num_layers=1, selective=3, device=sim)
    plan = cpu_offload.plan.Plan(0, (1,))
    with pytest.raises(OffloadConfigError, match="both checkpointed .recompute. and selective"):
        apply_offloading(layers, plan=plan, selective=[1], device=sim)
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError, match="needs the V2 backend"):
        apply_offloading(layers, num_layers=1, selective=True)
    assert all(type(m) is nn.Linear for m in layers)


def test_compiled_layers_are_refused(sim):
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    layers[1].compile()
    with pytest.raises(OffloadConfigError, match="compiled with torch.compile"):
        apply_offloading(layers, num_layers=1, selective=True, device=sim)
    with apply_offloading(layers, num_layers=1, selective=[0, 2], device=sim) as handle:
        assert handle.selective == (0, 2)


# --- planning -----------------------------------------------------------------------------------


def test_the_real_step_profile_measures_what_selective_removes_and_plans_apply_exactly(sim):
    from cpu_offload.plan import profile_step, search
    from cpu_offload.plan.model import FREE_HOST

    cfg = tiny_config()
    model = build_model(cfg)
    x0 = make_input(cfg)
    ref = gpt_step(model.layers, x0)
    prof = profile_step(lambda: gpt_step(model.layers, x0), model.layers, device=sim,
                        min_tensor_size_to_offload=1024, link_gbps=0.01, warmup=0, repeats=1)
    unit = cfg.batch * cfg.seq * cfg.hidden * 4
    assert [p.selective_bytes for p in prof.layers] == [6 * unit] * 4
    assert all(p.activation_bytes == 16 * unit for p in prof.layers[1:])
    # Host times on the simulated device are noise: plan with fixed ones (checkpointing a
    # layer costs 1 ms, its selective recomputation 0.1 ms), the measured bytes. Every time the
    # planner reads is pinned: a measured recompute_ms (what checkpointing added to backward)
    # would replace fwd_ms as the checkpoint cost, and where noise made it below 0.1 ms the plan
    # checkpointed instead of going selective (about 1 run in 6 under load).
    prof.layers = [replace(p, fwd_ms=1.0, bwd_ms=2.0, selective_ms=0.1, selective_fwd_ms=0.0,
                           recompute_ms=None, host_fwd_ms=None)
                   for p in prof.layers]
    prof.step_ms = 12.0
    prof.offload_ms_per_gb = 0.0  # the offload probe's host time is noise here too
    prof.offload_host_cost = FREE_HOST
    plan = search.plan(prof, 0.7)  # the link is too slow to offload: recompute
    assert plan.selective and plan.peak_ratio <= 0.7
    assert f"selective layers: {', '.join(map(str, plan.selective))}" in plan.describe()
    with apply_offloading(model.layers, plan=plan, device=sim) as handle:
        assert handle.selective == plan.selective
        assert_equal(gpt_step(model.layers, x0), ref)
        assert handle.stats().to_dict()["recipe_bytes"] == 6 * unit * len(plan.selective)
    no_sel = profile_step(lambda: gpt_step(model.layers, x0), model.layers, device=sim,
                          min_tensor_size_to_offload=1024, warmup=0, repeats=1, selective=False)
    assert all(p.selective_bytes == 0 for p in no_sel.layers)


# --- on CUDA (marked gpu): the GPT stack of _support/gpt_cuda.py, real streams and kernels ---


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("k", [0, 2])
def test_selective_recompute_is_bit_identical_and_lowers_peak(gpt_model, gpt_x0, k):
    """Selective recomputation on real kernels: LayerNorm and GELU reruns give the same bits,
    and the stored bytes (6 of 16 units per block) come off the peak."""
    ref = gpt_cuda.step(gpt_model, gpt_x0)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=k, model_layers=gpt_cuda.CFG.layers)
    for _ in range(2):
        gpt_cuda.assert_bit_identical(gpt_cuda.step(gpt_model, gpt_x0, ctx, sync), ref)
    peaks = {}
    for selective in (False, True):
        ctx.synchronizer.set_selective(range(gpt_cuda.CFG.layers) if selective else ())
        gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
        torch.cuda.synchronize()
        before = allocated_bytes()
        torch.cuda.reset_peak_memory_stats()
        got = gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
        torch.cuda.synchronize()
        peaks[selective] = torch.cuda.max_memory_allocated() - before
        if selective:
            gpt_cuda.assert_bit_identical(got, ref)
            unit = gpt_cuda.CFG.batch * gpt_cuda.CFG.seq * gpt_cuda.CFG.hidden * 2
            stats = ctx.stats()
            layers = range(gpt_cuda.CFG.layers)
            assert all(stats.layers[i].recipe_bytes == 6 * unit for i in layers)
    assert peaks[True] < peaks[False]
