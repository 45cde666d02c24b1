"""``HybridDeviceOptimizer`` as a drop-in ``torch.optim.Optimizer`` (issue 39, defects 3, 5, 6, 7
and 9): ``opt.state`` maps each stepped parameter to its state (a live view), so DCP's
``get_optimizer_state_dict``/``set_optimizer_state_dict`` round-trip without stepping; classes
that create state at construction (Adagrad) with low-precision parameters in the streamed part;
zero-size parameters; ``step()`` after ``close()``; argument checks. Public API only, on
``SimulatedDevice`` (``_support.hybrid_cases``), compared with the wrapped torch optimizer
(``MasterWeightOptimizer`` for bf16/fp16 parameters) by ``torch.equal``."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

from cpu_offload import OffloadConfigError, SimulatedDevice
from cpu_offload.core.errors import OffloadUsageError
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim.reference import MasterWeightOptimizer

from _support.hybrid_cases import (
    MODES, SPLITS, Split, assert_same_params, assert_same_state, diff, hybrid, loss_of, made, net,
    settle, splits,
)

assert made  # fixture
KW = dict(lr=1e-2, weight_decay=0.1)


def adamw(m):
    return torch.optim.AdamW(m.parameters(), fused=True, **KW)


def train(m, opt, steps=range(3), skip=()):
    """``len(steps)`` steps; ``skip``: parameters whose gradients are dropped before each."""
    for i in steps:
        loss_of(m, i).backward()
        for p in skip:
            p.grad = None
        opt.step()
        opt.zero_grad()
    settle(opt)


# --- defect 3: opt.state, DCP -------------------------------------------------------------------


def assert_state_view(opt, model, ref_state, ref_params, stepped):
    """``opt.state``: exactly the ``stepped`` parameters of ``model`` (identity), each mapped
    to the state ``ref_state`` holds for the matching one of ``ref_params``, plus its
    ``master_weight`` where the optimizer keeps one (as ``state_dict()`` saves it): the
    matching one of ``ref_params`` (the reference's master, or its parameter)."""
    assert {id(p) for p in opt.state} == {id(p) for p in stepped}
    for (name, p), q in zip(model.named_parameters(), ref_params):
        if q not in ref_state:
            continue
        got, want = opt.state[p], ref_state[q]
        assert sorted(set(got) - {"master_weight"}) == sorted(want), name
        if "master_weight" in got:
            assert torch.equal(got["master_weight"].cpu(), q.detach().cpu()), name
        for k, v in want.items():
            assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(v)), f"{name} {k}"


@splits()
def test_state_maps_stepped_params_to_their_state(made, split):
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    train(m, opt, skip=(m.l1.bias, m.l3.bias))  # device part, offloaded part
    train(ref, ref_opt, skip=(ref.l1.bias, ref.l3.bias))
    assert_same_params(m, ref)
    stepped = [p for p in m.parameters() if p is not m.l1.bias and p is not m.l3.bias]
    assert_state_view(opt, m, ref_opt.state, list(ref.parameters()), stepped)


