"""Issue 27, defects 5, 7 and 8 and the fresh-machine list (errors and silence): selective
recomputation when a recipe's input changes in place, steps that never call backward, errors
that named the wrong thing, strings for booleans, and plans with nothing to offload."""
from __future__ import annotations

import contextlib
import dataclasses
import doctest
import random
import time
import types

import pytest
import torch
from torch import nn

import cpu_offload
import cpu_offload.v1
import cpu_offload.v2
from cpu_offload import (
    ActivationOffloadConfig,
    OffloadConfigError,
    OffloadUsageError,
    OptimizerOffloadConfig,
    SimulatedDevice,
    apply_offloading,
    get_cpu_offload_context,
    plan_offloading,
)
from cpu_offload.plan import profile as sp
from cpu_offload.v2.stats import StepStats

from _support.parity_models import EXPECTED_WARNINGS

pytestmark = EXPECTED_WARNINGS


def run_step(layers, x0, pick=lambda out: out):
    """Zero grads, forward through ``layers`` (``pick`` takes the hidden state of an output),
    backward; returns the output, the input's gradient and every parameter's gradient."""
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    h = x
    for layer in layers:
        h = pick(layer(h))
    h.square().sum().backward()
    return [h.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]


def assert_equal(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


# --- D5: selective recomputation, a recipe's input changed in place ------------------------------


class TanhThenInPlace(nn.Module):
    """Issue 27's layer: ``tanh`` saves its output, a recipe on ``a``, which the model then
    legally changes in place (nothing saved ``a``). Tiny, so ``a`` is held as it is."""

    def __init__(self, width: int, module_tanh: bool) -> None:
        super().__init__()
        self.l, self.n, self.act = nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh()
        self.module_tanh = module_tanh

    def forward(self, x):
        a = self.n(self.l(x))
        t = self.act(a) if self.module_tanh else torch.tanh(a)
        a.mul_(0.5)
        return t * 3 + a + x


@pytest.mark.parametrize("scope", ["modules", "layer"])
@pytest.mark.parametrize("k", [0, 1])
def test_d5_a_recipe_input_changed_in_place_later_in_the_forward_stores_the_output(scope, k, sim):
    torch.manual_seed(0)
    # The modules scope records only inside nn.Tanh; the layer scope also torch.tanh.
    layers = nn.ModuleList(TanhThenInPlace(16, module_tanh=scope == "modules") for _ in range(3))
    x0 = torch.randn(4, 16)
    ref = run_step(layers, x0)
    with apply_offloading(layers, num_layers=k, selective=True, selective_scope=scope,
                          min_tensor_size_to_offload=0, device=sim) as handle:
        for _ in range(2):
            assert_equal(run_step(layers, x0), ref)
        # Each layer's tanh output was stored (offloaded in the first k layers), not recomputed
        # (the LayerNorm's mean and rstd, 16 bytes each, still are).
        stats = handle.stats()
        tanh_bytes = 4 * 16 * 4
        assert all(stats.layers[i].recipe_bytes < tanh_bytes for i in range(3))
        assert all(stats.layers[i].copied_out_bytes >= tanh_bytes for i in range(k))
    assert_equal(run_step(layers, x0), ref)


class ChangedBeforeSaved(nn.Module):
    """A recipe (``a + 1``, nothing saved) whose tiny input changes before its output is saved
    (by ``sin``, which saves its input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)

    def forward(self, x):
        a = self.l(x)
        t = a + 1
        a.mul_(0.5)
        return t.sin() + a


def test_d5_a_recipe_input_changed_before_its_output_is_saved_is_not_rerun(sim):
    torch.manual_seed(0)
    layers = nn.ModuleList(ChangedBeforeSaved(16) for _ in range(3))
    x0 = torch.randn(4, 16)
    ref = run_step(layers, x0)
    with apply_offloading(layers, num_layers=1, selective=True, selective_scope="layer",
                          min_tensor_size_to_offload=0, device=sim) as handle:
        assert_equal(run_step(layers, x0), ref)
        assert handle.stats().to_dict()["recipe_tensors"] == 0


class ChangesItsInputAfterwards(nn.Module):
    """Recomputes ``tanh(x)`` from its (tiny) input, which the caller changes after the layer."""

    def forward(self, x):
        return torch.tanh(x) * 2


def test_d5_a_held_input_changed_after_the_layer_raises_naming_the_fix(sim):
    layers = nn.ModuleList(ChangesItsInputAfterwards() for _ in range(2))
    handle = apply_offloading(layers, num_layers=0, selective=True, selective_scope="layer",
                              min_tensor_size_to_offload=0, device=sim)
    x = torch.randn(4, 4, requires_grad=True)
    h = x * 1.0
    out = layers[1](layers[0](h))
    h.add_(1.0)  # after layer 0's forward, which recomputes its tanh output from h
    with pytest.raises(RuntimeError, match=r"leave the layer out of apply_offloading\(selective"):
        out.sum().backward()
    handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["modules", "layer"])
def test_gpu_d5_an_output_stored_at_the_layer_end_is_offloaded_and_exact(scope, deterministic):
    """On CUDA: the tanh output stored at the end of the layer's forward goes through the
    layer's batched device-to-host copies (queued after the compute that made it), is
    released and reloaded, and the gradients are bit-identical."""
    torch.manual_seed(0)
    layers = nn.ModuleList(
        TanhThenInPlace(16, module_tanh=scope == "modules") for _ in range(4)).cuda()
    x0 = torch.randn(4, 16, device="cuda")
    ref = run_step(layers, x0)
    with apply_offloading(layers, num_layers=2, selective=True, selective_scope=scope,
                          min_tensor_size_to_offload=0) as handle:
        for _ in range(3):
            assert_equal(run_step(layers, x0), ref)
        stats = handle.stats()
        assert all(stats.layers[i].copied_out_bytes >= 4 * 16 * 4 for i in range(2))
        assert all(stats.layers[i].freed_bytes > 0 for i in range(2))
    torch.cuda.synchronize()


# --- D7: a step_fn without backward --------------------------------------------------------------


def linear_layers(n=4, width=8):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(width, width) for _ in range(n))


def test_d7_plan_offloading_refuses_a_step_that_never_calls_backward(sim):
    layers = linear_layers()
    x0 = torch.randn(2, 8)

    def forward_only():
        h = x0.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        return h.sum()

    with pytest.raises(OffloadConfigError, match=r"no backward reached the layers.*backward\(\)"):
        plan_offloading(forward_only, layers, 0.8, device=sim, min_tensor_size_to_offload=1,
                        link_gbps=1.0)
    assert all(type(m) is nn.Linear for m in layers)


# --- D8: errors that named the wrong thing -------------------------------------------------------


def test_d8_a_layer_called_twice_in_one_forward_is_named(sim):
    layers = linear_layers()
    handle = apply_offloading(layers, num_layers=1, min_tensor_size_to_offload=0, device=sim)
    x = torch.randn(2, 8, requires_grad=True)
    h = layers[0](x)
    with pytest.raises(OffloadUsageError, match=r"layer 0 \(Linear\) ran again.*called twice"):
        layers[0](h)
    handle.remove()


def test_d8_an_extra_call_after_the_last_layer_names_the_layers_not_model_layers(sim):
    layers = linear_layers()
    handle = apply_offloading(layers, num_layers=1, min_tensor_size_to_offload=0, device=sim)
    x = torch.randn(2, 8, requires_grad=True)
    h = x
    for i in (0, 1, 2, 3, 0):
        h = layers[i](h)
    with pytest.raises(OffloadUsageError, match="after 1 of the 4 layers given to apply_offloading") as info:
        h.sum().backward()
    assert "model_layers" not in str(info.value)
    handle.remove()


class HiddenSecond(nn.Module):
    """Returns ``(side, hidden)``: the documented hidden state (the first tensor) is not what
    the model passes on."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        y = self.l(x)
        return y * 2, y


def test_d8_a_tuple_whose_first_tensor_does_not_reach_the_loss_is_named(sim):
    torch.manual_seed(0)
    layers = nn.ModuleList(HiddenSecond() for _ in range(4))
    handle = apply_offloading(layers, num_layers=1, min_tensor_size_to_offload=0, device=sim)
    h = torch.randn(2, 8, requires_grad=True)
    h = layers[0](h)[1]
    with pytest.raises(OffloadUsageError, match=r"layer 0's hidden state.*was dropped.*first in a tuple"):
        layers[1](h)
    handle.remove()


def test_d8_the_wrong_tensor_through_the_sync_function_is_named_in_backward(sim):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4,
                                        min_tensor_size_to_offload=0, device=sim)
    x = torch.randn(2, 8, requires_grad=True)
    for layer in layers:
        with ctx:
            y = layer(x)
            side = y * 2
        sync(side)  # not the tensor the next layer takes
        del side
        x = y
    with pytest.raises(OffloadUsageError, match=r"given up after 1 of 4 layers.*sync function") as info:
        x.sum().backward()
    assert "exception inside" not in str(info.value)


