"""Non-reentrant ``torch.utils.checkpoint`` around offload-context layers (issue 27, defect 1).

Such a checkpoint region stores nothing it saves: its pack hook numbers the saved tensors and
its recomputation in backward pairs the recomputed ones with those numbers in order. The
offload context used to install its hooks inside the region in forward (shadowing checkpoint's)
but not in the recomputation, so checkpoint paired recomputed tensors with the wrong slots:
silently wrong gradients when the shapes agree (as here: the ``mid``/``head`` blocks save what
a layer saves), ``CheckpointError`` otherwise. Now the context steps aside inside such a region
(the layer is counted, nothing hooked or offloaded) and every program below is bit-exact against
the same program without offloading, on both backends, with ``with ctx:`` blocks and with
``apply_offloading``, whether anything is offloaded or not.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cpu_offload
from cpu_offload import SimulatedDevice, apply_offloading, get_cpu_offload_context
from cpu_offload.compat import top_saved_tensors_hooks

N = 4  # layers in the stack
OFFLOADED = 2  # num_layers: the first two are offloaded


class Block(nn.Module):
    """Linear, LayerNorm, GELU and a residual. Under V1 (``tag``) the linear output is tagged,
    so that V1 offloads it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.act = nn.GELU()
        self.tag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.tag:
            cpu_offload.mark_activation_offload(h)
        return self.act(self.norm(h)) + x


class Stack(nn.Module):
    """``N`` offload-context layers, plus ``mid`` and ``head`` blocks that are not offload-context
    layers but run inside the checkpoint regions (so the regions save tensors outside the
    context too, with the same shapes as a layer's)."""

    def __init__(self, d: int, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Block(d) for _ in range(N))
        self.mid = Block(d)
        self.head = Block(d)
        self.to(device)

    def layer(self, i: int, t: torch.Tensor, ctx, sync, mode: str) -> torch.Tensor:
        layer = self.layers[i]
        if mode.startswith("per_layer"):
            reentrant = mode == "per_layer_reentrant"
            # With apply_offloading (ctx None) the checkpoint wraps the instrumented layer, as
            # torch's checkpoint_wrapper does; with `with ctx:` it runs inside the context.
            run = lambda u: checkpoint(layer, u, use_reentrant=reentrant)  # noqa: E731
        else:
            run = layer
        if ctx is None:  # no offloading, or apply_offloading (the layer enters the context)
            return run(t)
        with ctx:
            t = run(t)
        return sync(t)

    def forward(self, x: torch.Tensor, mode: str, ctx=None, sync=None) -> torch.Tensor:
        def run(t: torch.Tensor, first: int, last: int) -> torch.Tensor:
            for i in range(first, last):
                t = self.layer(i, t, ctx, sync, mode)
            return t

        if mode in ("around", "reentrant"):  # checkpoint around the whole stack and the head
            return checkpoint(
                lambda t: self.head(run(t, 0, N)), x, use_reentrant=mode == "reentrant"
            )
        if mode == "partial":  # layer 0, then a region with layers 1-2 and mid, then layer 3
            t = run(x, 0, 1)
            t = checkpoint(lambda u: self.mid(run(u, 1, 3)), t, use_reentrant=False)
            return self.head(run(t, 3, N))
        assert mode.startswith("per_layer")
        return self.head(run(x, 0, N))


def step(model: Stack, x0: torch.Tensor, mode: str, ctx=None, sync=None):
    """Forward, backward: the output, the input's gradient and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = model(x, mode, ctx, sync)
    out.float().square().mean().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _same(a, b) -> bool:
    """Bit-identical gradients, or both None (a block the program does not use)."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def assert_exact(got, ref) -> None:
    assert torch.equal(got[0], ref[0]), "outputs differ"
    assert torch.equal(got[1], ref[1]), "input gradients differ"
    assert list(got[2]) == list(ref[2])
    bad = [n for n, want in ref[2].items() if not _same(got[2][n], want)]
    assert not bad, f"parameter gradients differ: {bad}"


