"""The shipped Trainer integration (``cpu_offload.integrations.transformers.OffloadCallback``)
and finding a model's repeated blocks (``find_block_list``, ``apply_offloading(model, ...)``),
on a tiny ``LlamaForCausalLM`` built from a config on the CPU with the simulated device.
Skipped when transformers (or accelerate, for the Trainer) is not installed."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload import OffloadConfigError, apply_offloading  # noqa: E402
from cpu_offload import find_block_list  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
MIN_SIZE = 2048  # hidden states and MLP activations move; RoPE cos/sin stay
DECODER = transformers.models.llama.modeling_llama.LlamaDecoderLayer

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers' Trainer needs accelerate"
)


def tiny_llama(layers: int = 4, seed: int = 0, **config) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers, **config})).train()


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def train(model, tmp_path, callbacks=(), steps=4):
    """Run a Trainer; the logged losses, step for step, and the whole log history."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train()
    history = trainer.state.log_history
    return [h["loss"] for h in history if "loss" in h], history


def copies(sim) -> int:
    return sum(1 for e in sim.log if e[0] == "copy")


# --- finding the repeated blocks -------------------------------------------------------------------


class Experts(torch.nn.Module):
    """A block with a list of identical experts inside: only the outer list is the block list."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(Experts() for _ in range(4))
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())


class TwoStacks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.decoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))


def test_find_block_list_finds_the_decoder_layers():
    model = tiny_llama()
    assert find_block_list(model) is model.model.layers
    moe = MoE()
    assert find_block_list(moe) is moe.blocks  # not the experts inside each block


def test_find_block_list_refuses_ambiguous_or_none_naming_what_to_pass():
    with pytest.raises(OffloadConfigError, match=r"model\.encoder .*model\.decoder .*layers=model\.encoder"):
        find_block_list(TwoStacks())
    with pytest.raises(OffloadConfigError, match="no list of repeated blocks .*layers=model"):
        find_block_list(torch.nn.Linear(8, 8))


def test_find_block_list_prefers_hf_no_split_modules():
    """A second list of identical modules beside the decoder layers (here: heads) is no
    ambiguity for a model whose ``_no_split_modules`` names its decoder layer class."""
    model = tiny_llama()
    model.heads = torch.nn.ModuleList(torch.nn.Linear(64, 8) for _ in range(2))
    assert find_block_list(model) is model.model.layers
    model._no_split_modules = []
    with pytest.raises(OffloadConfigError, match="several lists"):
        find_block_list(model)


def test_apply_offloading_given_the_whole_model(sim):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    handle = apply_offloading(model, num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim)
    assert handle.layers == tuple(model.model.layers)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())
    assert handle.synchronizer.layer_summary()[0]["bytes"] > 0
    handle.remove()
    with pytest.raises(OffloadConfigError, match="several lists"):
        apply_offloading(TwoStacks(), num_layers=1, device=sim)


# --- the Trainer callback ----------------------------------------------------------------------------


def test_callback_arguments_name_the_fix():
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(OffloadConfigError, match="exactly one of num_layers"):
        OffloadCallback()
    with pytest.raises(OffloadConfigError, match="exactly one of .*got num_layers, memory_budget"):
        OffloadCallback(num_layers=2, memory_budget=0.5)
    with pytest.raises(OffloadConfigError, match="log_every"):
        OffloadCallback(num_layers=2, log_every=-1)


def test_callback_refuses_an_ambiguous_model_naming_layers(sim):
    from cpu_offload.integrations.transformers import OffloadCallback
    from transformers import TrainerState

    callback = OffloadCallback(num_layers=1, device=sim)
    with pytest.raises(OffloadConfigError, match=r"layers=model\.encoder"):
        callback.on_train_begin(None, TrainerState(), None, model=TwoStacks())
    model = TwoStacks()
    budget = OffloadCallback(memory_budget=0.5, layers=model.decoder, device=sim)
    with pytest.raises(OffloadConfigError, match="distributed .*pass plan="):
        budget.on_train_begin(SimpleNamespace(world_size=2), TrainerState(), None, model=model)
    callback = OffloadCallback(num_layers=1, layers=model.decoder, device=sim)
    callback.on_train_begin(None, TrainerState(), None, model=model)
    assert callback.handle.layers == tuple(model.decoder)
    callback.on_train_end(None, TrainerState(), None, model=model)
    assert callback.handle.removed and type(model.decoder[0]) is torch.nn.Linear


@needs_accelerate
def test_callback_num_layers_losses_equal_logs_and_removes_itself(tmp_path, sim):
    from cpu_offload.integrations.transformers import OffloadCallback

    ref, _ = train(tiny_llama(), tmp_path)
    model = tiny_llama()
    callback = OffloadCallback(
        num_layers=2, min_tensor_size_to_offload=MIN_SIZE, device=sim, log_every=2
    )
    losses, history = train(model, tmp_path, [callback])
    assert losses == ref and len(ref) == 4  # exact float equality, step for step
    assert copies(sim) > 0
    # removed at the end: the layers are plain LlamaDecoderLayers again
    assert callback.handle.removed and all(type(m) is DECODER for m in model.model.layers)
    assert cpu_offload.offloading_handle(model.model.layers[0]) is None
    plans = [h for h in history if "offload/plan" in h]
    assert len(plans) == 1 and "first 2 of 4 layers" in plans[0]["offload/plan"]
    stats = [h for h in history if "offload/copied_out_bytes" in h]
    assert [h["step"] for h in stats] == [2, 4]
    assert all(h["offload/copied_out_bytes"] > 0 and h["offload/freed_bytes"] > 0 for h in stats)
    assert callback.last_stats == {k: v for k, v in stats[-1].items() if k != "step"}


@needs_accelerate
def test_callback_memory_budget_plans_from_the_first_batch_losses_equal(tmp_path, sim):
    """The first batch is profiled (without optimizer steps) before its own update; with
    dropout on, the restored random state keeps that update exactly the one without."""
    from cpu_offload.integrations.transformers import OffloadCallback

    config = dict(layers=6, attention_dropout=0.1)
    ref, _ = train(tiny_llama(**config), tmp_path)
    model = tiny_llama(**config)
    callback = OffloadCallback(
        memory_budget=0.5, min_tensor_size_to_offload=MIN_SIZE, device=sim,
        plan_kwargs={"repeats": 1, "link_gbps": 0.5},
    )
    losses, history = train(model, tmp_path, [callback])
    assert losses == ref and len(ref) == 4
    plan = callback.plan
    assert plan is not None and callback.handle.plan is plan
    assert plan.num_layers + len(plan.recompute) >= 1, plan.describe()
    logged = [h for h in history if "offload/plan" in h]
    assert [h["offload/plan"] for h in logged] == [plan.describe()]
    assert logged[0]["offload/plan_seconds"] == round(callback.plan_seconds, 3) > 0
    assert callback.handle.removed and all(type(m) is DECODER for m in model.model.layers)
    assert not model._forward_pre_hooks  # the planning hook is gone too


@needs_accelerate
def test_the_hf_trainer_page_runs(tmp_path, monkeypatch):
    """Every python block of docs/hf_trainer_integration.md runs on the CPU, in order."""
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hf_trainer_integration.md"
    if not page.exists():
        pytest.skip("not run from a checkout")
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), scope)


def test_find_block_list_on_other_hf_architectures():
    """GPT-2 keeps its blocks in ``transformer.h``; T5 has an encoder and a decoder stack, so the
    error names both and the attribute to pass."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    assert find_block_list(gpt2) is gpt2.transformer.h
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64))
    with pytest.raises(OffloadConfigError, match=r"model\.encoder\.block \(2 x T5Block\), "
                       r"model\.decoder\.block \(2 x T5Block\).*layers=model\.encoder\.block"):
        find_block_list(t5)