def test_d8_a_parent_and_its_child_in_one_layers_list_are_refused_at_apply_time(sim):
    inner = nn.Linear(8, 8)
    layers = [nn.Sequential(inner, nn.Tanh()), inner, nn.Linear(8, 8)]
    with pytest.raises(OffloadConfigError,
                       match=r"layers\[0\] \(Sequential\) contains layers\[1\] \(Linear\)"):
        apply_offloading(layers, num_layers=1, device=sim)
    assert type(inner) is nn.Linear


def test_d8_a_step_running_2_of_4_layers_is_told_so(sim):
    layers = linear_layers()
    x0 = torch.randn(2, 8)

    def half_step():
        h = x0.clone().requires_grad_()
        for layer in layers[:2]:
            h = layer(h)
        h.sum().backward()

    with pytest.raises(OffloadConfigError, match=r"ran 2 of the 4 layers given.*every layer must run once per step") as info:
        plan_offloading(half_step, layers, 0.8, device=sim, min_tensor_size_to_offload=1,
                        link_gbps=1.0)
    assert "model_layers" not in str(info.value)


@dataclasses.dataclass
class Out:
    note: str
    hidden: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    hidden: torch.Tensor


class DataclassLayer(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.frozen = frozen

    def forward(self, x):
        h = torch.tanh(self.l(x)) + x
        return FrozenOut(h) if self.frozen else Out("layer", h, h.sum())


@pytest.mark.filterwarnings("ignore:cpu_offload \\(V1\\). a step saved:UserWarning")
@pytest.mark.parametrize("backend_name", ["v2", "v1"])
@pytest.mark.parametrize("frozen", [False, True])
def test_d8_dataclass_outputs_are_supported_exactly(frozen, backend_name, sim, monkeypatch):
    if backend_name == "v1":
        monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    torch.manual_seed(0)
    layers = nn.ModuleList(DataclassLayer(frozen) for _ in range(4))
    x0 = torch.randn(2, 8)
    pick = lambda out: out.hidden  # noqa: E731
    ref = run_step(layers, x0, pick)
    kwargs = {} if backend_name == "v1" else {"min_tensor_size_to_offload": 0}
    with apply_offloading(layers, num_layers=2, device=sim, **kwargs):
        for _ in range(2):
            assert_equal(run_step(layers, x0, pick), ref)
    if backend_name == "v2":  # V1 offloads only tensors tagged with mark_activation_offload
        assert len(sim.copies("d2h")) > 0


@dataclasses.dataclass
class NoTensor:
    value: float


def test_d8_a_dataclass_without_a_tensor_field_is_named_as_a_dataclass(sim):
    class Layer(nn.Module):
        def forward(self, x):
            return NoTensor(1.0)

    layers = nn.ModuleList(Layer() for _ in range(2))
    with apply_offloading(layers, num_layers=1, device=sim):
        with pytest.raises(TypeError, match="the dataclass NoTensor, which has no tensor field"):
            layers[0](torch.randn(2, requires_grad=True))


def test_d8_a_reload_num_error_carries_a_reload_hint(sim):
    with pytest.raises(OffloadConfigError, match=r"reload_num must be .*reload_num <= 3\)") as info:
        get_cpu_offload_context(enabled=True, model_layers=4, device=sim,
                                synchronization_dict={1: (True, 3, False, 9)})
    assert "offload_num" not in str(info.value)


# --- fresh machine: flags must be bools, counts ints ---------------------------------------------


def _plan(**kwargs):
    layers = linear_layers()
    return plan_offloading(lambda: None, layers, 0.8, device=SimulatedDevice(), **kwargs)


@pytest.mark.parametrize("call, name", [
    (lambda: get_cpu_offload_context(enabled="False", num_layers=1, model_layers=2), "enabled"),
    (lambda: get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                     retain_pinned_cpu_buffers="False",
                                     device=SimulatedDevice()), "retain_pinned_cpu_buffers"),
    (lambda: get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, verify="yes",
                                     device=SimulatedDevice()), "verify"),
    (lambda: get_cpu_offload_context(enabled=False, manual_synchronization="no"),
     "manual_synchronization"),
    (lambda: cpu_offload.v1.get_cpu_offload_context(enabled="False"), "enabled"),
    (lambda: cpu_offload.v1.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                    double_buffering="yes"), "double_buffering"),
    (lambda: cpu_offload.v2.get_cpu_offload_context(enabled="True"), "enabled"),
    (lambda: apply_offloading(linear_layers(), num_layers=1, selective="true",
                              device=SimulatedDevice()), "selective"),
    (lambda: apply_offloading(linear_layers(), num_layers=1, device=SimulatedDevice(),
                              retain_pinned_cpu_buffers="False"), "retain_pinned_cpu_buffers"),
    (lambda: _plan(partial="no"), "partial"),
    (lambda: _plan(spread="yes"), "spread"),
    (lambda: _plan(selective="true"), "selective"),
    (lambda: _plan(warmup=True), "warmup"),
    (lambda: _plan(repeats="3"), "repeats"),
    (lambda: _plan(min_tensor_size_to_offload="1"), "min_tensor_size_to_offload"),
    (lambda: OptimizerOffloadConfig(optimizer_cpu_offload=True, fp16="False").validate(), "fp16"),
    (lambda: OptimizerOffloadConfig(optimizer_cpu_offload=True,
                                    use_distributed_optimizer="False").validate(),
     "use_distributed_optimizer"),
    (lambda: cpu_offload.build_offload_context(
        ActivationOffloadConfig(num_layers=4, cpu_offloading=True, cpu_offloading_num_layers=1),
        device=SimulatedDevice(), verify="no"), "verify"),
    (lambda: cpu_offload.mark_activation_offload(torch.ones(1), offload="no"), "offload"),
    (lambda: cpu_offload.v1.mark_activation_offload(torch.ones(1), offload="no"), "offload"),
])
def test_flags_must_be_bools_and_counts_ints_naming_the_argument(call, name):
    with pytest.raises(OffloadConfigError, match=rf"\b{name} must be (True|an int|the|None)"):
        call()


