"""A Hugging Face ``LlamaForCausalLM`` end to end through ``apply_offloading``.

CPU tests build a tiny model from a config (random weights, nothing downloaded) and run it on the
simulated device; ``gpu``-marked tests run the workload of ``benchmarks/hf_llama_benchmark.py``
(16 layers, hidden 2048, seq 4096, bf16) on CUDA with deterministic kernels. Skipped when
transformers is not installed.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.compat import reset_compiled  # noqa: E402
from cpu_offload import apply_offloading, plan_offloading  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
# Tiny model: hidden states (2*32*64 elements) and MLP activations are offloaded; RoPE cos/sin
# (2*32*16), shared by all layers, stay below the threshold (see test_shared_rope_tensors_*).
MIN_SIZE = 2048


def tiny_llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers}))
    return model.train()


def batch(vocab: int = 128, seq: int = 32, size: int = 2, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (size, seq), generator=gen).to(device)


def train_step(model, ids):
    """Forward + backward; the loss and every gradient, by parameter name."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_exact(got, ref):
    assert torch.equal(got[0], ref[0])
    assert list(got[1]) == list(ref[1])
    bad = [n for n in ref[1] if not torch.equal(got[1][n], ref[1][n])]
    assert not bad, f"gradients differ: {bad[:4]}"


def copies(sim) -> int:
    return sum(1 for e in sim.log if e[0] == "copy")


def test_llama_gradients_bit_identical_and_state_dict_unchanged(sim):
    model, ids = tiny_llama(), batch()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    ref = train_step(model, ids)
    handle = apply_offloading(
        model.model.layers, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim
    )
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    for _ in range(2):
        assert_exact(train_step(model, ids), ref)
    summary = handle.synchronizer.layer_summary()
    assert [s["offloaded"] for s in summary] == [True, True, False, False]
    assert summary[0]["bytes"] > 0 and copies(sim) > 0
    # A checkpoint saved with offloading on loads into a model without it, and back.
    fresh = tiny_llama(seed=3)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())
    with torch.no_grad():  # evaluation / generation-style forwards are not offloaded
        n = copies(sim)
        model.eval()(input_ids=ids)
        assert copies(sim) == n
    model.train()
    handle.remove()
    assert type(model.model.layers[0]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer
    assert_exact(train_step(model, ids), ref)


def test_llama_compiled_layers_before_and_after_applying(sim):
    """Layer 0 compiled in place before applying, layer 1 after (aot_eager: no C++ compiler).
    The reference is the same compiled model without offloading: compiled kernels may round
    differently from eager ones (they do on torch 2.6 and 2.8)."""
    model, ids = tiny_llama(layers=3), batch()
    model.model.layers[0].compile(backend="aot_eager")
    plain = model.model.layers[1]
    model.model.layers[1] = torch.compile(plain, backend="aot_eager")
    ref = train_step(model, ids)
    model.model.layers[1] = plain
    handle = apply_offloading(
        model.model.layers, num_layers=1, min_tensor_size_to_offload=MIN_SIZE, device=sim
    )
    model.model.layers[1] = torch.compile(model.model.layers[1], backend="aot_eager")
    try:
        for _ in range(2):
            loss, grads = train_step(model, ids)
            assert torch.equal(loss, ref[0])
            for (name, want), got in zip(ref[1].items(), grads.values()):
                assert torch.equal(got, want), name
        assert handle.synchronizer.layer_summary()[0]["bytes"] > 0
    finally:
        reset_compiled()


@pytest.mark.parametrize("order", ["checkpointing_first", "offloading_first"])
def test_llama_with_hf_gradient_checkpointing(order, sim):
    model, ids = tiny_llama(), batch()
    ref = train_step(model, ids)
    # transformers >= 5.18 names it activation_checkpointing_enable (the old name warns)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    if order == "checkpointing_first":
        enable()
    handle = apply_offloading(
        model.model.layers, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim
    )
    if order == "offloading_first":
        enable()
    for _ in range(2):
        assert_exact(train_step(model, ids), ref)
    # Checkpointed layers keep only their inputs; the offloaded layers move those.
    assert [s["storages"] for s in handle.synchronizer.layer_summary()][:2] == [1, 1]
    handle.remove()


def test_llama_plan_from_plan_offloading_applied(sim):
    model, ids = tiny_llama(layers=6), batch()
    ref = train_step(model, ids)
    plan = plan_offloading(
        lambda: train_step(model, ids), model.model.layers, 0.45, device=sim,
        min_tensor_size_to_offload=MIN_SIZE, link_gbps=0.5, repeats=1,
    )
    # Which mix wins depends on this machine's timings; at 0.45 at least 3 of 6 layers must go.
    assert plan.num_layers + len(plan.recompute) >= 3, plan.describe()
    assert plan.peak_bytes <= plan.memory_budget_bytes
    handle = apply_offloading(model.model.layers, plan=plan, device=sim)
    for _ in range(2):
        assert_exact(train_step(model, ids), ref)
    handle.remove()


def test_llama_offload_and_recompute_plan(sim):
    """A plan that offloads layers 0-1 and recomputes layers 2-3 of 5."""
    from cpu_offload.plan.search import Plan

    model, ids = tiny_llama(layers=5), batch()
    ref = train_step(model, ids)
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
             for i, layer in enumerate(model.model.layers)]
    handle = apply_offloading(
        model.model.layers, plan=Plan(2, (2, 3)), min_tensor_size_to_offload=MIN_SIZE, device=sim
    )
    for _ in range(2):
        calls.clear()
        assert_exact(train_step(model, ids), ref)
        assert sorted(calls) == [0, 1, 2, 2, 3, 3, 4]  # layers 2 and 3 ran again in backward
    summary = handle.synchronizer.layer_summary()
    assert [s["offloaded"] for s in summary] == [True, True, False, False, False]
    handle.remove()
    for h in hooks:
        h.remove()