def assert_nothing_left(handle=None, ctx=None) -> None:
    """No saved-tensor hooks, no active context, nothing held for a finished step."""
    assert top_saved_tensors_hooks() is None
    assert not cpu_offload.is_cpu_offload_enabled()
    synchronizer = getattr(handle, "synchronizer", None) or getattr(ctx, "synchronizer", None)
    if synchronizer is not None:  # V2
        assert synchronizer.held_device_bytes() == 0
        assert synchronizer.held_host_bytes() == 0


def offload_kwargs(backend: str, offload: bool, device) -> dict:
    """V2 offloads by size; V1 offloads tagged tensors (tagging is switched on the model)."""
    kwargs = {"device": device}
    if backend == "v2":
        kwargs["min_tensor_size_to_offload"] = 0 if offload else 10**9
    return kwargs


def tag(model: Stack, on: bool) -> None:
    for block in model.modules():
        if isinstance(block, Block):
            block.tag = on


MODES = ["around", "partial", "per_layer", "per_layer_reentrant", "reentrant"]
# apply_offloading refuses single layers under a reentrant checkpoint (they run without grad)
CASES = [
    (entry, mode) for entry in ("ctx", "apply") for mode in MODES
    if (entry, mode) != ("apply", "per_layer_reentrant")
]


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "nothing_offloaded"])
@pytest.mark.parametrize("entry, mode", CASES)
def test_checkpoint_regions_around_offloaded_layers_are_exact(backend, entry, mode, offload):
    model, x0 = Stack(16), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = step(model, x0, mode)
    tag(model, backend == "v1" and offload)
    sim = SimulatedDevice()
    kwargs = offload_kwargs(backend, offload, sim)
    with warnings.catch_warnings():
        # "freed no GPU memory" / "none is tagged": nothing to offload in some of these programs
        warnings.simplefilter("ignore", UserWarning)
        if entry == "ctx":
            ctx, sync = get_cpu_offload_context(
                enabled=True, num_layers=OFFLOADED, model_layers=N, **kwargs
            )
            handle = None
        else:
            ctx = sync = None
            handle = apply_offloading(model.layers, num_layers=OFFLOADED, **kwargs)
        for _ in range(2):  # the second step reuses the context and its pinned buffers
            assert_exact(step(model, x0, mode, ctx, sync), ref)
            assert_nothing_left(handle, ctx)
    copied = len(sim.copies("d2h"))
    if offload and mode == "partial":
        assert copied > 0  # layer 0 runs outside any region: it is offloaded
    if offload and mode == "per_layer" and entry == "ctx" and backend == "v2":
        assert copied > 0  # a checkpoint inside `with ctx:`: its input moves (untagged for V1)
    if mode == "around" or (mode == "per_layer" and entry == "apply"):
        assert copied == 0  # a region around the context keeps nothing of its layers
    if handle is not None:
        handle.remove()
        assert_exact(step(model, x0, mode), ref)


