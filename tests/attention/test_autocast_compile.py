"""Every registered mechanism under torch.autocast (forward and backward, with and without a
padding mask) and under torch.compile(fullgraph=True) with a padding mask.

Compilation uses the "aot_eager" backend: it traces the forward and backward graphs as inductor
does (a graph break under fullgraph=True raises the same way) without generating C++."""

from __future__ import annotations

import pytest
import torch

from routeformer.attention import list_attentions
from routeformer.ops.native import native_kernels
from tests.attention.test_invariants import (
    DIM,
    LOW_PRECISION_RTOL,
    PER_TOKEN_CRITERION,
    make_layer,
    relative_error,
)

NAMES = list(list_attentions())
LENGTH = 24
AUTOCAST = [("cpu", torch.bfloat16)] + (
    [("cuda", torch.bfloat16), ("cuda", torch.float16)] if torch.cuda.is_available() else [])
needs_native = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")


def padded_batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones(2, LENGTH, dtype=torch.bool, device=device)
    mask[1, 17:] = False
    return x, mask


def meta_extra(layer, device: str = "cpu") -> dict:
    """Meta-tokens for the layers that read them (meta_tokens), none for the others."""
    if not getattr(layer, "reads_meta_mask", False):
        return {}
    return {"meta_mask": (torch.arange(LENGTH, device=device) % 3 == 1).expand(2, LENGTH)}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("device", "dtype"), AUTOCAST, ids=[f"{d}-{t}" for d, t in AUTOCAST])
def test_autocast_forward_backward(name, masked, device, dtype):
    """fp32 weights under torch.autocast (how mixed precision is run): the training step is finite
    and the real rows' output is within the low-precision tolerance of the fp32 layer."""
    layer = make_layer(name, causal=True).to(device)
    x, mask = padded_batch(device)
    extra = {**meta_extra(layer, device), **({"mask": mask} if masked else {})}
    rows = mask if masked else torch.ones_like(mask)
    with torch.no_grad():
        expected = layer(x, **extra).out[rows]
        with torch.autocast(device, dtype):
            actual = layer(x, **extra).out[rows].float()
    assert torch.isfinite(actual).all()
    tolerance = LOW_PRECISION_RTOL[dtype]
    if name in PER_TOKEN_CRITERION:
        per_token = (actual - expected).norm(dim=-1) / expected.norm(dim=-1)
        assert float(per_token.median()) <= tolerance and float((per_token > tolerance).float().mean()) <= 0.1
    else:
        assert relative_error(actual, expected) <= tolerance

    layer.train()
    inputs = x.clone().requires_grad_()
    with torch.autocast(device, dtype):
        result = layer(inputs, **extra)
    (result.out[rows].float().square().mean() + result.aux_loss.float()).backward()
    assert torch.isfinite(inputs.grad).all(), f"{name}: non-finite input gradient"
    for param_name, param in layer.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), f"{name}: {param_name} gradient not finite"


# docs/kernels.md: these compile to one graph with a padding mask; expanding (padded: its band
# path, run eagerly), meta_tokens (its packing) and mita (its expert sizes) break the graph.
FULLGRAPH_WITH_MASK = ["full", "gated", "linear", "local", "meta", "multihop",
                       pytest.param("topk", marks=needs_native)]
BREAKS_WITH_MASK = ["expanding", "meta_tokens", "mita"]


def test_every_mechanism_is_classified_for_compile_with_a_mask():
    listed = {getattr(case, "values", (case,))[0] for case in FULLGRAPH_WITH_MASK} | set(BREAKS_WITH_MASK)
    assert listed == set(NAMES)


@pytest.mark.parametrize("name", FULLGRAPH_WITH_MASK)
def test_fullgraph_compile_with_a_padding_mask_matches_eager(name):
    torch._dynamo.reset()
    layer = make_layer(name, causal=True)  # eval mode: meta's training routing samples
    x, mask = padded_batch()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    outputs, gradients = [], []
    for module in (layer, compiled):
        inputs = x.clone().requires_grad_()
        out = module(inputs, mask=mask).out
        out[mask].square().sum().backward()
        outputs.append(out[mask].detach())
        gradients.append(inputs.grad[mask])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", BREAKS_WITH_MASK)
def test_fullgraph_compile_with_a_padding_mask_raises_where_the_docs_say(name):
    torch._dynamo.reset()
    layer = make_layer(name, causal=True)
    x, mask = padded_batch()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="skipped|data-dependent|graph break"):
        compiled(x, mask=mask, **meta_extra(layer))
