"""The split-key (decode-shaped) routing kernels against `route_topk_reference` (the selected sets)
and the one-program kernel (the same slots in the same order): random vectors, exact ties across
chunk boundaries, fewer keys than slots, key masks, forced keys, low-precision inputs, strided keys.
Small tiles and chunks make the interpreter run many chunks and the merge of their lists."""

import pytest
import torch

from routeformer.ops.topk import route_topk_reference
from routeformer.ops.triton.topk_decode_routing import triton_route_topk_decode
from routeformer.ops.triton.topk_routing import triton_route_topk
from tests.ops.triton.test_triton_topk_routing import integer_routing, selected_set


def check(device, route_q, route_k, topk, *, key_mask=None, local_window=0, global_tokens=0, tile=16,
          chunk=32, reference_dtype=torch.float32):
    """Same sets as the reference, same slots (keys, order, validity) as the one-program kernel."""
    kwargs = dict(key_mask=key_mask, local_window=local_window, global_tokens=global_tokens)
    on = lambda t: None if t is None else t.to(device)
    index, valid, scored = triton_route_topk_decode(on(route_q), on(route_k), topk, tile=tile, chunk=chunk,
                                                    **{**kwargs, "key_mask": on(key_mask)})
    want = route_topk_reference(route_q.to(reference_dtype), route_k.to(reference_dtype), topk, causal=False,
                                **kwargs)
    num_keys = route_k.shape[2]
    assert index.dtype == torch.long and valid.dtype == torch.bool
    assert torch.equal(selected_set(index, valid, num_keys), want)
    assert bool((index[~valid] == 0).all())  # invalid slots point at key 0
    one_program = triton_route_topk(route_q.contiguous(), route_k.contiguous(), topk, causal=False, **kwargs)
    assert torch.equal(index.cpu(), one_program[0]) and torch.equal(valid.cpu(), one_program[1])
    assert scored == route_q.shape[0] * route_q.shape[1] * route_q.shape[2] * num_keys


@pytest.mark.parametrize("queries,topk,tile,chunk", [(1, 7, 16, 32), (3, 5, 16, 16), (1, 1, 16, 64),
                                                     (2, 9, None, None)])
def test_random_vectors_select_the_reference_sets(device, queries, topk, tile, chunk):
    """One query (a decode step) and a few; K = 1 (a one-slot list); the default sizes."""
    generator = torch.Generator().manual_seed(topk)
    route_q = torch.randn(2, 2, queries, 6, generator=generator)
    route_k = torch.randn(2, 2, 100, 6, generator=generator)
    check(device, route_q, route_k, topk, tile=tile, chunk=chunk)


def test_exact_ties_across_chunks_go_to_the_lower_key(device):
    """Keys drawn from 3 distinct vectors: every chunk holds ties of the K-th best score, and the
    merge must keep the lowest tied keys over all chunks."""
    generator = torch.Generator().manual_seed(1)
    distinct = torch.randn(1, 2, 3, 4, generator=generator)
    route_k = distinct[:, :, torch.randint(0, 3, (90,), generator=generator)].contiguous()
    route_q = torch.randn(1, 2, 2, 4, generator=generator)
    check(device, route_q, route_k, 15)
    # The 15th best score is tied with unselected keys of later chunks (which the merge drops).
    scores = (route_q @ route_k.transpose(-1, -2)).flatten(0, 2)
    kth = scores.sort(dim=-1, descending=True).values[:, 14:16]
    assert bool((kth[:, 0] == kth[:, 1]).all())
    int_q, int_k = integer_routing(1, 2, 70, 2, seed=11)
    check(device, int_q[:, :, :1], int_k, 5)


def test_fewer_keys_than_slots_leave_the_surplus_invalid(device):
    route_q, route_k = integer_routing(1, 2, 20, 3, seed=4)
    check(device, route_q[:, :, :2], route_k, 40, chunk=16)


def test_key_masks_including_a_fully_masked_chunk(device):
    route_q, route_k = integer_routing(2, 1, 80, 3, seed=5)
    key_mask = torch.ones(2, 80, dtype=torch.bool)
    key_mask[0, 32:64] = False  # chunk 1 of row 0: an all-empty list for the merge
    key_mask[1, ::3] = False
    check(device, route_q[:, :, :3], route_k, 6, key_mask=key_mask)


@pytest.mark.parametrize("local_window,global_tokens", [(0, 2), (3, 0), (3, 40)])
def test_forced_keys_come_first(device, local_window, global_tokens):
    """Global keys (as a decode step forces them; 40 spans two chunks) and the non-causal window of
    query i, (i - w, i]; the one-program kernel's order puts them first."""
    generator = torch.Generator().manual_seed(2)
    route_q = torch.randn(1, 2, 4, 5, generator=generator)
    route_k = torch.randn(1, 2, 96, 5, generator=generator)
    check(device, route_q, route_k, 4, local_window=local_window, global_tokens=global_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_select_the_same_sets(device, dtype):
    """Integer vectors are exact in any float dtype (scores are computed in fp32)."""
    route_q, route_k = integer_routing(1, 2, 64, 4, seed=3, dtype=dtype)
    check(device, route_q[:, :, :1], route_k, 5)


def test_strided_keys_are_read_in_place(device):
    """The live rows of a larger cache buffer (what a decoding step passes): same slots as a copy."""
    generator = torch.Generator().manual_seed(6)
    buffer = torch.randn(2, 2, 128, 5, generator=generator, device=device)
    route_q = torch.randn(2, 2, 1, 5, generator=generator, device=device)
    view = buffer[:, :, 10:90]
    assert not view.is_contiguous()
    got = triton_route_topk_decode(route_q, view, 6, global_tokens=1, tile=16, chunk=32)
    want = triton_route_topk_decode(route_q, view.contiguous(), 6, global_tokens=1, tile=16, chunk=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_empty_inputs_and_bad_arguments(device):
    route_q = torch.zeros(1, 1, 1, 2, device=device)
    index, valid, scored = triton_route_topk_decode(route_q, route_q[:, :, :0], 3)
    assert index.shape == (1, 1, 1, 0) and valid.shape == (1, 1, 1, 0) and scored == 0
    keys = torch.zeros(1, 1, 40, 2, device=device)
    with pytest.raises(ValueError, match="topk"):
        triton_route_topk_decode(route_q, keys, 0)
    with pytest.raises(ValueError, match="route_q"):
        triton_route_topk_decode(route_q, keys[..., :1], 2)
    with pytest.raises(ValueError, match="float32"):
        triton_route_topk_decode(route_q.double(), keys.double(), 2)
    with pytest.raises(ValueError, match="tile"):
        triton_route_topk_decode(route_q, keys, 2, tile=24)
    with pytest.raises(ValueError, match="chunk"):
        triton_route_topk_decode(route_q, keys, 2, tile=16, chunk=40)
