"""A model passed as the layers: its list of repeated blocks is found however deep it sits, also
when the model itself is an ``nn.Sequential`` of modules of several classes (an embedding, an
encoder, a head), or the candidates are named."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import OffloadConfigError


def encoder_model(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Embedding(100, 32), nn.TransformerEncoder(layer, layers,
                                                                      enable_nested_tensor=False),
                         nn.Linear(32, 100))


def grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_sequential_model_offloads_its_encoder_layers():
    model = encoder_model()
    ids = torch.randint(0, 100, (2, 16))
    expected = grads(model, ids)
    handle = cpu_offload.apply_offloading(
        model, num_layers=2, min_tensor_size_to_offload=1, device=cpu_offload.SimulatedDevice())
    assert handle.layers == tuple(model[1].layers)  # not the 3 children of the Sequential
    assert all(map(torch.equal, grads(model, ids), expected))
    assert sorted(handle.stats().to_dict()["layers"]) == [0, 1]
    handle.remove()
    prof = cpu_offload.profile_step(
        lambda: model(ids).sum().backward(), model, device=cpu_offload.SimulatedDevice(),
        min_tensor_size_to_offload=1, link_gbps=1.0, repeats=1, selective=False)
    assert len(prof.layers) == 4


class Stack(nn.Module):
    def __init__(self, cls, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(cls(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Bilinearish(nn.Linear):
    pass


def test_a_container_with_several_block_lists_names_them_and_its_children():
    model = nn.Sequential(Stack(nn.Linear), nn.Tanh(), Stack(Bilinearish))
    with pytest.raises(OffloadConfigError, match=(
            r"model\[0\]\.layers \(2 x Linear\), model\[2\]\.layers \(2 x Bilinearish\).*"
            r"apply_offloading\(list\(model\), \.\.\.\) to offload its 3 children")):
        cpu_offload.apply_offloading(model, num_layers=1, device=cpu_offload.SimulatedDevice())
    handle = cpu_offload.apply_offloading(  # as the error says
        list(model), num_layers=1, device=cpu_offload.SimulatedDevice())
    assert handle.layers == tuple(model)
    handle.remove()


def test_a_sequential_of_layers_stays_the_layer_list():
    """Children of several classes with no repeated blocks inside: they are the layers."""
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    handle = cpu_offload.apply_offloading(mlp, num_layers=1, device=cpu_offload.SimulatedDevice())
    assert handle.layers == tuple(mlp)
    handle.remove()