def test_whole_stack_in_a_checkpoint_region_is_counted_and_warned(sim):
    """V2 counts the layers (the schedule stays aligned for layers outside any region), says
    in its statistics how many offloaded layers ran inside a region, and warns once that
    offloading freed nothing there."""
    model, x0 = Stack(16), torch.randn(8, 16)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=OFFLOADED, model_layers=N, min_tensor_size_to_offload=0,
        device=sim,
    )
    with pytest.warns(UserWarning, match="inside a non-reentrant torch.utils.checkpoint region"):
        step(model, x0, "around", ctx, sync)
    stats = ctx.stats().to_dict()
    assert stats["layers_in_checkpoint"] == OFFLOADED and stats["copied_out_bytes"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per context, and none for a partial region
        step(model, x0, "partial", ctx, sync)
    stats = ctx.stats().to_dict()
    assert stats["layers_in_checkpoint"] == 1 and stats["copied_out_bytes"] > 0


def test_selective_layers_inside_a_checkpoint_region_are_exact(sim):
    """Selective recomputation steps aside inside the region too (the region recomputes the
    whole layer anyway); outside it, selective layers still store recipes."""
    model, x0 = Stack(16), torch.randn(8, 16)
    refs = {mode: step(model, x0, mode) for mode in ("around", "partial")}
    handle = apply_offloading(
        model.layers, num_layers=1, selective=True, min_tensor_size_to_offload=0, device=sim
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for mode, ref in refs.items():
            for _ in range(2):
                assert_exact(step(model, x0, mode), ref)
                assert_nothing_left(handle)
    assert handle.synchronizer.stats().to_dict()["recipe_tensors"] > 0  # layers 0 and 3
    handle.remove()


# --- a Hugging Face Llama whose model.model is checkpointed whole -----------------------------


def _llama_step(model, ids, whole: bool):
    """The loss and every gradient; ``whole``: ``model.model`` runs under one non-reentrant
    checkpoint."""
    model.zero_grad(set_to_none=True)
    if whole:
        hidden = checkpoint(
            lambda i: model.model(input_ids=i, use_cache=False).last_hidden_state,
            ids, use_reentrant=False,
        )
    else:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "whole_and_per_layer"])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "nothing_offloaded"])
def test_llama_with_model_model_checkpointed_whole_is_exact(backend, offload, per_layer, sim):
    pytest.importorskip("transformers")
    from test_hf_llama import MIN_SIZE, batch, tiny_llama

    model, ids = tiny_llama(), batch()
    if per_layer:  # HF per-layer checkpointing inside the whole-model region as well
        # transformers >= 5.18 names it activation_checkpointing_enable (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    ref = _llama_step(model, ids, whole=True)
    kwargs = {"device": sim}
    if backend == "v2":
        kwargs["min_tensor_size_to_offload"] = MIN_SIZE if offload else 10**9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = apply_offloading(model.model.layers, num_layers=2, **kwargs)
        for _ in range(2):
            loss, grads = _llama_step(model, ids, whole=True)
            assert torch.equal(loss, ref[0])
            bad = [n for n in ref[1] if not torch.equal(grads[n], ref[1][n])]
            assert not bad, f"gradients differ: {bad[:4]}"
            assert_nothing_left(handle)
        assert not sim.copies("d2h")  # the region keeps no activation of its layers
        if backend == "v2" and offload:
            # Outside the region the same layers are offloaded, and exact, as before.
            plain = _llama_step(model, ids, whole=False)
            assert sim.copies("d2h")
            handle.remove()
            again = _llama_step(model, ids, whole=False)
            assert torch.equal(plain[0], again[0])
            assert all(torch.equal(plain[1][n], again[1][n]) for n in plain[1])
        else:
            handle.remove()


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["around", "partial", "per_layer"])
@pytest.mark.parametrize("entry", ["ctx", "apply"])
def test_checkpoint_regions_around_offloaded_layers_are_exact_on_cuda(
    backend, entry, mode, deterministic
):
    """The same programs on a GPU, with tensors above the default size threshold (copies on
    the side stream, releases and reloads for real)."""
    model = Stack(1024, device="cuda")
    x0 = torch.randn(512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref = step(model, x0, mode)
    tag(model, backend == "v1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if entry == "ctx":
            ctx, sync = get_cpu_offload_context(enabled=True, num_layers=OFFLOADED, model_layers=N)
            handle = None
        else:
            ctx = sync = None
            handle = apply_offloading(model.layers, num_layers=OFFLOADED)
        for _ in range(3):
            assert_exact(step(model, x0, mode, ctx, sync), ref)
            assert_nothing_left(handle, ctx)
    if backend == "v2" and ctx is not None and mode != "around":
        assert ctx.stats().to_dict()["copied_out_bytes"] > 0
    if handle is not None:
        handle.remove()
    torch.cuda.synchronize()