@splits(("none",))
def test_state_entries_are_changed_in_place_and_never_set_aside(made, split):
    """``opt.state`` writes: in place they reach the optimizer, as with torch (``zero_()`` of an
    offloaded parameter's ``exp_avg`` equals torch after the same); setting or removing an entry
    of a parameter whose state is assembled from pieces (streamed), removing a parameter's state
    (``del``, ``clear``) or replacing ``opt.state`` (torch's reset) would be silently ignored,
    so each raises ``OffloadUsageError`` naming what works."""
    from collections import defaultdict

    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    train(m, opt)
    train(ref, ref_opt)
    p, q = list(m.parameters())[-1], list(ref.parameters())[-1]  # offloaded
    opt.state[p]["exp_avg"].zero_()
    ref_opt.state[q]["exp_avg"].zero_()
    if id(p) in opt._streamed:
        with pytest.raises(OffloadUsageError, match=r"kept in pieces.*in place"):
            opt.state[p]["exp_avg"] = torch.zeros_like(p)
    for write in (lambda: opt.state.__delitem__(p), opt.state.clear,
                  lambda: opt.state.__setitem__(p, {})):
        with pytest.raises(OffloadUsageError, match=r"view of the state.*in place"):
            write()
    with pytest.raises(OffloadUsageError, match=r"cannot be replaced.*build a new"):
        opt.state = defaultdict(dict)
    train(m, opt, range(3, 5))
    train(ref, ref_opt, range(3, 5))
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("stream_fraction", [0.0, 1.0, 0.5])
def test_state_of_bf16_params_is_the_masters_state(made, stream_fraction):
    """Everything offloaded: each parameter's state is that of its fp32 master."""
    m, ref = net(torch.bfloat16), net(torch.bfloat16)
    opt = hybrid(m, Split("backward_update", stream_fraction), fraction=1.0, **KW)
    made.append(opt)
    ref_opt = MasterWeightOptimizer(ref.parameters(), **KW)
    train(m, opt)
    train(ref, ref_opt)
    assert_same_params(m, ref)
    assert_state_view(opt, m, ref_opt.optimizer.state, ref_opt.masters, list(m.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_shaped_unlike_its_parameter_is_refused_before_anything_loads(made, dtype):
    """A state tensor (or master) of another shape raises ``ValueError`` naming the entry, and
    leaves state and parameters as they were, wherever the parameter is updated (device part,
    CPU part, streamed part). torch's own optimizers load it unchecked."""
    m = net(dtype)
    opt = hybrid(m, Split("backward_update", 0.5), **KW)
    made.append(opt)
    train(m, opt)
    good = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in m.parameters()]
    keys = ["exp_avg", "exp_avg_sq"] + (["master_weight"] if dtype == torch.bfloat16 else [])
    where = {"device": [], "offloaded": opt.offloaded_params(), "streamed": opt.streamed_params()}
    where["device"] = [p for p in m.parameters() if not any(p is q for q in where["offloaded"] + where["streamed"])]
    assert all(where.values())
    for part, ps in where.items():
        index = next(i for i, p in enumerate(m.parameters()) if p is ps[0])
        for key in keys:
            if key not in good["state"][index]:
                assert key == "master_weight" and part == "device"
                continue
            bad = copy.deepcopy(good)
            bad["state"][index][key] = torch.zeros(3, dtype=bad["state"][index][key].dtype)
            bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"] + 1  # would be loaded first
            with pytest.raises(ValueError, match=rf"entry {index} \(parameter {index}\): '{key}' has shape "
                               r"\(3,\), the parameter .*saved with this model's parameters"):
                opt.load_state_dict(bad)
            now = opt.state_dict()["state"]
            assert sorted(now) == sorted(good["state"])
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(now[i][k]))
                       for i, e in good["state"].items() for k, v in e.items()), part
            assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params)), part


