"""Pure schedule logic (no tensors): the default schedule and synchronization_dict rules."""
import pytest

from cpu_offload.core.errors import OffloadConfigError
from cpu_offload.v2.schedule import (
    Schedule,
    check_default_arguments,
    default_synchronization_dict,
    plan_synchronization_dict,
    validate_synchronization_dict,
)


def test_default_dict_for_two_of_five():
    # Layer i released before forward of layer n-k+i (the (n-k+i+1)-th forward start),
    # reloaded after backward of layer n-k+i (when k-i+1 backward passes have begun).
    assert default_synchronization_dict(2, 5) == {0: (True, 4, False, 3), 1: (True, 5, False, 2)}


@pytest.mark.parametrize("n", range(2, 10))
def test_default_schedule_keeps_at_most_n_minus_k_layers_resident(n):
    for k in range(0, n):
        profile = Schedule.default(k, n).resident_profile()
        assert max(profile) == n - k, (n, k, profile)


def test_resident_profile_of_seed_figure_3():
    # n=5, k=2: forward 1,2,3,3,3 (layer 0 released at layer 3, layer 1 at layer 4), backward
    # layer 4 -> {4,3,2}, layer 3 -> {3,2,1 reloading}, layer 2 -> {2,1,0}, then shrinking.
    assert Schedule.default(2, 5).resident_profile() == [1, 2, 3, 3, 3, 3, 3, 3, 2, 1]


def test_without_offloading_everything_is_resident():
    assert Schedule.default(0, 4).resident_profile() == [1, 2, 3, 4, 4, 3, 2, 1]


def test_validated_custom_dict_drives_positions():
    sync = validate_synchronization_dict({1: (True, 4, False, 1)}, 4)
    s = Schedule(4, sync)
    assert s.is_offloaded(1) and not s.is_offloaded(0)
    assert s.releases_at(4) == [1] and s.reloads_at(5) == [1]
    assert s.releases_at(3) == [] and s.reloads_at(6) == []


def test_release_at_the_forward_end_is_offload_num_model_layers_plus_one():
    """``(True, n + 1, ...)``: released after the last layer's forward, before the loss; plans
    use it so that the last (checkpointed) layer's input is away during the loss."""
    assert plan_synchronization_dict(2, 4) == default_synchronization_dict(2, 4)
    sync = plan_synchronization_dict(4, 4)
    assert sync == {**default_synchronization_dict(3, 4), 3: (True, 5, False, 1)}
    s = Schedule(4, validate_synchronization_dict(sync, 4))
    assert s.releases_at_forward_end() == [3] and s.released_at_forward_end(3)
    assert all(3 not in s.releases_at(pos) for pos in range(1, 9))  # no layer start releases it
    assert s.reloads_at(5) == [3] and s.reloads_at(6) == [2]  # each as its own backward starts
    assert s.resident_profile() == [1] * 8  # at every layer start, that layer only


@pytest.mark.parametrize(
    "sync, message",
    [
        ({0: (True, 6, False, 1)}, "offload_fwd=True, offload_num=5: released when the forward"),
        ({0: (False, 5, False, 4)}, "offload_num must be an int in [1, model_layers=4]"),
        ([1, 2], "must be a dict"),
        ({"0": (True, 2, False, 1)}, "layer ids must be ints"),
        ({4: (True, 2, False, 1)}, "layer ids must be ints in [0, model_layers=4)"),
        ({0: (True, 2, False)}, "expected a 4-tuple"),
        ({0: (1, 2, False, 1)}, "offload_fwd must be a bool"),
        ({0: (True, 2, None, 1)}, "reload_fwd must be a bool"),
        ({0: (True, 0, False, 1)}, "offload_num must be an int in [1, model_layers=4]"),
        ({0: (True, 2, False, 5)}, "reload_num must be an int in [1, model_layers=4]"),
        ({1: (True, 2, False, 1)}, "would have to finish before its own forward ends"),
        ({0: (False, 2, False, 1)}, "reload would start before the offload finishes"),
        ({2: (True, 4, False, 3)}, "reload would start after layer 2's backward began"),
    ],
)
def test_invalid_synchronization_dicts_name_the_fix(sync, message):
    with pytest.raises(OffloadConfigError) as err:
        validate_synchronization_dict(sync, 4)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "k, n, message",
    [
        (4, 4, "num_layers=4 must be smaller than model_layers=4"),
        (5, 4, "must be smaller than model_layers"),
        (-1, 4, "num_layers must be the number of layers to offload"),
        (None, 4, "num_layers must be the number of layers to offload"),
        (1, 0, "model_layers must be the total number of layers"),
    ],
)
def test_default_arguments_are_checked(k, n, message):
    with pytest.raises(OffloadConfigError) as err:
        check_default_arguments(k, n)
    assert message in str(err.value)


def test_one_resident_layer_warns_about_lost_overlap():
    (warning,) = check_default_arguments(3, 4)
    assert "cannot overlap" in warning
    assert check_default_arguments(2, 4) == []
