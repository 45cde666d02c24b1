"""Hugging Face activation checkpointing under both names: ``activation_checkpointing_enable``
(transformers >= 5.24; skipped where missing) and the deprecated ``gradient_checkpointing_enable``,
with ``every_n_layers`` and ``offload=True``, through ``apply_offloading``, ``plan_offloading``,
selective recomputation and the Trainer callback. HF's ``offload=True`` (a synchronous
``save_on_cpu`` around each checkpoint) is refused with an error that names the fix."""
from __future__ import annotations

import importlib.util
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload import OffloadConfigError, apply_offloading, plan_offloading  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
MIN_SIZE = 2048
NEW = "activation_checkpointing_enable"
OLD = "gradient_checkpointing_enable"
HAS_NEW = hasattr(PreTrainedModel, NEW)
HAS_EVERY_N = "every_n_layers" in inspect.signature(
    getattr(PreTrainedModel, NEW, PreTrainedModel.gradient_checkpointing_enable)
).parameters

NAMES = [
    pytest.param(NEW, marks=pytest.mark.skipif(not HAS_NEW, reason=f"transformers lacks {NEW}")),
    OLD,
]
needs_every_n = pytest.mark.skipif(not HAS_EVERY_N, reason="transformers lacks every_n_layers")
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers' Trainer needs accelerate"
)


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers})).train()


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def step(model):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_exact(got, ref):
    assert torch.equal(got[0], ref[0])
    bad = [n for n in ref[1] if not torch.equal(got[1][n], ref[1][n])]
    assert not bad, f"gradients differ: {bad[:4]}"