@pytest.mark.parametrize("call, name", [
    (lambda: get_cpu_offload_context(enabled=True, num_layers=True, model_layers=3,
                                     device=SimulatedDevice()), "num_layers"),
    (lambda: get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3,
                                     min_tensor_size_to_offload=True,
                                     device=SimulatedDevice()), "min_tensor_size_to_offload"),
    (lambda: apply_offloading(linear_layers(), num_layers=True, device=SimulatedDevice()),
     "num_layers"),
    (lambda: ActivationOffloadConfig(num_layers=4, cpu_offloading=True,
                                     cpu_offloading_num_layers=True).validate(),
     "cpu_offloading_num_layers"),
])
def test_counts_refused_before_keep_naming_the_argument_through_the_shared_check(call, name):
    """Not defects of 57b48a0 (these were refused already): the shared check keeps them."""
    with pytest.raises(OffloadConfigError, match=rf"\b{name} must be (an int|the)"):
        call()


def test_strings_for_booleans_never_switch_offloading_on_under_v1(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError, match="enabled must be True or False, got 'False'"):
        get_cpu_offload_context(enabled="False", num_layers=1, model_layers=2)


def test_leaving_out_model_layers_names_model_layers_len_layers(backend):
    with pytest.raises(OffloadConfigError, match=r"model_layers=len\(layers\)") as info:
        get_cpu_offload_context(enabled=True, num_layers=2, device=SimulatedDevice())
    assert "<= -1" not in str(info.value)


