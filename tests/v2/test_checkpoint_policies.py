"""torch's checkpoint offload policies honoured: under ``cpu_offload.create_selective_checkpoint_contexts``
an op whose policy says ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` is saved and moved by the
offload engine (statistics show its bytes) instead of recomputed as plain torch does; gradients
identical. Skipped where torch lacks the policies."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cpu_offload
from cpu_offload.compat import TorchDispatchMode, cpu_offload_policies

pytestmark = pytest.mark.skipif(not cpu_offload_policies(), reason="torch lacks CPU offload policies")

MM = torch.ops.aten.mm.default


def policy_for(answer):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        if op is MM:
            return getattr(CheckpointPolicy, answer)
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Block(torch.nn.Module):
    """Checkpointed inside: mm -> gelu -> mm, with the given context_fn."""

    def __init__(self, dim: int, context_fn) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(dim, 4 * dim) / dim ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(4 * dim, dim) / dim ** 0.5)
        self.context_fn = context_fn

    def body(self, x):
        return x + torch.nn.functional.gelu(x @ self.w1) @ self.w2

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False, context_fn=self.context_fn)


def blocks(context_fn, n=4, dim=32, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block(dim, context_fn) for _ in range(n)).to(device)


class CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is MM
        return func(*args, **(kwargs or {}))


def run(layers, x0):
    x = x0.detach().clone().requires_grad_()
    h = x.reshape(-1, x.shape[-1])
    for layer in layers:
        h = layer(h)
    counter = CountMM()
    with counter:
        h.square().sum().backward()
    return [x.grad] + [p.grad for p in layers.parameters()], counter.count


@pytest.mark.parametrize("answer", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_offload_policy_offloads_through_the_engine_where_torch_recomputes(answer, sim):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x0 = torch.randn(64, 32)
    policy = policy_for(answer)
    plain, plain_mms = run(blocks(functools.partial(create_selective_checkpoint_contexts, policy)), x0)
    ours_fn = functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy)
    layers = blocks(ours_fn)
    handle = cpu_offload.apply_offloading(layers, num_layers=2, min_tensor_size_to_offload=1, device=sim)
    got, mms = run(layers, x0)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    # torch recomputes x @ w1 of each of the 4 blocks in backward (its recomputation stops before
    # the second mm, whose output nothing saved); ours reloads it instead
    assert plain_mms - mms == 4
    stats = handle.stats().to_dict()["layers"]
    mm_bytes = 64 * 128 * 4 + 64 * 32 * 4  # x @ w1 and gelu(...) @ w2
    # offloaded layers: checkpoint input (held elsewhere for layer 0) + both mm outputs
    assert stats[1]["copied_out_bytes"] == 64 * 32 * 4 + mm_bytes
    assert stats[1]["freed_bytes"] == 64 * 32 * 4 + mm_bytes
    assert stats[0]["copied_out_bytes"] == stats[1]["copied_out_bytes"]
    handle.remove()


def test_other_policies_and_outside_a_context_behave_as_torch(sim):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x0 = torch.randn(64, 32)
    for answer in ("MUST_SAVE", "PREFER_RECOMPUTE"):
        policy = policy_for(answer)
        ref, ref_mms = run(blocks(functools.partial(create_selective_checkpoint_contexts, policy)), x0)
        got, mms = run(blocks(functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy)), x0)
        assert mms == ref_mms and all(torch.equal(a, b) for a, b in zip(got, ref))
    # an offload policy outside any offload context: recomputed as torch does, with a warning
    policy = policy_for("MUST_CPU_OFFLOAD")
    ref, ref_mms = run(blocks(functools.partial(create_selective_checkpoint_contexts, policy)), x0)
    with pytest.warns(UserWarning, match="outside cpu_offload's offload context"):
        got, mms = run(blocks(functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy)), x0)
    assert mms == ref_mms and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.gpu
def test_gpu_offload_policy_lowers_the_peak_with_identical_gradients(deterministic):
    """On CUDA: the policy's mm outputs leave the GPU (peak below saving them there, MUST_SAVE)
    and gradients are bit-identical to torch's recomputation of them."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    dim, n = 1024, 8
    x0 = torch.randn(8192, dim, device="cuda")
    ref, _ = run(blocks(functools.partial(create_selective_checkpoint_contexts, policy_for("MUST_CPU_OFFLOAD")),
                        n, dim, "cuda"), x0)

    def peak(context_fn, offload):
        layers = blocks(context_fn, n, dim, "cuda")
        handle = cpu_offload.apply_offloading(layers, num_layers=n - 2) if offload else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads, _ = run(layers, x0)
        torch.cuda.synchronize()
        if handle is not None:
            handle.remove()
        return torch.cuda.max_memory_allocated() - base, grads

    saved_peak, _ = peak(functools.partial(create_selective_checkpoint_contexts, policy_for("MUST_SAVE")), False)
    ours_peak, got = peak(
        functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy_for("MUST_CPU_OFFLOAD")), True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    mm_bytes = 8192 * (4 * dim + dim) * 4
    assert ours_peak < saved_peak - 2 * mm_bytes, (ours_peak, saved_peak)


