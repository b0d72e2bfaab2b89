"""Every mechanism under torch.compile gives the eager layer's outputs and gradients.

The "aot_eager" backend traces the forward and backward graphs exactly as the default inductor
backend does, without generating C++ (the benchmark `routeformer bench compile` uses inductor)."""

import pytest
import torch

from routeformer.attention import list_attentions
from routeformer.bench.compile_bench import graph_breaks
from tests.attention.test_contract import DIM, make_layer

LENGTH = 24


@pytest.mark.parametrize("name", list(list_attentions()))
def test_compiled_layer_matches_eager(name):
    torch._dynamo.reset()
    layer = make_layer(name, causal=True)
    x = torch.randn(2, LENGTH, layer.dim, generator=torch.Generator().manual_seed(0))
    extra = {"meta_mask": torch.rand(2, LENGTH, generator=torch.Generator().manual_seed(1)) < 0.2} \
        if getattr(layer, "reads_meta_mask", False) else {}
    compiled = torch.compile(layer, backend="aot_eager")
    outputs, gradients = [], []
    for module in (layer, compiled):  # one compiled call: forward and backward graphs
        inputs = x.clone().requires_grad_()
        out = module(inputs, **extra).out
        out.square().sum().backward()
        outputs.append(out.detach())
        gradients.append(inputs.grad)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["full", "local", "linear"])
def test_fixed_pattern_layers_compile_to_one_graph(name):
    layer = make_layer(name, causal=True)
    explained = graph_breaks(layer, torch.randn(1, LENGTH, DIM), {})
    assert (explained["graphs"], explained["breaks"]) == (1, 0), explained