def test_llama_audit_from_a_real_step(sim):
    model, ids = tiny_llama(), batch()
    policy = cpu_offload.v2.selection.SelectionPolicy(
        min_tensor_size_to_offload=MIN_SIZE, is_device_tensor=sim.is_device_tensor
    )
    report = cpu_offload.audit_offload_selection(
        model.model.layers, step_fn=lambda: train_step(model, ids), policy=policy
    )
    assert len(report.layers) == 4 and all(a.v2_bytes > 0 for a in report.layers)
    assert "too small" in report.layers[0].v2_skipped()  # cos/sin, norm statistics
    assert "LlamaDecoderLayer" in str(report)


def test_shared_rope_tensors_are_moved_at_most_once(sim):
    """RoPE cos/sin are made once per forward and saved by every layer: each moves out once and
    back once per step, whichever layers share it (the model drops them after its forward, so
    offloading them does free memory until backward)."""
    model, ids = tiny_llama(), batch()
    ref = train_step(model, ids)
    sizes = []
    model.model.rotary_emb.register_forward_hook(
        lambda m, a, out: sizes.append(out[0].numel() * out[0].element_size())
    )
    handle = apply_offloading(model.model.layers, num_layers=2, min_tensor_size_to_offload=1, device=sim)
    for _ in range(2):
        assert_exact(train_step(model, ids), ref)
    handle.remove()
    rope_bytes = sizes[0]
    assert len([c for c in sim.copies("d2h") if c[2] == rope_bytes]) == 2 * 2  # cos, sin; 2 steps
    assert len([c for c in sim.copies("h2d") if c[2] == rope_bytes]) == 2 * 2


# --- Hugging Face Trainer (the recipes of docs/huggingface.md) -----------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _train(model, tmp_path, callbacks=()):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=list(callbacks))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers' Trainer needs accelerate"
)


@needs_accelerate
def test_trainer_one_call_before_train(tmp_path, sim):
    ref = _train(tiny_llama(), tmp_path)
    model = tiny_llama()
    # docs/huggingface.md: one call before trainer.train() (device=sim: no GPU here).
    handle = cpu_offload.apply_offloading(
        model.model.layers, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim
    )
    assert _train(model, tmp_path) == ref and len(ref) == 3
    assert copies(sim) > 0
    handle.remove()