def test_the_checkpoint_policies_page_runs(capsys):
    """The python blocks of docs/checkpoint_policies.md run on the CPU; its matmul outputs are
    moved (3 tensors per offloaded layer: the checkpoint input and two matmul outputs)."""
    import pathlib
    import re

    pytest.importorskip("transformers")  # its last block is the Hugging Face route
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "checkpoint_policies.md"
    if not page.exists():
        pytest.skip("not run from a checkout")
    scope: dict = {}  # the blocks run in order, as one program
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        exec(compile(block, str(page), "exec"), scope)
    assert "layer 1: 3 tensors" in capsys.readouterr().out


def mlp_layers(n=4, dim=32):
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim, bias=False), torch.nn.GELU(),
                            torch.nn.Linear(4 * dim, dim, bias=False))
        for _ in range(n)
    )


def test_apply_offloading_selective_policy(sim):
    """``apply_offloading(layers, selective=policy)``: every layer checkpointed with the policy;
    the same as torch's checkpoint with torch's contexts, except that the offload answers move."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x0 = torch.randn(64, 32)
    policy = policy_for("MUST_CPU_OFFLOAD")

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, policy))

    plain = torch.nn.ModuleList(Checkpointed(m) for m in mlp_layers())
    ref, ref_mms = run(plain, x0)
    layers = mlp_layers()
    handle = cpu_offload.apply_offloading(
        layers, num_layers=2, selective=policy, min_tensor_size_to_offload=1, device=sim)
    assert handle.recompute == (0, 1, 2, 3)
    got, mms = run(layers, x0)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert ref_mms - mms == 4  # x @ w1 reloaded, not recomputed, in each layer
    stats = handle.stats().to_dict()["layers"]
    # x @ w1 (64 x 128) left the device; without the policy an offloaded layer under a plain
    # checkpoint frees only its input (64 x 32), which here is also the previous layer's output
    assert stats[1]["freed_bytes"] >= 64 * 128 * 4, stats[1]
    handle.remove()
    assert all(type(m) is torch.nn.Sequential for m in layers)
    with pytest.raises(cpu_offload.OffloadConfigError, match="pass one of them"):
        cpu_offload.apply_offloading(layers, plan=cpu_offload.Plan(1, ()), selective=policy, device=sim)



def test_an_offloaded_output_mutated_in_the_region_raises_as_torch_does(sim):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op is MM else CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(32, 32, requires_grad=True)

    def body(x):
        y = x @ w
        y.mul_(2)  # mutates the cached (offloaded) mm output
        return y.sum()

    ctx, sync = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=1, device=sim)
    context_fn = functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy)
    with pytest.raises(RuntimeError, match="mutated"):
        with ctx:
            checkpoint(body, torch.randn(8, 32), use_reentrant=False, context_fn=context_fn)
