"""Timed calls of a whole attention layer (projections included), shared by the layer benchmarks
(`routeformer compare`'s bench, `routeformer bench compile`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The layer benchmarks' budgets are fixed, as in the mechanisms' own benches: sparse where T is large.
BENCH_OPTIONS = {"local": {"window": 256}, "meta": {"window": 256}, "topk": {"topk": 64},
                 "mita": {"landmarks": 64, "topk": 64}}

META_DENSITY = 0.1


def layer_inputs(layer: nn.Module, length: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """x [1, length, dim] and the extra keyword arguments the layer reads (a random meta mask at
    density 0.1 for layers that declare `reads_meta_mask`)."""
    from routeformer.bench.meta_tokens_bench import random_meta_mask

    torch.manual_seed(seed)
    x = torch.randn(1, length, layer.dim)
    extra = ({"meta_mask": random_meta_mask(1, length, META_DENSITY, seed)}
             if getattr(layer, "reads_meta_mask", False) else {})
    return x, extra


def layer_forward(module: nn.Module, x: torch.Tensor, extra: dict[str, Any]) -> Callable[[], None]:
    """Inference: eval mode, no gradients. `module` may be a torch.compile wrapper of the layer."""
    def run() -> None:
        module.eval()
        with torch.no_grad():
            module(x, **extra)
    return run


def layer_forward_backward(module: nn.Module, x: torch.Tensor, extra: dict[str, Any]) -> Callable[[], None]:
    """A training step's attention work: train mode, forward, backward into the input and weights."""
    leaf = x.clone().requires_grad_()

    def run() -> None:
        module.train()
        module.zero_grad(set_to_none=True)
        leaf.grad = None
        result = module(leaf, **extra)
        (result.out.square().mean() + result.aux_loss).backward()
    return run