@splits()
def test_state_is_a_live_view(made, split):
    """Writing into ``opt.state[p]`` changes the next step, as with the wrapped optimizer."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    for model, o in ((m, opt), (ref, ref_opt)):
        train(model, o, range(2))
        for p in model.parameters():
            o.state[p]["exp_avg"].zero_()
            o.state[p]["exp_avg_sq"].mul_(4)
        train(model, o, range(2, 3))
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@splits()
def test_dcp_state_dict_round_trips_without_stepping(made, split):
    """``get_optimizer_state_dict`` after 3 steps steps nothing (DCP runs a zero-gradient
    ``step()`` on an optimizer whose ``state`` is empty); ``set_optimizer_state_dict`` into a
    fresh hybrid optimizer continues exactly as the original."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_optimizer_state_dict,
    )

    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    train(m, opt)
    train(ref, ref_opt)
    before = [p.detach().clone() for p in m.parameters()]
    osd = get_optimizer_state_dict(m, opt)
    settle(opt)
    for (name, p), b in zip(m.named_parameters(), before):
        assert torch.equal(p, b), f"{name} changed by get_optimizer_state_dict: {diff(p, b)}"
    assert sorted(osd["state"]) == sorted(n for n, _ in m.named_parameters())
    for name, s in osd["state"].items():
        assert float(s["step"]) == 3, (name, s["step"])
    for s in opt.state_dict()["state"].values():
        assert float(s["step"]) == 3
    # continue: the original, and a fresh optimizer over a copy of the model loaded from a
    # copy of osd (as from a file: torch's load_state_dict keeps the tensors it is given)
    fresh_model = net()
    fresh_model.load_state_dict(m.state_dict())
    fresh = hybrid(fresh_model, split, **KW)
    made.append(fresh)
    set_optimizer_state_dict(fresh_model, fresh, copy.deepcopy(osd))
    settle(fresh)
    assert_same_params(fresh_model, m)
    for model, o in ((m, opt), (fresh_model, fresh), (ref, ref_opt)):
        train(model, o, range(3, 4))
    assert_same_params(m, ref)
    assert_same_params(fresh_model, ref)
    assert_same_state(opt, ref_opt)
    assert_same_state(fresh, ref_opt)


@pytest.mark.parametrize("flatten", [False, True])
@splits(("backward_update",))
def test_dcp_keeps_the_fp32_masters_of_bf16_parameters(made, split, flatten):
    """bf16 parameters with fp32 masters through DCP's ``get``/``set_optimizer_state_dict``,
    also with ``flatten_optimizer_state_dict=True``: the resumed run continues bit for bit as
    the uninterrupted one. (Flattened, DCP loads only the keys ``opt.state[p]`` lists; the
    masters were saved but not loaded, and training went on from the rounded parameters.)"""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    m, ref = net(torch.bfloat16), net(torch.bfloat16)
    opt, ref_opt = (hybrid(x, split, fraction=1.0, **KW) for x in (m, ref))
    made += [opt, ref_opt]
    train(m, opt)
    train(ref, ref_opt, range(5))  # uninterrupted
    osd = get_optimizer_state_dict(m, opt, options=options)
    opt.close()
    fresh = hybrid(m, split, fraction=1.0, **KW)
    made.append(fresh)
    set_optimizer_state_dict(m, fresh, copy.deepcopy(osd), options=options)
    train(m, fresh, range(3, 5))
    assert_same_params(m, ref)


# --- defect 5: Adagrad (state made at construction), low precision, streamed -----------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@splits()
def test_adagrad_low_precision_equals_master_weights(made, split, dtype):
    kw = dict(lr=0.1, initial_accumulator_value=0.1)
    m, ref = net(dtype), net(dtype)
    opt = hybrid(m, split, fraction=1.0, cpu_optimizer_cls=torch.optim.Adagrad,
                 gpu_optimizer_cls=torch.optim.Adagrad, **kw)
    made.append(opt)
    ref_opt = MasterWeightOptimizer(ref.parameters(), torch.optim.Adagrad, **kw)
    train(m, opt)
    train(ref, ref_opt)
    assert_same_params(m, ref)


# --- defect 6: zero-size parameters -------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 64], ids=["chunk-default", "chunk-64B"])
@splits()
def test_zero_size_params(made, split, chunk):
    """Zero-size parameters registered first, in the middle and last, everything offloaded:
    steps, ``state_dict()`` (streamed part; CPU buckets in 64-byte chunks) and streaming during
    backward work, and equal torch's AdamW."""
    m, ref = net(empty=True), net(empty=True)
    opt = hybrid(m, split, fraction=1.0, cpu_chunk_bytes=chunk, **KW)
    made.append(opt)
    ref_opt = adamw(ref)
    train(m, opt)
    train(ref, ref_opt)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


# --- defect 7: step() after close() ------------------------------------------------------------


@pytest.mark.parametrize("split", [s for s in SPLITS if s.stream_fraction == 0.5],
                         ids=lambda s: s.id)