@needs_accelerate
def test_trainer_callback(tmp_path, sim):
    from transformers import TrainerCallback

    # docs/huggingface.md: a callback that installs offloading for the run and removes it after.
    class OffloadActivations(TrainerCallback):
        def __init__(self, **offload_kwargs):
            self.offload_kwargs = offload_kwargs
            self.handle = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.handle = cpu_offload.apply_offloading(model.model.layers, **self.offload_kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            self.handle.remove()

    ref = _train(tiny_llama(), tmp_path)
    model = tiny_llama()
    callback = OffloadActivations(num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    assert _train(model, tmp_path, [callback]) == ref
    assert callback.handle.removed and copies(sim) > 0
    assert cpu_offload.offloading_handle(model.model.layers[0]) is None


# --- the benchmark's workload on a GPU -----------------------------------------------------------

GPU_CFG = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
)


@pytest.fixture(scope="module")
def gpu_llama():
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute on the host
        model = LlamaForCausalLM(LlamaConfig(**GPU_CFG))
    model = model.to(dtype=torch.bfloat16).train()
    ids = batch(vocab=32000, seq=4096, size=1, device="cuda")
    gpu_step(model, ids)  # gradient buffers persist from here on, zeroed in place
    return model, ids


def gpu_step(model, ids) -> torch.Tensor:
    """A training step with persistent gradient buffers: its peak is activations + temporaries."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def gpu_snapshot(model, loss):
    return loss.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def peak_of(fn) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_gpu_llama_num_layers_4_bit_identical(gpu_llama):
    model, ids = gpu_llama
    ref = gpu_snapshot(model, gpu_step(model, ids))
    handle = apply_offloading(model.model.layers, num_layers=4)
    try:
        for _ in range(2):
            assert_exact(gpu_snapshot(model, gpu_step(model, ids)), ref)
        assert all(s["bytes"] > 0 for s in handle.synchronizer.layer_summary()[:4])
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def gpu_plan(gpu_llama):
    model, ids = gpu_llama
    return plan_offloading(lambda: gpu_step(model, ids), model.model.layers, 0.6)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_gpu_llama_plan_bit_identical(gpu_llama, gpu_plan):
    model, ids = gpu_llama
    assert gpu_plan.num_layers + len(gpu_plan.recompute) > 0, gpu_plan.describe()
    ref = gpu_snapshot(model, gpu_step(model, ids))
    handle = apply_offloading(model.model.layers, plan=gpu_plan)
    try:
        for _ in range(2):
            assert_exact(gpu_snapshot(model, gpu_step(model, ids)), ref)
    finally:
        handle.remove()


@pytest.mark.gpu
def test_gpu_llama_plan_peak_near_its_budget(gpu_llama, gpu_plan):
    """The planner's memory model is approximate: the measured peak stays within 10% of the
    budget it planned for, and below the peak without offloading."""
    model, ids = gpu_llama
    base = peak_of(lambda: gpu_step(model, ids))
    handle = apply_offloading(model.model.layers, plan=gpu_plan)
    try:
        gpu_step(model, ids)
        peak = peak_of(lambda: gpu_step(model, ids))
    finally:
        handle.remove()
    assert peak <= 1.10 * gpu_plan.memory_budget_bytes and peak < base, (
        f"peak {peak / 2**30:.2f} GiB, budget {gpu_plan.memory_budget_bytes / 2**30:.2f} GiB, "
        f"none {base / 2**30:.2f} GiB; {gpu_plan.describe()}"
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_gpu_llama_every_input_offloaded_matches_hf_offload_peak(gpu_llama):
    """Every layer checkpointed with its input offloaded, the last input released when the
    forward ends: bit-identical gradients, and a peak no higher than HF's own offload
    (``save_on_cpu`` around each checkpointed layer), which holds no layer input in the loss."""
    import sys
    from pathlib import Path

    from cpu_offload.plan.search import Plan

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from hf_llama_benchmark import hf_checkpointing, hf_checkpointing_off

    model, ids = gpu_llama
    layers = model.model.layers
    n = len(layers)
    ref = gpu_snapshot(model, gpu_step(model, ids))
    handle = apply_offloading(layers, plan=Plan(n, tuple(range(n)), model_layers=n))
    try:
        for _ in range(2):
            assert_exact(gpu_snapshot(model, gpu_step(model, ids)), ref)
        ours = peak_of(lambda: gpu_step(model, ids))
    finally:
        handle.remove()
    hf_offload = hf_checkpointing(model, offload=True)
    if hf_offload is None:
        pytest.skip("this transformers has no offload option for activation checkpointing")
    try:
        gpu_step(model, ids)
        theirs = peak_of(lambda: gpu_step(model, ids))
    finally:
        hf_checkpointing_off(model)
    assert ours <= theirs, f"ours {ours / 2**20:.1f} MiB, HF offload {theirs / 2**20:.1f} MiB"


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_gpu_llama_spread_offload_bit_identical_and_frees_those_layers(gpu_llama):
    """Offloading layers 1, 3 and 5 (a spread plan, with its own schedule): bit-identical
    gradients, and exactly those layers copied and freed their activations."""
    from cpu_offload.plan.search import Plan

    model, ids = gpu_llama
    layers = model.model.layers
    ref = gpu_snapshot(model, gpu_step(model, ids))
    base = peak_of(lambda: gpu_step(model, ids))
    plan = Plan(3, (), offloaded=(1, 3, 5), model_layers=len(layers))
    handle = apply_offloading(layers, plan=plan)
    try:
        for _ in range(2):
            assert_exact(gpu_snapshot(model, gpu_step(model, ids)), ref)
        peak = peak_of(lambda: gpu_step(model, ids))
        stats = handle.stats().to_dict()["layers"]
    finally:
        handle.remove()
    freed = {i: s["freed_bytes"] for i, s in stats.items() if s["freed_bytes"]}
    assert sorted(freed) == [1, 3, 5]
    assert peak < base - sum(freed.values()) // 2, (peak, base, freed)
