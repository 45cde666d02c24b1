"""Every documented misuse: exact error type, and a message naming the fix.

All through the public facade, on the simulated device, so CI without a GPU checks them. The
misuses common to both backends are checked on both (``backend`` fixture); V2-only arguments and the
extra checks of V2's context are checked on V2.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_offload import (
    OffloadConfigError,
    OffloadUsageError,
    SimulatedDevice,
    get_cpu_offload_context,
    mark_activation_offload,
)
from cpu_offload.compat import top_saved_tensors_hooks


def context(**kwargs):
    kwargs.setdefault("enabled", True)
    kwargs.setdefault("device", SimulatedDevice())
    return get_cpu_offload_context(**kwargs)


def copies(device: SimulatedDevice) -> int:
    return sum(1 for e in device.log if e[0] == "copy")


# --- context used out of order -----------------------------------------------------------------


# The offloaded layer's saved input is the caller's tensor: copying it frees nothing (warned).
@pytest.mark.filterwarnings("ignore:.*freed no GPU memory:UserWarning")
def test_entering_twice_without_the_sync_function(backend):
    sim = SimulatedDevice()
    v2_threshold = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    ctx, sync = context(num_layers=1, model_layers=3, device=sim, **v2_threshold)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    mark_activation_offload(x)  # V1 offloads tagged tensors only
    with ctx:
        h = layer(x)
    with pytest.raises(OffloadUsageError, match=r"sync function"):
        with ctx:
            layer(h)
    # The refused entry installed no saved-tensor hook and is not "inside" the context.
    assert top_saved_tensors_hooks() is None
    # Following the fix (sync, then go on), the step goes on.
    h = sync(h)
    for _ in range(2):
        with ctx:
            h = layer(h)
        h = sync(h)
    h.sum().backward()
    assert copies(sim) > 0


def test_nested_entry_is_refused():
    ctx, sync = context(num_layers=1, model_layers=3)
    with ctx:
        with pytest.raises(OffloadUsageError, match=r"one `with ctx:` block per layer"):
            with ctx:
                pass


def test_sync_function_inside_the_context_is_refused():
    ctx, sync = context(num_layers=1, model_layers=3)
    with ctx:
        with pytest.raises(OffloadUsageError, match=r"after the `with ctx:` block"):
            sync(torch.ones(1))


def test_backward_with_fewer_layers_than_model_layers():
    ctx, sync = context(num_layers=1, model_layers=3, min_tensor_size_to_offload=0)
    layer = nn.Linear(4, 4)
    h = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        with ctx:
            h = layer(h)
        h = sync(h)
    with pytest.raises(OffloadUsageError, match=r"set model_layers to the number of `with ctx:`"):
        h.sum().backward()


def test_manual_release_before_start_offload():
    ctx, sync, manual = context(manual_synchronization=True, model_layers=2,
                                min_tensor_size_to_offload=0)
    with ctx:
        h = nn.Linear(4, 4)(torch.randn(2, 4, requires_grad=True))
    sync(h)
    with pytest.raises(OffloadUsageError, match=r"start_offload_layer\(0\)"):
        manual.release_activation_forward_gpu_memory(0)
    with pytest.raises(OffloadUsageError, match=r"ids are 0..0"):
        manual.start_offload_layer(1)


# --- arguments that cannot work -------------------------------------------------------------------


@pytest.mark.parametrize("num_layers, model_layers", [(3, 3), (4, 3), (1, 1)])
def test_num_layers_not_below_model_layers(backend, num_layers, model_layers):
    with pytest.raises(OffloadConfigError) as info:
        context(num_layers=num_layers, model_layers=model_layers)
    message = str(info.value)
    assert f"num_layers={num_layers}" in message and f"model_layers={model_layers}" in message
    assert "must be smaller than" in message


def test_num_layers_model_layers_minus_one_only_warns():
    with pytest.warns(UserWarning, match=r"num_layers <= model_layers-2"):
        context(num_layers=2, model_layers=3)


@pytest.mark.parametrize("bad", [-1, None, 1.5, True])
def test_num_layers_must_be_a_non_negative_int(backend, bad):
    with pytest.raises(OffloadConfigError, match=r"num_layers must be the number of layers"):
        context(num_layers=bad, model_layers=3)


@pytest.mark.parametrize("bad", [0, "4", 2.0])
def test_model_layers_must_be_a_positive_int(backend, bad):
    with pytest.raises(OffloadConfigError, match=r"model_layers must be .*an int >= 1"):
        context(num_layers=0, model_layers=bad)


def test_offload_stream_without_manual_synchronization():
    sim = SimulatedDevice()
    with pytest.raises(OffloadConfigError, match=r"manual_synchronization=True") as info:
        context(num_layers=1, model_layers=3, offload_stream=sim.new_stream(), device=sim)
    assert "offload_stream" in str(info.value)


def test_neither_activations_nor_weights(backend):
    with pytest.raises(OffloadConfigError, match=r"offload_activations=True") as info:
        context(num_layers=1, model_layers=3, offload_activations=False, offload_weights=False)
    assert "weights" in str(info.value)


def test_synchronization_dict_with_manual_synchronization():
    with pytest.raises(OffloadConfigError, match=r"choose one"):
        context(model_layers=3, manual_synchronization=True,
                synchronization_dict={0: (True, 2, False, 3)})


def test_min_tensor_size_must_be_a_count():
    with pytest.raises(OffloadConfigError, match=r"min_tensor_size_to_offload must be an int"):
        context(num_layers=1, model_layers=3, min_tensor_size_to_offload=-1)


# --- invalid synchronization_dict (model_layers=4 below) ------------------------------------------


@pytest.mark.parametrize(
    "sync_dict, needles",
    [
        ([(True, 2, False, 4)], ["synchronization_dict must be a dict"]),
        ({"0": (True, 2, False, 4)}, ["synchronization_dict['0']", "layer ids must be ints",
                                      "fix the key"]),
        ({True: (True, 2, False, 4)}, ["layer ids must be ints"]),
        ({4: (True, 5, False, 1)}, ["synchronization_dict[4]", "[0, model_layers=4)"]),
        ({0: (True, 2, False)}, ["synchronization_dict[0]", "expected a 4-tuple",
                                 "(offload_fwd: bool, offload_num: int, reload_fwd: bool, "
                                 "reload_num: int)"]),
        ({0: (True, 2, False, 4, 0)}, ["expected a 4-tuple"]),
        ({0: (1, 2, False, 4)}, ["offload_fwd must be a bool"]),
        ({0: (True, 2, "no", 4)}, ["reload_fwd must be a bool"]),
        ({0: (True, 0, False, 4)}, ["offload_num must be an int in [1, model_layers=4]", "got 0"]),
        ({0: (True, 6, False, 4)}, ["offload_num must be an int in [1, model_layers=4]", "got 6"]),
        ({0: (True, 2, False, 9)}, ["reload_num must be an int in [1, model_layers=4]", "got 9"]),
        ({1: (True, 2, False, 3)}, ["before its own forward ends", "offload_num >= 3"]),
        ({0: (False, 2, True, 4)}, ["reload would start before the offload finishes",
                                    "move reload_num later"]),
        ({1: (True, 3, False, 4)}, ["reload would start after layer 1's backward began",
                                    "reload_num <= 3"]),
    ],
)
def test_invalid_synchronization_dict(sync_dict, needles):
    with pytest.raises(OffloadConfigError) as info:
        context(model_layers=4, synchronization_dict=sync_dict)
    message = str(info.value)
    for needle in needles:
        assert needle in message


# The only offloaded layer's saved input is the caller's tensor: copying it frees nothing (warned).
@pytest.mark.filterwarnings("ignore:.*freed no GPU memory:UserWarning")
def test_valid_synchronization_dict_is_accepted_and_runs():
    sim = SimulatedDevice()
    ctx, sync = context(model_layers=4, synchronization_dict={0: (True, 2, False, 4)},
                        min_tensor_size_to_offload=0, device=sim)
    layer = nn.Linear(4, 4)
    h = torch.randn(2, 4, requires_grad=True)
    for _ in range(4):
        with ctx:
            h = layer(h)
        h = sync(h)
    h.sum().backward()
    assert ("release", 0) in sim.milestones()


# --- V2-only arguments with the legacy backend ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(manual_synchronization=True), "manual_synchronization"),
        (dict(retain_pinned_cpu_buffers=True), "retain_pinned_cpu_buffers"),
        (dict(offload_stream=object()), "offload_stream"),
        (dict(synchronization_dict={0: (True, 2, False, 4)}), "synchronization_dict"),
        (dict(min_tensor_size_to_offload=10), "min_tensor_size_to_offload"),
    ],
)
def test_v2_only_arguments_under_v1(monkeypatch, kwargs, name):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError) as info:
        context(num_layers=1, model_layers=4, **kwargs)
    message = str(info.value)
    assert name in message
    assert "exist only in the V2 backend" in message and "unset NVTE_CPU_OFFLOAD_V1" in message


def test_all_offending_v2_arguments_are_named_together(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError) as info:
        context(num_layers=1, model_layers=4, retain_pinned_cpu_buffers=True,
                min_tensor_size_to_offload=10)
    assert "retain_pinned_cpu_buffers, min_tensor_size_to_offload" in str(info.value)
