"""The topk layer's decode step equals its parallel pass row by row: the routed sets (ties included)
and the output values, on the native (tiled routing keys) and PyTorch paths."""

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.ops.native import native_enabled
from routeformer.ops.topk import (
    append_routing_keys,
    cached_routing_keys,
    route_cached,
    route_topk,
    route_topk_reference,
)

LENGTH = 48


def tied_routing_vectors(routes: int = 2, dim: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing vectors with many exact ties: keys drawn from 4 distinct vectors."""
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(1, routes, 4, dim, generator=generator)
    choice = torch.randint(0, 4, (LENGTH,), generator=generator)
    keys = distinct[:, :, choice].expand(2, -1, -1, -1).contiguous()
    queries = torch.randn(2, routes, LENGTH, dim, generator=generator)
    return queries, keys


def as_sets(index: torch.Tensor, valid: torch.Tensor, num_keys: int) -> torch.Tensor:
    member = torch.zeros(*index.shape[:3], num_keys + 1, dtype=torch.bool)
    # invalid slots go to a spare column, dropped
    return member.scatter_(-1, index.masked_fill(~valid, num_keys), True)[..., :num_keys]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("forced", [(0, 0), (3, 0), (0, 2), (4, 3)])
def test_cached_routing_selects_the_parallel_rows_with_ties(native, forced):
    local_window, global_tokens = forced
    queries, keys = tied_routing_vectors()
    topk = 5
    with native_enabled(native):
        parallel = as_sets(*route_topk(queries, keys, topk, causal=True, local_window=local_window,
                                       global_tokens=global_tokens)[:2], LENGTH)
        cache, rows = {}, []
        for i in range(LENGTH):
            append_routing_keys(cache, keys[:, :, i:i + 1])
            selected = route_cached(queries[:, :, i:i + 1], cache, i, topk, local_window=local_window,
                                    global_tokens=global_tokens)
            rows.append(as_sets(*selected, LENGTH))
    assert cache["routing_tiled"] == int(native)
    torch.testing.assert_close(cached_routing_keys(cache), keys)
    stepped = torch.cat(rows, dim=2)
    reference = route_topk_reference(queries, keys, topk, causal=True, local_window=local_window,
                                     global_tokens=global_tokens)
    assert torch.equal(stepped, parallel)
    assert torch.equal(stepped, reference)
    # The tie rule was exercised: some row's K-th routed score equals an unselected eligible key's.
    scores = queries @ keys.transpose(-1, -2)
    eligible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    selected_min = scores.masked_fill(~stepped, float("inf")).amin(-1)
    tied_out = ((scores == selected_min[..., None]) & ~stepped & eligible).any(-1)
    assert bool(tied_out.any())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("options", [
    {"routing_positions": "none"},
    {"routing_positions": "none", "shared_routing": True, "local_window": 3, "global_tokens": 2},
    {"routing_positions": "recency", "local_window": 2},
    {"routing_positions": "rotary+recency", "routing_learning": "score_bias"},
])
def test_decode_steps_equal_the_parallel_rows(native, options):
    torch.manual_seed(0)
    layer = build_attention("topk", dim=32, heads=2, causal=True, topk=4, routing_dim=6, dense_below=0,
                            **options).eval()
    x = torch.randn(2, LENGTH, 32)
    x[:, 20:40] = x[:, 3:4]  # repeated tokens: equal routing vectors under a position-blind router
    positions = torch.arange(LENGTH).expand(2, LENGTH)
    with native_enabled(native), torch.no_grad():
        parallel = layer(x).out
        cache = {}
        prefill = layer.decode(x[:, :8], positions=positions[:, :8], cache=cache)
        steps = [layer.decode(x[:, i:i + 1], positions=positions[:, i:i + 1], cache=cache)
                 for i in range(8, LENGTH)]
    stepped = torch.cat([prefill, *steps], dim=1)
    for row in range(LENGTH):  # row by row, so a failure names the first row that differs
        torch.testing.assert_close(stepped[:, row], parallel[:, row], atol=2e-6, rtol=1e-5,
                                   msg=lambda message, row=row: f"row {row}: {message}")
