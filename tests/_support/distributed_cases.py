"""Offloading composed with torch.distributed, one case per run, executed on every rank.

Launched by ``tests/integration/test_distributed.py`` (CPU: gloo + SimulatedDevice, in CI; and,
marked ``multigpu``, 2 GPUs: NCCL + real streams), or by hand::

    torchrun --standalone --nproc-per-node 2 tests/_support/distributed_cases.py --case ddp

Cases (``--case``): ``ddp``, ``fsdp2``, ``fsdp2-apply`` (``apply_offloading`` on an FSDP2 model),
``pipeline-gpipe``, ``pipeline-1f1b``, ``tp``, ``ddp-optim`` (DDP with activation offloading and
``HybridDeviceOptimizer``), ``ddp-optim-clip`` (the optimizer's early updates under DDP's small
buckets, with ``clip_grad_norm_`` between backward and step on some steps), ``fsdp2-optim``
(``HybridDeviceOptimizer`` over FSDP2 and HSDP shards, with activation offloading) and
``zero-optim`` (``HybridDeviceOptimizer`` as ``ZeroRedundancyOptimizer``'s local optimizer).
Each one runs the same training step with and without offloading on the same model and inputs
and checks on every rank that every gradient is ``torch.equal`` to the run without offloading
(``*-optim*``: every parameter, or shard, after the optimizer steps, against
``cpu_offload.optim.reference.PlacedReference`` built from the hybrid optimizer's placement, and
what is replicated the same on every rank); on CUDA it also
measures peak memory above the pre-step baseline (and checks it shrinks where the case says so).
Rank 0 prints one ``RESULT {json}`` line. Any failure raises, so the rank exits non-zero and
torchrun reports the case as failed. After the last case every rank destroys the process group,
checks that no thread of its own is left and prints one ``TEARDOWN {json}`` line; on the CPU
(gloo) it then ends without the interpreter's shutdown (``exit_skipping_shutdown`` says why).

``--device cpu`` (the default where CUDA is not available) uses gloo, the simulated device and a
tiny model (seconds on 2 cores); ``--device cuda`` (the default elsewhere) uses NCCL, one GPU per rank, deterministic kernels and a model big enough that
activations dominate memory. ``--device cuda-shared`` puts both ranks on GPU 0 and uses gloo (NCCL
refuses two ranks on one GPU), for the cases in ``SHARED_GPU_CASES`` (all but the pipelines): on
a one-GPU machine they still run with real streams and the GPU's rounding against the CPU's,
which is what the optimizer cases check (each rank's CPU part against the CPU class, both ranks'
parameters the same); what they do not exercise is NCCL itself and two GPUs' links.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from packaging.version import Version
from torch import nn

from cpu_offload import OffloadUsageError, SimulatedDevice, apply_offloading, get_cpu_offload_context
from cpu_offload import compat
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input, run_layers

CASES = ("ddp", "fsdp2", "fsdp2-apply", "pipeline-gpipe", "pipeline-1f1b", "tp", "ddp-optim",
         "ddp-optim-clip", "fsdp2-optim", "zero-optim")
# The cases ``cuda-shared`` runs: every one but the pipelines, whose send/recv of CUDA tensors
# gloo fails ("writev ... Bad address", torch 2.11 on an H200).
SHARED_GPU_CASES = tuple(c for c in CASES if not c.startswith("pipeline-"))
DEVICE_KINDS = ("cpu", "cuda", "cuda-shared")

# Tensor parallelism saves DTensors and AsyncCollectiveTensors for backward. V2 needs
# core.subclass.tensor_flatten for them (non-tensor inner attributes such as DTensor's
# device_mesh on recent torch; the pending all-reduce awaited before copying): a one-line change
# in v2/synchronizer.py's _push_subclass, `names, ctx = tensor_flatten(t)`.
class Env:
    """What a case needs to know about where it runs."""

    def __init__(self, device_kind: str) -> None:
        self.cuda = device_kind in ("cuda", "cuda-shared")
        self.backend = "nccl" if device_kind == "cuda" else "gloo"
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        local = 0 if device_kind == "cuda-shared" else int(os.environ.get("LOCAL_RANK", self.rank))
        if self.cuda:
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            # Bit-identical comparisons need deterministic kernels (tests/conftest.py says why).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=120))
        # Held to the end of the process: freeing a gloo group can hang (exit_skipping_shutdown).
        self.group = dist.group.WORLD
        self.sims: List[SimulatedDevice] = []

    def config(self, layers: int) -> GPTConfig:
        if self.cuda:  # ~270 MB of activations per layer against 25 MB of weights
            return GPTConfig(hidden=1024, heads=16, seq=2048, batch=4, layers=layers,
                             dtype=torch.bfloat16)
        return GPTConfig(hidden=32, heads=4, seq=16, batch=4, layers=layers)

    def offload_kwargs(self) -> dict:
        """Where offloading runs: the real GPU, or a fresh simulated device (tiny tensors)."""
        if self.cuda:
            return {}
        sim = SimulatedDevice()
        self.sims.append(sim)
        return {"device": sim, "min_tensor_size_to_offload": 0}

    def copies(self) -> int:
        """Offload/reload copies the simulated devices saw (CPU runs only)."""
        return sum(1 for s in self.sims for e in s.log if e[0] == "copy")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn: Callable[[], Any]) -> tuple:
        """``fn()`` and its peak allocated bytes above the bytes held before it (0 on CPU)."""
        if not self.cuda:
            return fn(), 0
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        self.sync()
        return out, torch.cuda.max_memory_allocated() - base

    def close(self) -> dict:
        """Destroy the process group and check that no thread started in Python is left (a
        ``HybridDeviceOptimizer`` that was not closed, say); returns this rank's ``TEARDOWN``
        report. Gloo's worker threads are not joined here (``exit_skipping_shutdown``)."""
        dist.destroy_process_group()
        # Threads started outside Python that ran Python code (gloo's workers run the comm
        # hooks' callbacks) stay listed as dummy threads: they are not ours.
        ours = [t.name for t in threading.enumerate()
                if t is not threading.main_thread() and not isinstance(t, threading._DummyThread)]
        if ours:
            raise RuntimeError(f"rank {self.rank}: threads still running after the last case: "
                               f"{ours} (an optimizer not closed?)")
        return {"rank": self.rank, "backend": self.backend, "python_threads": ours}


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2 and tensor-parallel gradients), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def grads_of(params, x: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    out = [local(p.grad).detach().clone() for p in params]
    if x is not None:
        out.append(x.grad.detach().clone())
    return out


def assert_equal(got: List[torch.Tensor], ref: List[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref), (what, len(got), len(ref))
    for i, (a, b) in enumerate(zip(got, ref)):
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            raise AssertionError(f"{what}: gradient {i} differs (max abs diff {diff:g})")


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def train_step(model: nn.Module, x: torch.Tensor, ctx=None, sync=None) -> List[torch.Tensor]:
    """Zero grads, forward through ``model(x, ctx, sync)`` (GPTStack's signature), backward."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    loss_of(model(x, ctx, sync)).backward()
    return grads_of(model.parameters(), x)


def compare_steps(env: Env, model: nn.Module, x: torch.Tensor, k: int, n: int, what: str) -> dict:
    """The run without offloading, then 3 steps offloading the first ``k`` of ``n`` layers."""
    ref, ref_peak = env.measure(lambda: train_step(model, x))
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=k, model_layers=n, **env.offload_kwargs()
    )
    for step in range(3):
        got, peak = env.measure(lambda: train_step(model, x, ctx, sync))
        assert_equal(got, ref, f"{what} step {step}")
    if env.cuda:
        assert peak < ref_peak, f"{what}: peak {peak} not below {ref_peak} without offloading"
    else:
        assert env.copies() > 0, f"{what}: nothing was offloaded"
    return {"peak_ratio": peak / ref_peak if ref_peak else None, "grads": len(ref)}


# --- cases -----------------------------------------------------------------------------------


def case_ddp(env: Env) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, k = 4, 2
    cfg = env.config(n)
    model = build_model(cfg, env.device, seed=0)
    ddp = DDP(model, device_ids=[env.device.index] if env.cuda else None)
    x = make_input(cfg, env.device, seed=10 + env.rank)  # every rank its own batch
    return compare_steps(env, ddp, x, k, n, "DDP")


# Seen on the tox releases: FSDP2 creates CUDA streams even for CPU parameters before torch 2.8
# (fails on 2.4.1 and 2.6.0), and Schedule1F1B over gloo hangs in its fused send/recv before 2.8
# (2.4.1, 2.6.0). Both work on 2.8.0 and later; on GPUs (NCCL) they are run on every release.
CPU_NEEDS_2_8 = ("fsdp2", "fsdp2-apply", "pipeline-1f1b", "fsdp2-optim")


def fsdp2_model(env: Env, cfg: GPTConfig, **shard: Any) -> Optional[nn.Module]:
    """A GPT stack with ``fully_shard(..., **shard)`` on every block and on the stack (None
    before FSDP2)."""
    fully_shard = compat.fully_shard()
    if fully_shard is None:
        return None
    model = build_model(cfg, env.device, seed=0)
    for block in model.layers:
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    return model


def case_fsdp2(env: Env) -> dict:
    n, k = 4, 2
    cfg = env.config(n)
    model = fsdp2_model(env, cfg)
    if model is None:
        return {"skipped": f"no FSDP2 fully_shard in torch {torch.__version__}"}
    x = make_input(cfg, env.device, seed=10 + env.rank)
    return compare_steps(env, model, x, k, n, "FSDP2")


def case_fsdp2_apply(env: Env) -> dict:
    """``apply_offloading`` on layers already wrapped by ``fully_shard`` (the order
    docs/distributed.md gives: shard first, then apply), exact for three steps; ``remove()``
    gives back FSDP2's classes."""
    n, k = 4, 2
    cfg = env.config(n)
    model = fsdp2_model(env, cfg)
    if model is None:
        return {"skipped": f"no FSDP2 fully_shard in torch {torch.__version__}"}
    sharded = [type(block) for block in model.layers]
    x = make_input(cfg, env.device, seed=10 + env.rank)
    ref, ref_peak = env.measure(lambda: train_step(model, x))
    handle = apply_offloading(model.layers, num_layers=k, **env.offload_kwargs())
    for step in range(3):
        got, peak = env.measure(lambda: train_step(model, x))
        assert_equal(got, ref, f"FSDP2 + apply_offloading step {step}")
    moved = env.copies()
    handle.remove()
    assert [type(block) for block in model.layers] == sharded, "remove() did not restore FSDP2"
    assert_equal(train_step(model, x), ref, "FSDP2 after remove()")
    if env.cuda:
        assert peak < ref_peak, f"FSDP2 + apply_offloading: peak {peak} not below {ref_peak}"
    else:
        assert moved > 0, "FSDP2 + apply_offloading: nothing was offloaded"
    return {"peak_ratio": peak / ref_peak if ref_peak else None, "grads": len(ref)}


class PipelineStageModule(nn.Module):
    """One pipeline stage's blocks. With offloading, one manual-synchronization context per
    micro-batch: after a micro-batch's forward its layers are copied out and released; its
    reload starts when the gradient of the stage output arrives (its backward begins)."""

    def __init__(self, layers: nn.ModuleList, contexts: Optional[list]) -> None:
        super().__init__()
        self.layers = layers
        self.contexts = contexts
        self.calls = 0  # micro-batch index of the next forward; reset before each step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb, self.calls = self.calls, self.calls + 1
        if self.contexts is None:
            return run_layers(self.layers, x)
        ctx, sync, manual = self.contexts[mb]
        h = x
        for i, layer in enumerate(self.layers):
            with ctx:
                h = layer(h)
            h = sync(h)
            manual.start_offload_layer(i)
        for i in range(len(self.layers)):
            manual.release_activation_forward_gpu_memory(i)
        n = len(self.layers)

        def reload(grad: torch.Tensor) -> None:
            for i in reversed(range(n)):  # the last layer's backward runs first
                manual.start_reload_layer(i)

        if h.requires_grad:
            h.register_hook(reload)
        return h


def case_pipeline(env: Env, schedule_name: str) -> dict:
    pp = compat.pipelining()
    if pp is None:
        return {"skipped": f"no torch.distributed.pipelining in torch {torch.__version__}"}
    assert env.world == 2, "a 2-stage pipeline: one stage per rank"
    per_stage, microbatches = 2, 4
    cfg = env.config(2 * per_stage)
    full = build_model(cfg, env.device, seed=0)
    stage_layers = nn.ModuleList(list(full.layers)[env.rank * per_stage:(env.rank + 1) * per_stage])
    x = make_input(cfg, env.device, seed=10, requires_grad=False)  # same batch on both ranks
    mb_shape = (cfg.batch // microbatches,) + tuple(x.shape[1:])
    # The stage's input and output of one micro-batch (skips shape inference, which would run
    # the stage's forward an extra time); the received activation needs a gradient.
    example = torch.zeros(mb_shape, dtype=cfg.dtype, device=env.device, requires_grad=True)
    schedule_cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule_name]

    def run(contexts: Optional[list]) -> tuple:
        module = PipelineStageModule(stage_layers, contexts)
        stage = pp.PipelineStage(module, env.rank, 2, env.device,
                                 input_args=(example,), output_args=example)
        schedule = schedule_cls(stage, microbatches, loss_fn=lambda out, tgt: loss_of(out))

        def step() -> None:
            for p in stage_layers.parameters():
                p.grad = None
            module.calls = 0
            if env.rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=torch.zeros_like(x))
            assert module.calls == microbatches, module.calls

        _, peak = env.measure(step)
        return grads_of(stage_layers.parameters()), peak

    ref, ref_peak = run(None)
    kw = env.offload_kwargs()  # one device (real or simulated) for all micro-batches
    stream = kw["device"].new_stream() if "device" in kw else torch.cuda.Stream()
    contexts = [  # one context per micro-batch, sharing one offload stream
        get_cpu_offload_context(enabled=True, model_layers=per_stage,
                                manual_synchronization=True, offload_stream=stream, **kw)
        for _ in range(microbatches)
    ]
    for step in range(2):
        got, peak = run(contexts)
        assert_equal(got, ref, f"pipeline {schedule_name} rank {env.rank} step {step}")
    if env.cuda:
        assert peak < ref_peak, f"pipeline {schedule_name}: peak {peak} not below {ref_peak}"
    else:
        assert env.copies() > 0, "pipeline: nothing was offloaded"
    return {"peak_ratio": peak / ref_peak if ref_peak else None, "grads": len(ref)}


class TPBlock(nn.Module):
    """``x + silu(fc2(gelu(fc1(ln(x)))))`` with fc1 column- and fc2 row-parallel. ``silu`` saves
    fc2's output for backward: under RowwiseParallel that is an ``AsyncCollectiveTensor`` whose
    all-reduce may still be running when the saved-tensor hook sees it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class TPStack(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x, ctx=None, sync=None):
        return run_layers(self.layers, x, ctx, sync)


def case_tp(env: Env) -> dict:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    except ImportError as e:
        return {"skipped": f"no tensor parallel API in torch {torch.__version__}: {e}"}
    n, k = 4, 2
    cfg = env.config(n)
    torch.manual_seed(0)  # the same weights on every rank before sharding
    with torch.device(env.device):
        model = TPStack(nn.ModuleList(TPBlock(cfg.hidden) for _ in range(n))).to(cfg.dtype)
    mesh = init_device_mesh(env.device.type, (env.world,))
    for block in model.layers:
        parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = make_input(cfg, env.device, seed=10)  # tensor parallel: the same batch on every rank
    return compare_steps(env, model, x, k, n, "tensor parallel")


def assert_same_on_ranks(tensors: List[torch.Tensor], what: str) -> None:
    """Every rank holds the same bits as rank 0 (replicas that drifted apart fail here). NCCL
    broadcasts device tensors only: offloaded state (CPU tensors) goes through the rank's GPU."""
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for i, t in enumerate(tensors):
        mine = t.detach() if on is None else t.detach().to(on)
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        if not torch.equal(theirs, mine):
            raise AssertionError(f"{what}: parameter {i} differs between rank 0 and rank "
                                 f"{dist.get_rank()}")


def case_ddp_optim(env: Env) -> dict:
    """DDP, activation offloading and ``HybridDeviceOptimizer`` (half the parameters offloaded)
    together. The optimizer takes the offloaded gradients from DDP's all-reduced buckets
    (``ddp_comm_hook``) and updates during backward, or during the next forward. The reference
    is ``PlacedReference`` built from the hybrid's placement (on a GPU the CPU part rounds as
    the CPU class on CPU masters, the rest as the device class), stepped from the reduced
    ``p.grad`` of the same DDP model without activation offloading. Parameters after three
    steps (a different batch per rank and step) must be equal bit for bit, and equal on both
    ranks (an unreduced gradient, or ranks placing parameters differently, would make them
    differ)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.reference import PlacedReference

    n, k = 4, 2
    cfg = env.config(n)
    kw = {"lr": 1e-3} if env.cuda else {"lr": 1e-3, "foreach": False}
    device = {} if env.cuda else {"device": SimulatedDevice()}
    ids = [env.device.index] if env.cuda else None

    def train(ddp: nn.Module, opt: Any, ctx=None, sync=None) -> int:
        """Three steps; the highest peak of them."""
        def step(i: int) -> None:
            x = make_input(cfg, env.device, seed=100 * i + env.rank, requires_grad=False)
            loss_of(ddp(x, ctx, sync)).backward()
            opt.step()
            opt.zero_grad()

        return max(env.measure(lambda: step(i))[1] for i in range(3))

    ratios = []
    for overlap in ("backward_update", "next_forward"):
        model = build_model(cfg, env.device, seed=0)
        ddp = DDP(model, device_ids=ids)
        opt = HybridDeviceOptimizer(ddp.parameters(), 0.5, overlap=overlap, **device, **kw)
        ddp.register_comm_hook(*opt.ddp_comm_hook())
        opt.register_forward_waits(model)
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n,
                                            **env.offload_kwargs())
        peak = train(ddp, opt, ctx, sync)
        opt.wait_params()
        got = [p.detach().clone() for p in model.parameters()]
        ref_model = build_model(cfg, env.device, seed=0)
        ref_ddp = DDP(ref_model, device_ids=ids)
        ref_opt = PlacedReference.like(opt, list(model.parameters()), ref_model.parameters(), **kw)
        opt.close()
        ref_peak = train(ref_ddp, ref_opt)
        what = f"DDP + offload + HybridDeviceOptimizer({overlap})"
        assert_equal(got, [p.detach() for p in ref_model.parameters()],
                     f"{what} parameters against PlacedReference")
        assert_same_on_ranks(got, what)
        if env.cuda:
            assert peak < ref_peak, f"{what}: peak {peak} not below {ref_peak}"
            ratios.append(peak / ref_peak)
    if not env.cuda:
        assert env.copies() > 0, "DDP + offload + optimizer: no activation was offloaded"
    return {"peak_ratio": max(ratios) if ratios else None, "params": len(got)}


def case_ddp_optim_clip(env: Env) -> dict:
    """``HybridDeviceOptimizer`` (``backward_update``) under DDP with small buckets: it takes the
    offloaded gradients from the all-reduced buckets (``ddp_comm_hook``) and updates during
    backward. On steps 2 and 5 the user clips between backward and step, so the early updates
    must be redone from the clipped gradients; on untouched steps nothing is redone (DDP's
    ``.grad`` was recorded). Six steps, a different batch per rank and step: parameters
    ``torch.equal`` to ``PlacedReference`` (the hybrid's placement: fused AdamW on CPU masters
    for its CPU part, on the device for the rest) on the same DDP model, equal on both ranks,
    and moved from their start."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.reference import PlacedReference

    cfg = env.config(2).with_(dtype=torch.float32)  # fp32 as the wrapped AdamW's own state
    kw = dict(lr=1e-2, weight_decay=0.1)
    ids = [env.device.index] if env.cuda else None
    ddp = DDP(build_model(cfg, env.device, seed=0), device_ids=ids, bucket_cap_mb=0.05)
    device = {} if env.cuda else {"device": SimulatedDevice(defer=False)}
    opt = HybridDeviceOptimizer(ddp.parameters(), 0.5, overlap="backward_update", **device, **kw)
    ddp.register_comm_hook(*opt.ddp_comm_hook())
    ref = DDP(build_model(cfg, env.device, seed=0), device_ids=ids)
    ref_opt = PlacedReference.like(opt, list(ddp.parameters()), ref.parameters(), **kw)
    redone = []
    for step in range(6):
        x = make_input(cfg, env.device, seed=10 * step + env.rank, requires_grad=False)
        for net, o in ((ref, ref_opt), (ddp, opt)):
            loss_of(net(x)).backward()
            if step in (2, 5):
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            o.step()
            o.zero_grad()
        redone.append(opt.last_step_stats["redone_buckets"])
    opt.wait_params()
    got = [p.detach() for p in ddp.parameters()]
    assert_equal(got, [p.detach() for p in ref.parameters()],
                 "DDP + HybridDeviceOptimizer + clip_grad_norm_ parameters against PlacedReference")
    assert_same_on_ranks(got, "DDP + HybridDeviceOptimizer + clip_grad_norm_")
    start = build_model(cfg, env.device, seed=0)
    assert not all(torch.equal(a, b) for a, b in zip(start.parameters(), ddp.parameters())), \
        "no parameter moved"
    # untouched steps redo nothing; clipped ones redo; after a clipped step no early work (3),
    # then early work again (4, so that 5 has work to redo)
    assert redone[:2] + redone[3:5] == [0] * 4, f"redone buckets per step {redone}"
    assert redone[2] > 0 and redone[5] > 0, f"redone buckets per step {redone}"
    opt.close()
    return {"redone_buckets": redone}


# (offload_fraction, overlap, stream_fraction, stream_during_backward, mesh): fractions 0.25 and
# 1; a CPU part alone, a streamed part alone, both, and streaming during backward; plain FSDP2
# (``Shard(0)`` over both ranks) and HSDP (both ranks hold the same shards: replicated state).
FSDP2_OPTIM_VARIANTS = (
    (0.25, "backward_update", 0.0, False, "fsdp"),
    (1.0, "next_forward", 0.5, False, "fsdp"),
    (0.25, "backward_copies", 1.0, False, "hsdp"),
    (1.0, "backward_update", 0.5, True, "fsdp"),
)


def case_fsdp2_optim(env: Env) -> dict:
    """FSDP2 (``fully_shard`` per block and on the stack) and ``HybridDeviceOptimizer``: each
    rank offloads a share of its own local shards, taking the gradients FSDP2 reduce-scattered
    (FSDP2 runs the sharded parameters' post-accumulate-grad hooks), with activation offloading
    on the same blocks. Per variant (``FSDP2_OPTIM_VARIANTS``), three steps with a different
    batch per rank and step, then:

    - every local shard ``torch.equal`` to ``PlacedReference`` built from the hybrid's placement
      (each rank's CPU part stepped by the CPU class on CPU masters of its shards, the rest by
      the device class), stepped from the same FSDP2 model without activation offloading; on
      the CPU (one class everywhere) also to plain ``torch.optim.AdamW(fused=True)`` over the
      FSDP2 model, shards and state;
    - ``state_dict()`` holds DTensor state laid out as the parameters (offloaded state in CPU
      memory); what must be replicated is the same on both ranks (step counts, groups, the
      placement: both ranks' shards have the same shapes), and under HSDP every shard and
      state tensor;
    - ``get_optimizer_state_dict`` steps nothing; ``torch.distributed.checkpoint`` saves it and
      loads it into a fresh optimizer over a copy of the model (``set_optimizer_state_dict``),
      and one more step on both gives the same bits;
    - on a GPU, the device memory the trained model and its optimizer hold is below the
      reference's (the offloaded state is on the host).

    Also: ``max_grad_norm`` and FSDP2's ``CPUOffloadPolicy`` are refused with the fix."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload.core.errors import OffloadConfigError
    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.reference import PlacedReference

    n, k = 4, 2
    cfg = env.config(n)
    if fsdp2_model(env, cfg) is None:
        return {"skipped": f"no FSDP2 fully_shard in torch {torch.__version__}"}
    kw = dict(lr=1e-2, weight_decay=0.1)
    meshes = {"fsdp": {}, "hsdp": {"mesh": init_device_mesh(
        env.device.type, (env.world, 1), mesh_dim_names=("replicate", "shard"))}}
    opt_devices: dict = {}  # id(optimizer) -> its simulated device
    opt_log_start: dict = {}  # id(optimizer) -> where its device's log of this backward starts

    def train(model: nn.Module, opt: Any, steps: range, ctx=None, sync=None,
              before_step: Callable[[], None] = lambda: None,
              after_step: Callable[[int], None] = lambda i: None) -> None:
        for i in steps:
            x = make_input(cfg, env.device, seed=100 * i + env.rank, requires_grad=False)
            loss_of(model(x, ctx, sync)).backward()
            before_step()
            opt.step()
            after_step(i)
            opt.zero_grad()

    def all_kept_early(opt: Any) -> Callable[[int], None]:
        """After each step but the first (which makes the state): the streamed part's updates
        started in backward, and ``step()`` kept every one (why not, per chunk, if not)."""
        def check(i: int) -> None:
            if i > 0:
                s = {k: v for k, v in opt.last_step_stats.items() if k.startswith("stream_early")}
                assert 0 < s["stream_early_kept"] == s["stream_early_chunks"], \
                    f"rank {env.rank} step {i}: {s}"
        return check

    def copied_in_backward(opt: Any) -> Callable[[], None]:
        """Before ``step()``: the CPU part's gradient copies were queued from FSDP2's hooks
        (on the simulated device, whose log shows them; on a GPU nothing is checked)."""
        sim = opt_devices.get(id(opt))

        def check() -> None:
            if sim is not None and opt.offloaded_params() and opt.overlap != "none":
                d2h = [e for e in sim.log[opt_log_start[id(opt)]:] if e[0] == "copy" and e[-1] == "d2h"]
                assert d2h, f"{opt.overlap}: no gradient was copied during backward"
                opt_log_start[id(opt)] = len(sim.log)

        return check

    def released(drop: Callable[[], None]) -> int:
        """The device bytes that ``drop()`` (deleting an optimizer) frees (0 on the CPU): what
        the optimizer held between steps."""
        if not env.cuda:
            drop()
            return 0
        gc.collect()  # earlier objects in reference cycles (dead FSDP2 models) are not the optimizer's
        env.sync()
        before = compat.cuda_allocated_bytes()
        drop()
        gc.collect()
        env.sync()
        return before - compat.cuda_allocated_bytes()

    def plain_adamw_bytes(layout: str) -> int:
        """What fused AdamW over the same FSDP2 model holds on the device after 3 steps."""
        if not env.cuda:
            return 0
        box = {"model": fsdp2_model(env, cfg, **meshes[layout])}
        box["opt"] = torch.optim.AdamW(box["model"].parameters(), fused=True, **kw)
        train(box["model"], box["opt"], range(3))
        box["model"].zero_grad(set_to_none=True)
        return released(lambda: box.pop("opt"))

    ratios = []
    for fraction, overlap, stream, early, layout in FSDP2_OPTIM_VARIANTS:
        what = f"FSDP2 + HybridDeviceOptimizer({fraction}, {overlap}, stream {stream}" + \
            (", during backward" if early else "") + f", {layout})"
        args = dict(offload_fraction=fraction, overlap=overlap, stream_fraction=stream,
                    stream_during_backward=early, **kw)

        def hybrid(model: nn.Module) -> Any:
            sim = None if env.cuda else SimulatedDevice()
            opt = HybridDeviceOptimizer(model.parameters(), device=sim, **args)
            opt.register_forward_waits(model)
            opt_devices[id(opt)] = sim
            opt_log_start[id(opt)] = len(sim.log) if sim is not None else 0
            return opt

        def trained() -> tuple:
            model = fsdp2_model(env, cfg, **meshes[layout])
            opt = hybrid(model)
            ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n,
                                                **env.offload_kwargs())
            train(model, opt, range(3), ctx, sync, before_step=copied_in_backward(opt),
                  after_step=all_kept_early(opt) if early else lambda i: None)
            opt.wait_params()
            return model, opt

        model, opt = trained()
        params = list(model.parameters())
        got = [local(p).detach().clone() for p in params]

        def reference() -> tuple:
            ref_model = fsdp2_model(env, cfg, **meshes[layout])
            ref_opt = PlacedReference.like(opt, params, ref_model.parameters(), **kw)
            train(ref_model, ref_opt, range(3))
            return ref_model, ref_opt

        ref_model, ref_opt = reference()
        assert_equal(got, [local(p).detach() for p in ref_model.parameters()],
                     f"{what}: shards against PlacedReference")
        del ref_model, ref_opt
        sd = opt.state_dict()
        if not env.cuda:  # one class everywhere: plain AdamW over the FSDP2 model
            plain_model = fsdp2_model(env, cfg, **meshes[layout])
            plain = torch.optim.AdamW(plain_model.parameters(), fused=True, **kw)
            train(plain_model, plain, range(3))
            assert_equal(got, [local(p).detach() for p in plain_model.parameters()],
                         f"{what}: shards against torch.optim.AdamW")
            psd = plain.state_dict()
            for i, entry in psd["state"].items():
                for name, v in entry.items():
                    mine = sd["state"][i][name]
                    assert compat.is_dtensor(mine) == compat.is_dtensor(v), (what, i, name)
                    assert_equal([local(mine).cpu()], [local(v).cpu()], f"{what}: state {i} {name}")
        check_sharded_state(opt, params, sd, what)
        replicated = (sd["hybrid"]["offloaded"], sd["param_groups"],
                      {i: int(e["step"]) for i, e in sd["state"].items()})
        everyone: List[Any] = [None] * env.world
        dist.all_gather_object(everyone, replicated)
        assert all(r == everyone[0] for r in everyone), f"{what}: replicated state differs between ranks"
        if layout == "hsdp":
            assert_same_on_ranks(got + [local(v) for e in sd["state"].values() for v in e.values()
                                        if compat.is_dtensor(v)], what)
        dcp_round_trip(env, cfg, model, opt, lambda: fsdp2_model(env, cfg, **meshes[layout]),
                       hybrid,
                       lambda m, o: train(m, o, range(3, 4)), what)
        opt.close()
        if env.cuda:  # what a freshly trained hybrid frees: AdamW's less the offloaded state
            box = dict(zip(("model", "opt"), trained()))
            away = {id(p) for p in box["opt"].offloaded_params() + box["opt"].streamed_params()}
            box["opt"].close()

            def state_bytes(keep: bool) -> int:  # exp_avg and exp_avg_sq of local shards
                return sum(2 * local(p).numel() * local(p).element_size()
                           for p in box["model"].parameters() if (id(p) in away) != keep)

            saved, kept = state_bytes(False), state_bytes(True)
            hybrid_bytes = released(lambda: box.pop("opt"))
            del box
            adamw_bytes = plain_adamw_bytes(layout)
            slack = 2**20 + adamw_bytes // 32  # step counters, flags, sums; 2.1 MB seen at f=0.25
            assert kept - slack <= hybrid_bytes <= adamw_bytes - saved + slack, \
                (f"{what}: frees {hybrid_bytes} B of device memory, AdamW {adamw_bytes} B; "
                 f"the state of the device part is {kept} B, of the offloaded parameters {saved} B")
            ratios.append(hybrid_bytes / adamw_bytes)
    refused = fsdp2_optim_refusals(env, cfg)
    fsdp2_optim_uneven(env)
    return {"held_ratio": max(ratios) if ratios else None, "variants": len(FSDP2_OPTIM_VARIANTS),
            "refused": refused}


def fsdp2_optim_uneven(env: Env) -> None:
    """Uneven shards (rows 3 and 1 over 2 ranks: one rank's shard of the last layer is empty):
    each rank places its own shards (the placements differ), and the result is still
    ``PlacedReference``'s, shard by shard."""
    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.reference import PlacedReference

    fully_shard = compat.fully_shard()

    def model() -> nn.Module:
        torch.manual_seed(0)
        with torch.device(env.device):
            m = nn.Sequential(nn.Linear(16, 3), nn.Tanh(), nn.Linear(3, 16), nn.Linear(16, 1))
        for layer in m:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(m)
        return m

    kw = dict(lr=1e-2, weight_decay=0.1)
    dev = {} if env.cuda else {"device": SimulatedDevice()}
    x0 = torch.zeros(8, 16, device=env.device)
    # Before torch 2.11, FSDP2's lazy initialization (the first forward) moves uneven shards
    # to new memory: an optimizer built before it is refused at its first step, with the fix.
    early = model()
    shards = [local(p).data_ptr() for p in early.parameters()]
    too_early = HybridDeviceOptimizer(early.parameters(), 1.0, stream_fraction=0.5,
                                      overlap="backward_update", **dev, **kw)
    with torch.no_grad():
        early(x0)
    moved = any(local(p).numel() and local(p).data_ptr() != ptr
                for p, ptr in zip(early.parameters(), shards))
    try:  # no backward: a rank refused there would leave the other in FSDP2's reduce-scatter
        too_early.step()
    except OffloadUsageError as e:
        assert moved and "build the optimizer after one forward of the model" in str(e), e
    else:
        assert not moved, "an optimizer over shards FSDP2 moved stepped"
    too_early.close()
    a, b = model(), model()
    with torch.no_grad():  # the fix the error names (and nothing to change on newer torch)
        a(x0), b(x0)
    opt = HybridDeviceOptimizer(a.parameters(), 1.0, stream_fraction=0.5, overlap="backward_update",
                                **dev, **kw)
    ref = PlacedReference.like(opt, list(a.parameters()), b.parameters(), **kw)
    for step in range(3):
        x = torch.randn(8, 16, device=env.device, generator=torch.Generator(env.device).manual_seed(step + 10 * env.rank))
        for m, o in ((a, opt), (b, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert_equal([local(p).detach() for p in a.parameters()], [local(p).detach() for p in b.parameters()],
                 "FSDP2 + HybridDeviceOptimizer, uneven shards")
    assert any(local(p).numel() == 0 for p in a.parameters()) == (env.rank == 1), "no empty shard"
    opt.close()


def check_sharded_state(opt: Any, params: List[torch.Tensor], sd: dict, what: str) -> None:
    """Each parameter's state tensors shaped like it are DTensors laid out as it (``opt.state``
    too); those of offloaded parameters are in CPU memory."""
    offloaded = {id(p) for p in opt.offloaded_params() + opt.streamed_params()}
    assert offloaded, f"{what}: nothing offloaded"
    for i, p in enumerate(params):
        for name, v in sd["state"][i].items():
            if v.dim() == 0:
                continue
            assert compat.is_dtensor(v) and v.placements == p.placements and v.shape == p.shape, \
                f"{what}: state {i} {name} is not laid out as its parameter"
            assert (local(v).device.type == "cpu") or id(p) not in offloaded, \
                f"{what}: offloaded state {i} {name} on {local(v).device}"
        live = opt.state[p]
        assert all(compat.is_dtensor(v) for v in live.values() if v.dim() > 0), what


def dcp_round_trip(env: Env, cfg: GPTConfig, model: nn.Module, opt: Any,
                   new_model: Callable[[], nn.Module], new_opt: Callable[[nn.Module], Any],
                   step: Callable[[nn.Module, Any], None], what: str) -> None:
    """``get_optimizer_state_dict`` steps nothing; saved with ``torch.distributed.checkpoint``
    and loaded into ``new_opt`` over a copy of ``model``, one more ``step`` on both gives the
    same bits."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    before = [local(p).detach().clone() for p in model.parameters()]
    steps = {i: int(e["step"]) for i, e in opt.state_dict()["state"].items()}
    osd = get_optimizer_state_dict(model, opt)
    assert_equal([local(p).detach() for p in model.parameters()], before,
                 f"{what}: get_optimizer_state_dict changed a parameter")
    assert {i: int(e["step"]) for i, e in opt.state_dict()["state"].items()} == steps, \
        f"{what}: get_optimizer_state_dict stepped"
    where = [tempfile.mkdtemp(prefix="fsdp2-optim-") if env.rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    try:
        dcp.save(osd, checkpoint_id=where[0])
        other = new_model()
        with torch.no_grad():
            for mine, theirs in zip(other.parameters(), model.parameters()):
                local(mine).copy_(local(theirs))
        other_opt = new_opt(other)
        loaded = get_optimizer_state_dict(other, other_opt)  # the layout to load into
        dcp.load(loaded, checkpoint_id=where[0])
        set_optimizer_state_dict(other, other_opt, loaded)
        dist.barrier()
    finally:
        if env.rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    step(model, opt)
    step(other, other_opt)
    opt.wait_params()
    other_opt.wait_params()
    assert_equal([local(p).detach() for p in other.parameters()],
                 [local(p).detach() for p in model.parameters()],
                 f"{what}: a step after the DCP round trip")
    other_opt.close()


def fsdp2_optim_refusals(env: Env, cfg: GPTConfig) -> List[str]:
    """``max_grad_norm`` over FSDP2 parameters, and FSDP2's ``CPUOffloadPolicy``, raise an
    ``OffloadConfigError`` naming the fix (the policy: at construction on a GPU, where the shards
    are on the CPU; at ``register_forward_waits`` on the CPU, where they are anyway)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from cpu_offload.core.errors import OffloadConfigError
    from cpu_offload.optim import HybridDeviceOptimizer

    device = {} if env.cuda else {"device": SimulatedDevice()}
    seen = []
    model = fsdp2_model(env, cfg)
    try:
        HybridDeviceOptimizer(model.parameters(), 0.5, max_grad_norm=1.0, **device)
    except OffloadConfigError as e:
        assert "clip_grad_norm_" in str(e), e
        seen.append("max_grad_norm")
    model = fsdp2_model(env, cfg, offload_policy=CPUOffloadPolicy(pin_memory=env.cuda))
    try:
        opt = HybridDeviceOptimizer(model.parameters(), 0.5, **device)
        try:
            opt.register_forward_waits(model)
        finally:
            opt.close()
    except OffloadConfigError as e:
        assert "CPUOffloadPolicy" in str(e), e
        seen.append("CPUOffloadPolicy")
    assert seen == ["max_grad_norm", "CPUOffloadPolicy"], seen
    return seen


def case_zero_optim(env: Env) -> dict:
    """``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP) with ``HybridDeviceOptimizer`` as each rank's
    local optimizer, given as ``functools.partial`` (its own arguments stay out of ZeRO's param
    groups): each rank offloads half of its partition and takes the offloaded gradients from
    DDP's reduced buckets (``ddp_comm_hook`` of ``zero.optim``), updating during backward.
    Three steps, a different batch per rank and step: parameters ``torch.equal`` to the same
    ZeRO run whose local optimizer is ``PlacedReference`` of that rank's hybrid (same partition),
    the same on both ranks; ``consolidate_state_dict`` gathers the hybrid's state on rank 0.
    ``overlap="next_forward"`` is left out: ZeRO broadcasts each partition right after
    ``step()`` returns, before its updates land."""
    import functools

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpu_offload.optim import HybridDeviceOptimizer
    from cpu_offload.optim.reference import PlacedReference

    cfg = env.config(2)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ids = [env.device.index] if env.cuda else None
    device = {} if env.cuda else {"device": SimulatedDevice()}
    ddp = DDP(build_model(cfg, env.device, seed=0), device_ids=ids)
    local_cls = functools.partial(HybridDeviceOptimizer, offload_fraction=0.5, stream_fraction=0.5,
                                  overlap="backward_update", **device)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=local_cls, **kw)
    hybrid = zero.optim
    ddp.register_comm_hook(*hybrid.ddp_comm_hook())

    class Placed(torch.optim.Optimizer):
        """This rank's partition stepped as ``PlacedReference`` of its hybrid."""

        def __init__(self, groups: Any, **hyper: Any) -> None:
            super().__init__(groups, hyper)
            mine = [p for g in self.param_groups for p in g["params"]]
            theirs = [p for g in hybrid.param_groups for p in g["params"]]
            self.ref = PlacedReference.like(hybrid, theirs, mine, **hyper)

        def step(self, closure: Any = None) -> None:
            self.ref.step()

    ref = DDP(build_model(cfg, env.device, seed=0), device_ids=ids)
    ref_zero = ZeroRedundancyOptimizer(ref.parameters(), optimizer_class=Placed, **kw)
    for step in range(3):
        x = make_input(cfg, env.device, seed=10 * step + env.rank, requires_grad=False)
        for net, opt in ((ddp, zero), (ref, ref_zero)):
            loss_of(net(x)).backward()
            opt.step()
            opt.zero_grad()
    assert hybrid.offloaded_params() and hybrid.streamed_params(), "nothing offloaded"
    got = [p.detach() for p in ddp.parameters()]
    assert_equal(got, [p.detach() for p in ref.parameters()],
                 "ZeroRedundancyOptimizer(HybridDeviceOptimizer) against PlacedReference")
    assert_same_on_ranks(got, "ZeroRedundancyOptimizer(HybridDeviceOptimizer)")
    zero.consolidate_state_dict(to=0)
    states = len(zero.state_dict()["state"]) if env.rank == 0 else None
    hybrid.close()
    return {"consolidated_states": states, "params": len(got)}


def run_cases(cases: List[str], device_kind: str) -> None:
    """Run ``cases`` one after the other in one process group; stop at the first failure."""
    env = Env(device_kind)
    try:
        for case in cases:
            env.sims.clear()
            if not env.cuda and case in CPU_NEEDS_2_8 and compat.TORCH_VERSION < Version("2.8"):
                if env.rank == 0:
                    emit("RESULT", {"case": case, "skipped": f"{case} on CPU/gloo needs torch "
                                    f">= 2.8, found {torch.__version__}"})
                continue
            if case == "ddp":
                result = case_ddp(env)
            elif case == "fsdp2":
                result = case_fsdp2(env)
            elif case == "fsdp2-apply":
                result = case_fsdp2_apply(env)
            elif case == "ddp-optim":
                result = case_ddp_optim(env)
            elif case == "ddp-optim-clip":
                result = case_ddp_optim_clip(env)
            elif case == "fsdp2-optim":
                result = case_fsdp2_optim(env)
            elif case == "zero-optim":
                result = case_zero_optim(env)
            elif case in ("pipeline-gpipe", "pipeline-1f1b"):
                result = case_pipeline(env, case.split("-", 1)[1])
            elif case == "tp":
                result = case_tp(env)
            else:
                raise ValueError(f"unknown case {case!r}; one of {CASES}")
            dist.barrier()
            result.update(case=case, device=device_kind, torch=torch.__version__, world=env.world)
            if env.rank == 0:
                emit("RESULT", result)
    except BaseException:
        dist.destroy_process_group()
        raise
    emit("TEARDOWN", env.close())


def emit(kind: str, data: dict) -> None:
    """Print ``kind {json}`` as one write: torchrun's workers are unbuffered (``-u``), where
    ``print`` writes the line and its newline separately, and a line another rank writes
    meanwhile would land in between (seen: two TEARDOWN lines on one line)."""
    sys.stdout.write(f"{kind} {json.dumps(data)}\n")
    sys.stdout.flush()


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", required=True,
                        help=f"one of {', '.join(CASES)}, or several separated by commas")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=DEVICE_KINDS,
                        help="default: cuda where CUDA is available, else cpu; cuda-shared: both "
                             "ranks on GPU 0 over gloo (the cases in SHARED_GPU_CASES)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but CUDA is not available here; run with --device "
                     "cpu (gloo, the simulated device and a tiny model), the default on such machines")
    cases = args.case.split(",")
    known = SHARED_GPU_CASES if args.device == "cuda-shared" else CASES
    unknown = [c for c in cases if c not in known]
    if unknown:
        parser.error(f"unknown case(s) {unknown} for --device {args.device}; choose from {known}")
    if args.device == "cuda":  # NCCL: destroy_process_group shuts its threads down
        run_cases(cases, args.device)
        return
    try:
        run_cases(cases, args.device)
    except BaseException:
        traceback.print_exc()
        exit_skipping_shutdown(1)
    exit_skipping_shutdown(0)


def exit_skipping_shutdown(code: int) -> None:
    """End this process now, without the interpreter's shutdown, which a thread of gloo's can
    abort: how every rank ends on the CPU, after ``destroy_process_group``.

    Gloo runs each collective on one of the group's worker threads, which lets go of the work,
    and of its tensors, only after the waiting rank went on. Releasing a tensor whose Python
    object C++ keeps alive takes the GIL (from torch 2.10 also one that Python still holds).
    When the interpreter is already shutting down, taking the GIL ends the thread; the unwinding
    meets a ``noexcept`` destructor and std::terminate aborts the rank: "terminate called
    without an active exception", exit code -6, after every RESULT was printed. Seen in one run
    in two to six with ``ddp-optim`` last (its parameter broadcasts come just before the final
    barrier); in the core dump a ``ProcessGroupGloo::runLoop`` thread was in
    ``~AsyncBroadcastWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit`` while the main thread was in ``Py_FinalizeEx``.

    Joining those threads first is not possible here. Gloo has no shutdown: only the group's
    destructor joins them, and ``destroy_process_group`` only drops torch.distributed's own
    references, while torch keeps others to the end of the process (DDP imports
    ``torch.distributed.nn.functional``, whose default arguments are ``group=group.WORLD``;
    DTensor's caches hold ``DeviceMesh`` objects, which hold their groups). And where the group
    is freed, on torch 2.6 its destructor runs with the GIL held and joins a worker that waits
    for the GIL: a hang (seen). So the group stays referenced (``Env.group``) and the process
    ends with ``os._exit``, which stops gloo's threads where they are. Our own threads were
    checked before (``Env.close``); the output is flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- launching from pytest ---------------------------------------------------------------------


def launch(cases: List[str], device_kind: str, timeout: float, nproc: int = 2) -> tuple:
    """Run this file under ``torchrun --standalone --nproc-per-node nproc`` (a subprocess of the
    current interpreter, importing the same ``cpu_offload``). Returns (returncode, output,
    {case: result}); a run past ``timeout`` seconds (a hang) is killed and returns code None."""
    return torchrun([os.path.abspath(__file__), "--case", ",".join(cases),
                     "--device", device_kind], timeout, nproc)


def torchrun(script_and_args: List[str], timeout: float, nproc: int = 2) -> tuple:
    """``torchrun --standalone --nproc-per-node nproc script args...``; see ``launch``."""
    import subprocess

    import cpu_offload

    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_offload.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", *script_and_args,
    ]
    # Own session, so that a hang is ended with torchrun's workers, not only torchrun itself.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    results = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["case"]] = r
    return code, out, results


if __name__ == "__main__":
    sys.exit(main())
