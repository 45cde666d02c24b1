"""The embedded GPT workload (``cpu_offload.examples.gpt``): shapes, determinism, the usage
pattern, and the saved-tensor layouts the benchmarks and GPU tests rely on. CPU only."""
from __future__ import annotations

import torch
import torch.utils.checkpoint

from cpu_offload.examples.gpt import (
    GPTBlock,
    GPTStack,
    build_model,
    make_input,
    reference_config,
    run_layers,
    tiny_config,
)


def saved_tensors_of(fn, *args):
    """Run ``fn(*args)`` and return (output, tensors autograd saved for backward, in order)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_configs():
    ref = reference_config()
    assert (ref.hidden, ref.heads, ref.seq, ref.batch, ref.layers) == (4096, 32, 4096, 1, 8)
    assert ref.dtype == torch.bfloat16
    tiny = tiny_config()
    assert tiny.dtype == torch.float32 and tiny.hidden % tiny.heads == 0
    assert tiny.with_(layers=2).layers == 2 and tiny.layers == 4


def test_shapes_and_param_count():
    cfg = tiny_config()
    model = build_model(cfg)
    assert isinstance(model, GPTStack) and isinstance(model.layers, torch.nn.ModuleList)
    assert len(model.layers) == cfg.layers and all(isinstance(b, GPTBlock) for b in model.layers)
    assert sum(p.numel() for p in model.layers[0].parameters()) == cfg.params_per_layer()
    assert all(p.dtype == cfg.dtype for p in model.parameters())
    x = make_input(cfg)
    assert x.shape == cfg.input_shape() and x.requires_grad
    y = model(x)
    assert y.shape == x.shape and y.dtype == cfg.dtype
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in model.parameters())


def test_bf16_builds():
    cfg = tiny_config().with_(dtype=torch.bfloat16, layers=1)
    model = build_model(cfg)
    assert all(p.dtype == torch.bfloat16 and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert model(make_input(cfg)).dtype == torch.bfloat16


def test_deterministic_init_and_input():
    cfg = tiny_config()
    a, b, c = build_model(cfg, seed=0), build_model(cfg, seed=0), build_model(cfg, seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.layers[0].qkv.weight, c.layers[0].qkv.weight)
    assert torch.equal(make_input(cfg, seed=3), make_input(cfg, seed=3))
    assert not torch.equal(make_input(cfg, seed=3), make_input(cfg, seed=4))


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(tiny_config(), seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_runs_are_bit_identical():
    cfg = tiny_config()

    def step():
        model, x = build_model(cfg), make_input(cfg)
        out = model(x)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad] + [p.grad for p in model.parameters()]

    for r1, r2 in zip(step(), step()):
        assert torch.equal(r1, r2)


def test_run_layers_usage_pattern():
    """``with ctx: x = layer(x)`` then ``x = sync(x)``, once per layer, in order."""
    cfg = tiny_config()
    model, x = build_model(cfg), make_input(cfg, requires_grad=False)
    events: list[str] = []

    class Ctx:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")
            return False

    def sync(t):
        events.append("sync")
        return t

    def layer_fn(layer, t):
        events.append(f"layer{list(model.layers).index(layer)}")
        return layer(t)

    out = run_layers(model.layers, x, Ctx(), sync, layer_fn)
    expected = []
    for i in range(cfg.layers):
        expected += ["enter", f"layer{i}", "exit", "sync"]
    assert events == expected
    assert torch.equal(out, model(x))
    assert torch.equal(out, model(x, ctx=Ctx(), sync=sync))


def test_checkpoint_layer_fn_is_exact():
    cfg = tiny_config()
    model, x = build_model(cfg), make_input(cfg)

    def ckpt(layer, t):
        return torch.utils.checkpoint.checkpoint(layer, t, use_reentrant=False)

    ref = model(x)
    ref.sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    out = model(x, layer_fn=ckpt)
    out.sum().backward()
    assert torch.equal(out, ref)
    for g, r in zip([x.grad] + [p.grad for p in model.parameters()], ref_grads):
        assert torch.equal(g, r)


def test_attention_saves_views_of_shared_bases():
    """q, k, v are saved as views of one qkv storage, and the output projection saves a view of
    the storage SDPA saved its output in (CPU's flash kernel lays it out (b, s, h, d), as CUDA's
    do, so ``transpose(1, 2).reshape`` is a contiguous view of a non-contiguous base)."""
    cfg = tiny_config()
    block = build_model(cfg.with_(layers=1)).layers[0]
    _, saved = saved_tensors_of(block, make_input(cfg))
    four_d = [t for t in saved if t.dim() == 4]
    q, k, v = four_d[:3]
    base = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == base == v.untyped_storage().data_ptr()
    assert not q.is_contiguous()
    if len(four_d) == 4:  # SDPA saved its output: the projection input must share its storage
        out = four_d[3]
        shared = [
            t for t in saved
            if t.dim() == 2 and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        ]
        assert shared and shared[0].is_contiguous() and not out.is_contiguous()


def test_tag_activations_marks_the_saved_activations():
    """With tags on, every large non-parameter tensor saved for backward carries the V1 tag,
    except the ones an op creates and saves itself (SDPA output/logsumexp, LayerNorm stats)."""
    cfg = tiny_config()
    model = build_model(cfg.with_(layers=1))
    block = model.layers[0]
    x = make_input(cfg)
    _, untagged = saved_tensors_of(block, x)
    assert not any(getattr(t, "activation_offloading", False) for t in untagged)

    model.set_tag_activations(True)
    _, saved = saved_tensors_of(block, make_input(cfg))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = [
        t for t in saved if t.untyped_storage().data_ptr() not in params and t.numel() >= cfg.hidden * cfg.seq
    ]
    tagged = [t for t in activations if getattr(t, "activation_offloading", False)]
    # x, ln1 out, q, k, v, attention out (reshaped), residual, ln2 out, fc1 out, gelu out.
    assert len(tagged) == 10
    assert len(activations) - len(tagged) <= 1  # SDPA's own saved output (if it saves one)