def enable(model, name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated
        getattr(model, name)(**kwargs)


@pytest.fixture(scope="module")
def ref():
    return step(tiny_llama())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("every_n", [1, pytest.param(2, marks=needs_every_n)])
@pytest.mark.parametrize("order", ["checkpointing_first", "offloading_first"])
def test_apply_offloading_with_either_name_and_every_n_layers(name, every_n, order, ref, sim):
    model = tiny_llama()
    kwargs = {"every_n_layers": every_n} if every_n != 1 else {}
    if order == "checkpointing_first":
        enable(model, name, **kwargs)
    handle = apply_offloading(model, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    if order == "offloading_first":
        enable(model, name, **kwargs)
    for _ in range(2):
        assert_exact(step(model), ref)
    storages = [s["storages"] for s in handle.synchronizer.layer_summary()][:2]
    # a checkpointed layer saves only its input; with every_n_layers=2 layer 1 keeps its activations
    assert storages[0] == 1 and (storages[1] == 1) == (every_n == 1), storages
    handle.remove()


@needs_every_n
@pytest.mark.parametrize("name", NAMES)
def test_plan_and_selective_with_every_n_layers(name, ref, sim):
    model = tiny_llama(layers=6)
    reference = step(model)
    enable(model, name, every_n_layers=2)
    plan = plan_offloading(
        lambda: step(model), model, 0.5, device=sim, min_tensor_size_to_offload=MIN_SIZE,
        link_gbps=0.5, repeats=1,
    )
    handle = apply_offloading(model, plan=plan)
    for _ in range(2):
        assert_exact(step(model), reference)
    handle.remove()
    handle = apply_offloading(
        model, num_layers=2, selective=True, selective_scope="layer",
        min_tensor_size_to_offload=MIN_SIZE, device=sim,
    )
    assert_exact(step(model), reference)
    recipes = handle.stats().to_dict()["layers"]
    assert recipes[1]["recipe_tensors"] > 0 and recipes[0]["recipe_tensors"] == 0  # 0 checkpointed
    handle.remove()


@pytest.mark.parametrize("name", NAMES)
def test_hf_offload_true_is_refused_naming_the_fix(name, sim):
    if "offload" not in inspect.signature(getattr(PreTrainedModel, NEW if HAS_NEW else OLD)).parameters:
        pytest.skip("transformers lacks offload=True")
    model = tiny_llama()
    enable(model, name, offload=True)
    with pytest.raises(OffloadConfigError, match=r"layer 0 uses Hugging Face activation checkpointing with offload=True.*offload=False"):
        apply_offloading(model, num_layers=2, device=sim)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # nothing installed
    # enabled after applying: refused at the first training forward, before save_on_cpu runs
    model = tiny_llama()
    handle = apply_offloading(model, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    enable(model, name, offload=True)
    with pytest.raises(OffloadConfigError, match="offload=True"):
        step(model)
    enable(model, name)  # offload=False: works, exactly
    model2 = tiny_llama()
    assert_exact(step(model), step(model2))
    handle.remove()


# --- the Trainer, with TrainingArguments' checkpointing names ---------------------------------------


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def train(model, tmp_path, callbacks=(), **checkpointing):
    from transformers import Trainer, TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
            **checkpointing,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


HAS_NEW_ARGS = "activation_checkpointing" in inspect.signature(
    transformers.TrainingArguments
).parameters
ARGS = [
    pytest.param(
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}},
        marks=pytest.mark.skipif(not HAS_NEW_ARGS, reason="TrainingArguments lacks the new names"),
        id="activation_checkpointing-every_2",
    ),
    pytest.param({"gradient_checkpointing": True}, id="gradient_checkpointing"),
]


@needs_accelerate
@pytest.mark.parametrize("checkpointing", ARGS)
@pytest.mark.parametrize("mode", ["num_layers", "memory_budget"])
def test_trainer_callback_with_checkpointing_losses_equal(checkpointing, mode, tmp_path, sim):
    from cpu_offload.integrations.transformers import OffloadCallback

    ref = train(tiny_llama(), tmp_path, **checkpointing)
    model = tiny_llama()
    how = {"num_layers": 2} if mode == "num_layers" else {
        "memory_budget": 0.5, "plan_kwargs": {"repeats": 1, "link_gbps": 0.5}}
    callback = OffloadCallback(**how, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    assert train(model, tmp_path, [callback], **checkpointing) == ref and len(ref) == 3
    assert callback.handle.removed
    assert cpu_offload.offloading_handle(model.model.layers[0]) is None


@needs_accelerate
@pytest.mark.skipif(not HAS_NEW_ARGS, reason="TrainingArguments lacks the new names")
@pytest.mark.parametrize("mode", ["num_layers", "memory_budget"])
def test_trainer_callback_refuses_hf_offload(mode, tmp_path, sim):
    from cpu_offload.integrations.transformers import OffloadCallback

    how = {"num_layers": 2} if mode == "num_layers" else {"memory_budget": 0.5}
    callback = OffloadCallback(**how, device=sim)
    with pytest.raises(OffloadConfigError, match="drop \"offload\" from TrainingArguments"):
        train(tiny_llama(), tmp_path, [callback], activation_checkpointing=True,
              activation_checkpointing_kwargs={"offload": True})


POLICIES = pytest.importorskip("cpu_offload.compat").cpu_offload_policies()


@pytest.mark.skipif(not POLICIES, reason="torch lacks CPU offload checkpoint policies")
@pytest.mark.parametrize("name", NAMES)
def test_hf_checkpointing_with_an_offload_policy_as_context_fn(name, sim):
    """HF passes activation_checkpointing_kwargs to torch's checkpoint: with cpu_offload's
    contexts as context_fn, the policy's CPU-offload answers are moved by the engine; gradients
    equal torch's contexts (which recompute them). selective=<policy> on HF-checkpointed layers
    is refused, naming this route."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_contexts

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE

    key = "activation_checkpointing_kwargs" if name == NEW else "gradient_checkpointing_kwargs"

    def model_with(contexts):
        model = tiny_llama()
        enable(model, name, **{key: {"use_reentrant": False,
                                     "context_fn": functools.partial(contexts, policy)}})
        return model

    ref = step(model_with(torch_contexts))
    model = model_with(cpu_offload.create_selective_checkpoint_contexts)
    handle = apply_offloading(model, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    assert_exact(step(model), ref)
    # more than the checkpoint input (1 storage) left each offloaded layer: the matmul outputs
    assert all(s["storages"] > 1 for s in handle.synchronizer.layer_summary()[:2])
    handle.remove()
    with pytest.raises(OffloadConfigError, match="give HF the policy instead.*context_fn"):
        apply_offloading(model, num_layers=2, selective=policy, device=sim)
