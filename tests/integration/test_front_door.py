"""What a first-time user tripped on (issue 40): every mistake gets an error that names the
function they called and the fix, raised where they made it, and NumPy integers count as ints."""
from __future__ import annotations

import pytest
import torch

import cpu_offload
from cpu_offload import OffloadConfigError

np = pytest.importorskip("numpy")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")


def layers_of(n: int = 4):
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(n))


def grads(layers, x0):
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    h = x * 1.0
    for layer in layers:
        h = torch.tanh(layer(h))
    h.sum().backward()
    return [x.grad] + [p.grad for p in layers.parameters()]


def test_apply_offloading_range_plan_and_keyword_errors_name_the_fix(sim):
    layers = layers_of(4)
    with pytest.raises(OffloadConfigError, match="num_layers=10 must be smaller than model_layers=4"):
        cpu_offload.apply_offloading(layers, num_layers=10, device=sim)  # was an IndexError
    with pytest.raises(OffloadConfigError, match=r"plan must be a Plan from cpu_offload\.plan_"
                                                 r"offloading\(.*got 'x' \(str\)"):
        cpu_offload.apply_offloading(layers, plan="x", device=sim)  # was an AttributeError
    with pytest.raises(TypeError, match=r"^apply_offloading\(\) got an unexpected keyword argument "
                                        r"'min_tensor_size' \(did you mean 'min_tensor_size_to_"
                                        r"offload'\?\)"):
        cpu_offload.apply_offloading(layers, num_layers=2, min_tensor_size=1024, device=sim)
    assert all(type(layer) is torch.nn.Linear for layer in layers)  # nothing was installed


def test_numpy_integers_are_counts_and_bools_are_not(sim):
    layers, x0 = layers_of(4), torch.randn(8, 16)
    expected = grads(layers, x0)
    handle = cpu_offload.apply_offloading(
        layers, num_layers=np.int64(2), selective=(np.int64(1),), min_tensor_size_to_offload=np.int32(1),
        device=sim)
    assert repr(handle) == "OffloadingHandle(installed: offload the first 2 of 4 layers, recompute [], selective [1])"
    assert all(map(torch.equal, grads(layers, x0), expected))
    handle.remove()
    handle = cpu_offload.apply_offloading(  # a synchronization_dict with NumPy keys and counts
        layers, synchronization_dict={np.int64(0): (True, np.int64(3), False, np.int64(3))},
        min_tensor_size_to_offload=1, device=sim)
    assert all(map(torch.equal, grads(layers, x0), expected))
    assert sim.milestones({"release", "reload"})[-2:] == [("release", 0), ("reload", 0)]
    handle.remove()
    ctx, sync, manual = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=np.int32(1), model_layers=np.int64(3), manual_synchronization=True,
        device=sim)
    with ctx:
        h = layers[0](x0)
    manual.start_offload_layer(np.int64(0))
    assert cpu_offload.plan.search.check_memory_budget(np.float32(0.5)) == 0.5
    assert type(cpu_offload.plan.search.check_memory_budget(np.int64(1 << 30))) is int
    for flag in (True, np.bool_(True)):
        with pytest.raises(OffloadConfigError, match="num_layers must be"):
            cpu_offload.apply_offloading(layers, num_layers=flag, device=sim)
    with pytest.raises(OffloadConfigError, match=r"selective layers must be indices in \[0, 4\), "
                                                 r"got \[True\]"):
        cpu_offload.apply_offloading(layers, num_layers=1, selective=[True], device=sim)


def test_callback_arguments_are_checked_at_construction(sim):
    pytest.importorskip("transformers")
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(OffloadConfigError, match=r"memory_budget=2.0 as a float is a fraction"):
        OffloadCallback(memory_budget=2.0, device=sim)
    with pytest.raises(OffloadConfigError, match="num_layers must be .* got '2' \\(a string\\)"):
        OffloadCallback(num_layers="2", device=sim)
    with pytest.raises(OffloadConfigError, match="plan must be a Plan"):
        OffloadCallback(plan="x", device=sim)
    with pytest.raises(TypeError, match=r"OffloadCallback\(\) got an unexpected keyword argument "
                                        r"'min_tensor_size' \(did you mean"):
        OffloadCallback(num_layers=2, min_tensor_size=1024, device=sim)
    with pytest.raises(TypeError, match=r"'repeat' \(did you mean 'repeats'\?\).* plan_offloading"):
        OffloadCallback(memory_budget=0.5, plan_kwargs={"repeat": 1}, device=sim)
    with pytest.raises(TypeError, match="layers must be the model's layers"):
        OffloadCallback(num_layers=2, layers=3, device=sim)
    assert OffloadCallback(num_layers=np.int64(2), device=sim).num_layers == 2


def test_simulated_device_flags_are_bools():
    with pytest.raises(OffloadConfigError, match="defer must be True or False, got 'no'"):
        cpu_offload.SimulatedDevice(defer="no")
    with pytest.raises(OffloadConfigError, match="defer_launches must be True or False"):
        cpu_offload.SimulatedDevice(defer_launches=0)


@no_cuda
def test_missing_device_names_the_function_called():
    layers = layers_of(4)
    fix = "pass device=cpu_offload.SimulatedDevice\\(\\) to {}"
    with pytest.raises(RuntimeError, match=fix.format("apply_offloading")):
        cpu_offload.apply_offloading(layers, num_layers=1)
    with pytest.raises(RuntimeError, match=fix.format("get_cpu_offload_context")):
        cpu_offload.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4)
    with pytest.raises(RuntimeError, match=fix.format("plan_offloading")):
        cpu_offload.plan_offloading(lambda: None, layers, 0.5)
    pytest.importorskip("transformers")
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(RuntimeError, match=fix.format("OffloadCallback")):
        OffloadCallback(num_layers=2)