def test_step_after_close_raises(made, split):
    """An ``OffloadUsageError`` naming ``close()``, not a hang (run in a thread: a hang fails
    after 5 s)."""
    m = net()
    opt = hybrid(m, split, **KW)
    train(m, opt, range(1))
    opt.close()
    outcome: list = []

    def misuse():
        try:
            loss_of(m, 1).backward()
            opt.step()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=misuse, daemon=True, name="step-after-close")
    t.start()
    t.join(5)
    assert not t.is_alive(), "step() after close() hangs"
    assert isinstance(outcome[0], OffloadUsageError), repr(outcome[0])
    assert "close()" in str(outcome[0])


# --- defect 9: arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("arg", [
    dict(bucket_bytes=np.int64(2**20)), dict(offload_fraction=np.float32(0.5)),
    dict(cpu_threads=np.int64(1)), dict(cpu_chunk_bytes=np.int64(2**16)),
    dict(stream_fraction=np.float32(0.5)),
], ids=lambda a: f"{next(iter(a))}={type(next(iter(a.values()))).__name__}")
def test_numpy_scalars_accepted(made, arg):
    m, ref = net(), net()
    kw = {"offload_fraction": 0.5, "stream_fraction": 0.5, **arg}
    opt = HybridDeviceOptimizer(m.parameters(), device=SimulatedDevice(), **kw, **KW)
    made.append(opt)
    train(m, opt)
    train(ref, adamw(ref))
    assert_same_params(m, ref)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=repr)
def test_device_that_is_not_an_offload_device(device):
    with pytest.raises(OffloadConfigError, match="SimulatedDevice"):
        HybridDeviceOptimizer(net().parameters(), 0.5, device=device, **KW)


@pytest.mark.parametrize("order", [5, "abc"], ids=repr)
def test_grad_order_not_parameters(order):
    with pytest.raises(OffloadConfigError, match="grad_order"):
        HybridDeviceOptimizer(net().parameters(), 0.5, device=SimulatedDevice(), grad_order=order,
                              **KW)


@pytest.mark.parametrize("arg", [
    dict(offload_fraction=True), dict(stream_fraction=True), dict(bucket_bytes=True),
    dict(cpu_threads=True), dict(cpu_chunk_bytes=False), dict(stream_budget_bytes=True),
    dict(max_grad_norm=True),
], ids=lambda a: next(iter(a)))
def test_bools_rejected_where_numbers_are_expected(arg):
    kw = {"offload_fraction": 0.5, **arg}
    with pytest.raises(OffloadConfigError, match=next(iter(arg))):
        HybridDeviceOptimizer(net().parameters(), device=SimulatedDevice(), **kw, **KW)


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 2)
        self.emb = nn.Embedding(10, 4, sparse=True)  # registered last: offloaded first

    def forward(self, idx: torch.Tensor, sparse: bool = True) -> torch.Tensor:
        # through the module (not F.embedding on its weight), so that next_forward's pre-hook
        # of the module orders the read after the weight's update
        self.emb.sparse = sparse
        return self.head(self.emb(idx)).square().mean()


@pytest.mark.parametrize("stream_fraction", [0.0, 1.0])
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradient_error_then_dense_steps(made, mode, stream_fraction):
    """The documented error for a sparse gradient on an offloaded parameter; after it,
    ``zero_grad()`` works and a dense step equals the wrapped optimizer's (which also raised
    for the sparse gradient and changed nothing)."""
    m, ref = EmbedNet(), EmbedNet()
    opt = hybrid(m, Split(mode, stream_fraction), fraction=1.0, **KW)
    made.append(opt)
    ref_opt = adamw(ref)
    idx = torch.tensor([1, 3, 3, 7])
    with pytest.raises(OffloadUsageError, match="sparse"):
        m(idx).backward()
        opt.step()
    ref(idx).backward()
    with pytest.raises(RuntimeError, match="sparse"):
        ref_opt.step()
    for model, o in ((m, opt), (ref, ref_opt)):
        o.zero_grad()
        for i in range(2):
            model(idx + i, sparse=False).backward()
            o.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)


