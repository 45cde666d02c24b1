"""What the regression tests of issue 39 share (``tests/optim/test_user_edits.py``,
``test_drop_in.py``, ``test_reproducible.py``): a tiny model, the placements and overlap modes
to cover, and comparisons that use ``HybridDeviceOptimizer``'s public API only (its internals are
being rewritten).

On ``SimulatedDevice`` every part (device, CPU, streamed) runs the same CPU class, so the
optimizer must equal (``torch.equal``) the wrapped torch optimizer run directly over the same
parameters. Two simulated devices are used: ``late`` (the default: side-stream copies and
launches from backward's hooks run only when waited for) and ``early`` (both at once, as a GPU
usually does): work started during backward then reads the gradients as backward left them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Optional

import pytest
import torch
from torch import nn

from cpu_offload import SimulatedDevice
from cpu_offload.optim import HybridDeviceOptimizer, to_wrapped_format

MODES = ("none", "backward_copies", "backward_update", "next_forward")


class Split(NamedTuple):
    """An overlap mode and how the offloaded half of the model is updated."""

    mode: str
    stream_fraction: float  # 0: all on the CPU; 1: all streamed; 0.5: both
    during_backward: bool = False  # stream_during_backward

    @property
    def id(self) -> str:
        extra = "-sdb" if self.during_backward else ""
        return f"{self.mode}-s{self.stream_fraction:g}{extra}"


# every overlap mode at each streamed share, plus streaming during backward (which needs a
# streamed part and backward_update/next_forward)
SPLITS = [Split(m, s) for m in MODES for s in (0.0, 1.0, 0.5)] + [
    Split("backward_update", 1.0, True), Split("next_forward", 0.5, True)]
DEVICES = {
    "late": lambda: SimulatedDevice(),
    "early": lambda: SimulatedDevice(defer=False, defer_launches=False),
}


def splits(modes: tuple = MODES, during_backward: bool = True) -> Any:
    """``SPLITS`` of ``modes`` (without streaming during backward unless ``during_backward``)
    as a ``pytest.mark.parametrize`` over ``split``."""
    chosen = [s for s in SPLITS if s.mode in modes and (during_backward or not s.during_backward)]
    return pytest.mark.parametrize("split", chosen, ids=[s.id for s in chosen])


devices = pytest.mark.parametrize("device", list(DEVICES))


class Net(nn.Module):
    """Three linear layers (8 -> 16 -> 16 -> 4); with ``empty=True`` also zero-size parameters
    (first, in the middle and last registered, so that they land in every part)."""

    def __init__(self, empty: bool = False) -> None:
        super().__init__()
        if empty:
            self.e0 = nn.Parameter(torch.empty(0, 4))
        self.l1 = nn.Linear(8, 16)
        if empty:
            self.e1 = nn.Parameter(torch.empty(0))
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 4)
        if empty:
            self.e2 = nn.Parameter(torch.empty(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))
        for name in ("e0", "e1", "e2"):
            e = getattr(self, name, None)
            if e is not None:
                h = h + e.sum()  # a (zero) gradient for each
        return h


def net(dtype: torch.dtype = torch.float32, empty: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(empty).to(dtype)


def loss_of(m: nn.Module, i: int) -> torch.Tensor:
    """The loss of batch ``i`` (the same for every model)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + i))
    dtype = next(m.parameters()).dtype
    return m(x.to(dtype)).float().square().mean()


def hybrid(m: nn.Module, split: Split = Split("backward_update", 0.5), device: str = "late",
           fraction: float = 0.5, **kw: Any) -> HybridDeviceOptimizer:
    """``HybridDeviceOptimizer`` over ``m`` on a simulated device, small buckets (several per
    layer); ``register_forward_waits`` in ``next_forward`` mode."""
    kw.setdefault("bucket_bytes", 256)
    opt = HybridDeviceOptimizer(m.parameters(), fraction, overlap=split.mode,
                                stream_fraction=split.stream_fraction,
                                stream_during_backward=split.during_backward,
                                device=DEVICES[device](), **kw)
    if split.mode == "next_forward":
        opt.register_forward_waits(m)
    return opt


def settle(opt: Any) -> None:
    """Before reading parameters outside a forward (``next_forward``: ``wait_params``)."""
    if isinstance(opt, HybridDeviceOptimizer):
        opt.wait_params()


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
    return f"max abs diff {(a.double() - b.double()).abs().max().item() if a.numel() else 0:g}"


def assert_same_params(got: nn.Module, want: nn.Module) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(a, b), f"{name}: {diff(a, b)}"


def assert_same_state(opt: HybridDeviceOptimizer, ref: torch.optim.Optimizer) -> None:
    """``opt.state_dict()`` in the wrapped class's format equals ``ref.state_dict()``'s state."""
    got, want = to_wrapped_format(opt.state_dict())["state"], ref.state_dict()["state"]
    assert sorted(got) == sorted(want)
    for i in want:
        assert sorted(got[i]) == sorted(want[i]), i
        for k, v in want[i].items():
            assert torch.equal(torch.as_tensor(got[i][k]), torch.as_tensor(v)), (i, k)


@pytest.fixture
def made() -> Iterator[list]:
    """Optimizers to close at the end of the test, even a failed one."""
    opts: list = []
    yield opts
    for opt in opts:
        with contextlib.suppress(Exception):
            opt.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo() -> Iterator[Optional[Any]]:
    """A one-process gloo group for the module's tests; destroyed after them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
