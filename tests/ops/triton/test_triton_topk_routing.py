"""The Triton routing top-K selection against `route_topk_reference` (the selected sets)."""

import pytest
import torch

from routeformer.ops.topk import route_topk_reference, slot_membership
from routeformer.ops.triton.topk_routing import triton_route_topk


def selected_set(index, valid, num_keys):
    return slot_membership(index.cpu(), valid.cpu(), num_keys)


def integer_routing(batch, heads, length, dim, seed, dtype=torch.float32):
    """Small-integer routing vectors: dot products are exact in any float dtype, and many tie."""
    generator = torch.Generator().manual_seed(seed)
    make = lambda: torch.randint(-2, 3, (batch, heads, length, dim), generator=generator).to(dtype)
    return make(), make()


@pytest.mark.parametrize("causal,padded,local_window,global_tokens,topk",
                         [(True, False, 0, 0, 5), (True, True, 3, 2, 4), (False, True, 0, 1, 6),
                          (False, False, 2, 0, 40)])
def test_selected_sets_equal_the_reference_with_the_tie_rule(device, causal, padded, local_window,
                                                             global_tokens, topk):
    """Integer scores tie often: equal sets mean the lower key index won every tie, as specified.
    topk=40 > S: every eligible key is taken and the surplus slots are invalid."""
    batch, heads, length, dim = 2, 2, 35, 3
    route_q, route_k = integer_routing(batch, heads, length, dim, seed=topk)
    key_mask = None
    if padded:
        key_mask = torch.ones(batch, length, dtype=torch.bool)
        key_mask[0, 30:] = False
        key_mask[1, :2] = False
    kwargs = dict(causal=causal, key_mask=key_mask, local_window=local_window, global_tokens=global_tokens)
    on = lambda t: None if t is None else t.to(device)
    index, valid, scored = triton_route_topk(on(route_q), on(route_k), topk, **{**kwargs,
                                                                               "key_mask": on(key_mask)})
    want = route_topk_reference(route_q, route_k, topk, **kwargs)
    assert index.dtype == torch.long and valid.dtype == torch.bool
    assert torch.equal(selected_set(index, valid, length), want)
    # Valid entries are distinct keys; invalid ones point at key 0.
    assert int(valid.sum()) == int(want.sum())
    assert bool((index[~valid] == 0).all())
    assert 0 < scored <= batch * heads * length * length


@pytest.mark.parametrize("tile,causal", [(None, True), (16, True), (16, False)])
def test_random_float_scores_tile_by_tile(device, tile, causal):
    """tile=16 < S: the running top-K list is merged tile by tile (and tiles that cannot enter
    it are skipped), as on a GPU."""
    generator = torch.Generator().manual_seed(7)
    route_q = torch.randn(1, 3, 70, 8, generator=generator)
    route_k = torch.randn(1, 3, 70, 8, generator=generator)
    kwargs = dict(causal=causal, local_window=2)
    index, valid, _ = triton_route_topk(route_q.to(device), route_k.to(device), 7, tile=tile, **kwargs)
    want = route_topk_reference(route_q, route_k, 7, **kwargs)
    assert torch.equal(selected_set(index, valid, 70), want)


def test_integer_ties_tile_by_tile(device):
    route_q, route_k = integer_routing(1, 2, 60, 2, seed=11)
    index, valid, _ = triton_route_topk(route_q.to(device), route_k.to(device), 5, causal=False, tile=16)
    want = route_topk_reference(route_q, route_k, 5, causal=False)
    assert torch.equal(selected_set(index, valid, 60), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_select_the_same_sets(device, dtype):
    route_q, route_k = integer_routing(1, 2, 20, 4, seed=3, dtype=dtype)
    index, valid, _ = triton_route_topk(route_q.to(device), route_k.to(device), 3, causal=True)
    want = route_topk_reference(route_q.float(), route_k.float(), 3, causal=True)
    assert torch.equal(selected_set(index, valid, 20), want)


def test_bad_arguments_raise_value_errors(device):
    route_q = torch.zeros(1, 1, 4, 2, device=device)
    with pytest.raises(ValueError, match="topk"):
        triton_route_topk(route_q, route_q, 0)
    with pytest.raises(ValueError, match="local_window"):
        triton_route_topk(route_q, route_q, 2, local_window=-1)
    with pytest.raises(ValueError, match="route_q"):
        triton_route_topk(route_q, route_q[..., :1], 2)
    with pytest.raises(ValueError, match="float32"):
        triton_route_topk(route_q.double(), route_q.double(), 2)
    with pytest.raises(ValueError, match="tile"):
        triton_route_topk(route_q, route_q, 2, tile=24)