@pytest.mark.parametrize("stream_fraction", [0.0, 0.5])
@pytest.mark.parametrize("mode", ["backward_update", "next_forward"])
def test_a_closed_optimizer_is_freed_without_the_cycle_collector(mode, stream_fraction):
    """No reference cycle: once dropped, the optimizer, its CPU buckets and streamed parts (and
    so their host memory) go at once, with the cycle collector off (``close()`` then rebuild,
    as a training loop that recreates its optimizer does)."""
    import gc
    import weakref

    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    gc.disable()
    try:
        opt = hybrid(m, Split(mode, stream_fraction), fraction=1.0, **KW)
        for _ in range(2):
            m(torch.randn(2, 8, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        refs = [weakref.ref(opt)] + [weakref.ref(p) for p in opt._parts]
        del opt
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("device", ["late", "early"])
@pytest.mark.parametrize("stream_fraction", [0.0, 1.0, 0.5])
def test_an_optimizer_dropped_without_close_lands_its_last_step(stream_fraction, device):
    """``next_forward``: ``step()`` returns with its update running, and the forward pre-hooks
    that wait for it hold the optimizer weakly. Dropped right after (``del opt``, or rebinding
    ``opt`` for a new phase, without ``close()``), the step still lands: the next forward sees
    it, bit for bit the wrapped class's, and the worker thread is gone (before, the CPU part's
    parameters stayed as they were). With the cycle collector off: it goes at once."""
    import gc

    from _support.hybrid_cases import DEVICES

    m, ref = net(), net()
    ref_opt = adamw(ref)
    threads = set(threading.enumerate())
    gc.disable()
    try:
        opt = HybridDeviceOptimizer(m.parameters(), 1.0, overlap="next_forward",
                                    stream_fraction=stream_fraction, device=DEVICES[device](), **KW)
        opt.register_forward_waits(m)
        for model, o in ((m, opt), (ref, ref_opt)):
            loss_of(model, 0).backward()
            o.step()
            o.zero_grad()
        del opt
        with torch.no_grad():
            assert torch.equal(m(torch.ones(2, 8)), ref(torch.ones(2, 8)))
        assert_same_params(m, ref)
        for t in set(threading.enumerate()) - threads:  # the worker's pool, shutting down
            t.join(10)
        assert set(threading.enumerate()) <= threads
    finally:
        gc.enable()


# --- torch's optimizer protocol: state-dict hooks, copies ---------------------------------------


def _hooked(opt, calls):
    """The four state-dict hooks on ``opt``, recording into ``calls``; the post hook of
    ``state_dict`` tags the dict, the pre hook of ``load_state_dict`` changes the loaded lr."""
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))

    def saved(o, sd):
        calls.append("save post")
        return {**sd, "tag": len(calls)}

    def loading(o, sd):
        calls.append("load pre")
        sd["param_groups"] = [{**g, "lr": 3e-3} for g in sd["param_groups"]]
        return sd

    opt.register_state_dict_post_hook(saved)
    opt.register_load_state_dict_pre_hook(loading)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))