def test_a_plan_with_nothing_to_offload_warns_prints_no_nan_and_has_empty_stats(sim):
    layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
    x0 = torch.randn(4, 16)

    def step():
        h = x0.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        h.sum().backward()

    with pytest.warns(UserWarning, match="nothing to offload: every saved tensor is below "
                                         "min_tensor_size_to_offload"):
        plan = plan_offloading(step, layers, 0.8, device=sim, link_gbps=1.0, repeats=1)
    assert plan.num_layers == 0 and plan.recompute == () and plan.selective == ()
    assert "nan" not in plan.describe() and plan.peak_ratio == 1.0
    with apply_offloading(layers, plan=plan, device=sim) as handle:
        step()
        stats = handle.stats()
    assert isinstance(stats, StepStats)
    assert stats.to_dict()["offloaded_tensors"] == 0 and "offloaded 0 saved tensors" in stats.summary()


class _JitteryTime:
    """``time`` with a host clock that jumps by up to 20 ms between readings: how a busy
    machine looks to the profiler."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.offset = 0.0

    def perf_counter(self) -> float:
        self.offset += self.rng.uniform(0.0, 0.02)
        return time.perf_counter() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


def test_the_documented_plan_offloading_example_plans_the_same_on_a_noisy_host(monkeypatch):
    test = doctest.DocTestFinder().find(plan_offloading, "plan_offloading", globs={})[0]
    source = "".join(ex.source for ex in test.examples)
    setup = source[:source.index("plan = cpu_offload.plan_offloading(")]
    call = source[source.index("plan = cpu_offload.plan_offloading("):]
    call = call[:call.index(")\n") + 2]
    plans = set()
    for seed in range(3):
        monkeypatch.setattr(sp, "time", _JitteryTime(seed))
        scope: dict = {}
        exec(setup + call, scope)  # noqa: S102 - the package's own docstring
        plan = scope["plan"]
        plans.add((plan.num_layers, plan.offloaded, plan.recompute, plan.selective,
                   plan.partial_fraction))
    assert len(plans) == 1, plans


def test_offload_arguments_without_enabled_warn_once_naming_enabled_true(monkeypatch):
    from cpu_offload import api as facade

    monkeypatch.setattr(facade, "_warned_not_enabled", False, raising=False)
    with pytest.warns(UserWarning, match=r"without enabled=True.*pass enabled=True"):
        ctx, sync = get_cpu_offload_context(num_layers=2, model_layers=4)
    assert isinstance(ctx, contextlib.nullcontext)  # the behaviour is kept
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_cpu_offload_context(num_layers=2, model_layers=4)  # once
        monkeypatch.setattr(facade, "_warned_not_enabled", False)
        get_cpu_offload_context(enabled=False, num_layers=2, model_layers=4)  # said on purpose
        get_cpu_offload_context()