@splits(("backward_update", "next_forward"))
def test_state_dict_hooks_run_as_in_torch(made, split):
    """``register_state_dict_pre_hook`` and the three others ran on torch's optimizers and never
    on this one (it overrides ``state_dict`` and ``load_state_dict``): a post hook's dict, a
    load pre hook's edits were lost. Same calls, same saved dict, same training after."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    got, want = [], []
    _hooked(opt, got)
    _hooked(ref_opt, want)
    train(m, opt)
    train(ref, ref_opt)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["tag"] == ref_sd["tag"] == 2
    opt.load_state_dict(sd)
    ref_opt.load_state_dict(ref_sd)
    assert got == want == ["save pre", "save post", "load pre", "load post"]
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 3e-3
    train(m, opt, range(3, 5))
    train(ref, ref_opt, range(3, 5))
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copying_or_pickling_is_refused_with_the_fix(made, how):
    """A copy came back half built (every use an ``AttributeError``, its state empty), pickling
    failed on a weak reference: now both raise, naming ``state_dict()``; the original trains
    on."""
    import pickle

    m, ref = net(), net()
    opt, ref_opt = hybrid(m, **KW), adamw(ref)
    made.append(opt)
    train(m, opt)
    copier = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(OffloadUsageError, match=r"cannot be copied or pickled .*opt\.state_dict\(\)"):
        copier(opt)
    train(m, opt, range(3, 4))
    train(ref, ref_opt, range(4))
    assert_same_params(m, ref)


@splits(("backward_update", "next_forward"))
def test_a_deleted_group_key_is_refused_at_step(made, split):
    """``del opt.param_groups[0]["weight_decay"]``: torch's class raises ``KeyError`` at its
    next ``step()``; the parts kept stepping with the old value (they copy only the keys the
    group has). Now ``step()`` raises naming the key, and once it is set again training goes
    on exactly."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    train(m, opt, range(2))
    train(ref, ref_opt, range(3))
    del opt.param_groups[0]["weight_decay"]
    loss_of(m, 2).backward()
    with pytest.raises(OffloadUsageError, match=r"param group 0 lacks \['weight_decay'\] .*set them again"):
        opt.step()
    opt.param_groups[0]["weight_decay"] = KW["weight_decay"]
    opt.step()
    opt.zero_grad()
    settle(opt)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@splits(("backward_update",))
def test_state_of_a_parameter_not_stepped_yet_reads_as_torchs(made, split):
    """``opt.state[p]`` before ``p``'s first step: torch's ``defaultdict`` gives ``{}`` (code
    that reads a step count does this); here it raised ``KeyError``. Now an empty entry, still
    not ``in`` the state, and read-only (a key set would not reach the parts)."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert opt.state[p] == ref_opt.state[q] == {}
        assert p not in opt.state and opt.state.get(p) is None
        with pytest.raises(OffloadUsageError, match="no optimizer state before its first step"):
            opt.state[p]["step"] = torch.tensor(1.0)
    assert len(opt.state) == 0 and not opt.state
    with pytest.raises(KeyError):
        opt.state["l1.weight"]  # not a tensor
    train(m, opt, range(1))
    train(ref, ref_opt, range(1))
    assert all(p in opt.state for p in m.parameters())
    assert_same_state(opt, ref_opt)


@pytest.mark.parametrize("key,value", [("fused", False), ("foreach", True), ("differentiable", False)])
def test_an_implementation_key_set_in_a_group_is_refused(made, key, value):
    """``opt.param_groups[0]["fused"] = False``: torch's class switches implementation; here the
    parts kept theirs and ``state_dict()`` reported the new value. Now ``step()`` raises naming
    the key; once it is deleted, training goes on exactly."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, **KW), adamw(ref)
    made.append(opt)
    train(m, opt, range(1))
    train(ref, ref_opt, range(2))
    opt.param_groups[0][key] = value
    loss_of(m, 1).backward()
    with pytest.raises(OffloadUsageError, match=rf"param group 0 sets \['{key}'\]: .*build a new"):
        opt.step()
    del opt.param_groups[0][key]
    opt.step()
    opt.zero_grad()
    settle(opt)
    assert_same_params(m, ref)


def test_an_implementation_key_is_refused_where_the_group_is_added(made):
    """``add_param_group({..., "foreach": False})`` was added, and every ``step()`` after it
    refused: now the call refuses and takes the group back; so does the constructor."""
    m = net()
    build = lambda groups: HybridDeviceOptimizer(groups, 0.5, device=SimulatedDevice(), **KW)  # noqa: E731
    opt = build([{"params": list(m.l1.parameters())}])
    made.append(opt)
    with pytest.raises(OffloadUsageError, match=r"param group 1 sets \['foreach'\]"):
        opt.add_param_group({"params": list(m.l2.parameters()), "foreach": False})
    assert len(opt.param_groups) == 1
    with pytest.raises(OffloadUsageError, match=r"param group 0 sets \['fused'\]"):
        build([{"params": list(m.l3.parameters()), "fused": False}])


@splits(("next_forward",))
def test_removed_forward_waits_are_noticed(made, split):
    """``register_forward_waits(model).remove()``: the parameters stayed counted as covered, and
    the next forward raced the update. Now ``step()`` refuses until they are registered again."""
    m, ref = net(), net()
    opt, ref_opt = hybrid(m, split, **KW), adamw(ref)
    made.append(opt)
    train(m, opt, range(1))
    opt.register_forward_waits(m).remove()  # a second registration, removed: the first holds
    train(m, opt, range(1, 2))
    opt._waits[0].remove()
    loss_of(m, 2).backward()
    with pytest.raises(OffloadUsageError, match=r"needs opt.register_forward_waits\(model\)"):
        opt.step()
    opt.register_forward_waits(m)
    opt.step()
    opt.zero_grad()
    train(ref, ref_opt, range(3))
    settle(opt)
    assert_same_params(m, ref)


def test_state_entries_refuse_in_place_union_and_deep_copies_are_snapshots(made):
    """``opt.state[p] |= {...}`` went through ``dict.__ior__``, past the refused methods, and was
    lost; ``copy.deepcopy(opt.state)`` gave another live view where torch gives a snapshot."""
    m = net()
    opt = hybrid(m, Split("backward_update", 1.0), **KW)
    made.append(opt)
    p = m.l3.weight
    with pytest.raises(OffloadUsageError, match="no optimizer state before"):
        entry = opt.state[p]
        entry |= {"step": torch.tensor(1.0)}
    train(m, opt, range(1))
    with pytest.raises(OffloadUsageError, match="kept in pieces"):
        entry = opt.state[p]
        entry |= {"step": torch.tensor(5.0)}
    snap = copy.deepcopy(opt.state)
    assert isinstance(snap, dict) and len(snap) == len(opt.state)
    before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    train(m, opt, range(1, 2))
    key = next(k for k in snap if k.shape == p.shape)
    assert all(torch.equal(snap[key][k], v) for k, v in before.items())
    assert not torch.equal(opt.state[p]["exp_avg"], before["exp_avg"])


@pytest.mark.parametrize("dtype,in_fp32", [(torch.float32, False), (torch.bfloat16, True)])
def test_saved_keys_do_not_depend_on_the_placement(made, dtype, in_fp32):
    """DCP plans a checkpoint by key, on every rank and against the checkpoint it loads: a
    ``"master_weight"`` saved for some placements only made ``dcp.save`` fail under FSDP2 with
    uneven shards (each rank places its own shards), and ``dcp.load`` of a checkpoint saved at
    another fraction (or by plain AdamW) fail on a missing key; a partial load then wrote the new
    optimizer's stale masters into the loaded parameters. A master in the parameter's own dtype
    equals it and is no longer saved; bf16 parameters with ``param_update_in_fp32=True`` have an
    fp32 master wherever they are."""
    keys = {}
    for fraction, stream in [(0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (1.0, 0.5), (1.0, 1.0)]:
        m = net(dtype)
        opt = HybridDeviceOptimizer(m.parameters(), fraction, stream_fraction=stream, device=SimulatedDevice(),
                                    param_update_in_fp32=in_fp32, **KW)
        made.append(opt)
        train(m, opt, range(1))
        keys[(fraction, stream)] = {i: sorted(e) for i, e in opt.state_dict()["state"].items()}
        assert [sorted(opt.state[p]) for p in m.parameters()] == list(keys[(fraction, stream)].values())
    first = next(iter(keys.values()))
    assert all(k == first for k in keys.values()), keys
    assert all(("master_weight" in e) == in_fp32 for e in first.values())
