"""The speculative routing kernel (ops/native/topk_speculative_kernels.c) for float32 and bfloat16.

float32: the same selection as the tiled float32 kernel (route_topk_f32), row for row, on inputs
that exercise its guesses, flushes, refuted guesses and unguarded rows. bfloat16: read as stored,
it selects exactly what float32 selects on the widened values, and against the fp64 scores of the
unrounded vectors each selected key is within the stated tolerance of the K-th best."""


from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from routeformer.ops import route_topk, route_topk_reference, routed_attention, routed_attention_reference
from routeformer.ops.native import kernel, native_kernels
from routeformer.ops.native.topk import (
    reads_bf16,
    route_topk_op,
    route_topk_rows_op,
    speculative_prefilter_exact,
    speculative_query_tile,
)
from routeformer.ops.topk import slot_membership

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None or not speculative_query_tile(),
                                reason="no C compiler, or a library built without AVX2 + FMA "
                                "(ROUTEFORMER_ISA=generic, or a CPU without them)")


def _tiled(route_k: torch.Tensor) -> torch.Tensor:
    """The key layout of route_topk_op (tiles of V keys, each transposed, zero-padded)."""
    tile = native_kernels(route_k).route_topk_chunk()
    padded = -(-route_k.shape[2] // tile) * tile
    keys = torch.nn.functional.pad(route_k, (0, 0, 0, padded - route_k.shape[2]))
    return keys.unflatten(2, (padded // tile, tile)).transpose(-1, -2).contiguous()


def _both(route_q, route_k, slots, causal=True, key_mask=None, local_window=0, global_tokens=0):
    """(membership by the speculative kernel, by route_topk_f32), bool [B, R, T, S]."""
    mask = None if key_mask is None else key_mask.to(torch.uint8)
    heads, num_keys = route_q.shape[1], route_k.shape[2]
    fast = route_topk_rows_op(route_q, route_k, mask, heads, slots, causal, local_window, global_tokens)
    tiled = route_topk_op(route_q.float(), _tiled(route_k.float()), mask, heads, num_keys, slots, causal,
                          local_window, global_tokens)
    return slot_membership(*fast, route_k.shape[2]), slot_membership(*tiled, route_k.shape[2])


@contextmanager
def _threads(count: int) -> Iterator[None]:
    """torch (and so the kernels) on `count` threads inside the block, the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _refuted() -> int:
    return int(kernel("route_topk_spec_refuted")())


def _exact_rows() -> int:
    return int(kernel("route_topk_spec_exact_rows")())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("local_window, global_tokens, masked", [(0, 0, False), (5, 3, True)])
def test_float32_selects_what_the_tiled_kernel_selects(causal, local_window, global_tokens, masked):
    gen = torch.Generator().manual_seed(0)
    route_q, route_k = (torch.randn(2, 2, 1200, 16, generator=gen) for _ in range(2))
    key_mask = None
    if masked:
        key_mask = torch.rand(2, 1200, generator=gen) > 0.1
    fast, tiled = _both(route_q, route_k, 40, causal, key_mask, local_window, global_tokens)
    assert torch.equal(fast, tiled)


@pytest.mark.parametrize("causal, local_window, global_tokens, masked",
                         [(True, 0, 0, False), (False, 0, 0, False), (True, 4, 2, True)])
def test_float32_selects_the_same_through_many_flushes(causal, local_window, global_tokens, masked):
    """A query flushes its candidates when 4 x slots of its hit tiles are held: with 3 slots, every
    12 hit tiles, and a row's first block (no guess yet, every tile hits) scans 3000 keys."""
    gen = torch.Generator().manual_seed(1)
    route_q, route_k = (torch.randn(1, 2, 3000, 16, generator=gen) for _ in range(2))
    key_mask = torch.rand(1, 3000, generator=gen) > 0.2 if masked else None
    fast, tiled = _both(route_q, route_k, 3, causal, key_mask, local_window, global_tokens)
    assert torch.equal(fast, tiled)


def test_refuted_guesses_are_routed_again_exactly():
    """Keys twice as spread along one axis and queries that alternate between it and the others:
    the K-th best / |q| ratio jumps between blocks, so guesses fail and those queries are redone.
    (Spread far more along one axis, the bf16 margin crowds the K-th best and the row switches to
    the exact scan instead; see the next tests.)"""
    gen = torch.Generator().manual_seed(1)
    route_k = torch.randn(1, 1, 2000, 8, generator=gen) * torch.tensor([2.0, *[1.0] * 7])
    route_q = torch.randn(1, 1, 2000, 8, generator=gen)
    route_q[..., (torch.arange(2000) // 40) % 2 == 1, 0] = 0.0
    before, exact_before = _refuted(), _exact_rows()
    fast, tiled = _both(route_q, route_k, 24)
    assert _refuted() > before
    assert _exact_rows() == exact_before
    assert torch.equal(fast, tiled)


def test_ties_odd_dims_and_the_float32_reference():
    """Repeated keys tie exactly (the lower index wins), r = 5 has a half-empty bf16 pair, and
    small-integer vectors score exactly in every dtype, so the reference must agree."""
    gen = torch.Generator().manual_seed(2)
    route_q = torch.randint(-3, 4, (1, 2, 700, 5), generator=gen).float()
    route_k = torch.randint(-3, 4, (1, 2, 700, 5), generator=gen).float()
    fast, tiled = _both(route_q, route_k, 20)
    assert torch.equal(fast, tiled)
    assert torch.equal(fast, route_topk_reference(route_q.double(), route_k.double(), 20, causal=True))
    fast_bf16, _ = _both(route_q.bfloat16(), route_k.bfloat16(), 20)
    assert torch.equal(fast_bf16, fast)


def test_huge_and_nan_values_take_the_unguarded_path():
    gen = torch.Generator().manual_seed(3)
    route_q, route_k = (torch.randn(1, 1, 300, 6, generator=gen) for _ in range(2))
    route_k[0, 0, 7] = 3e37  # beyond the prefilter's guard: every key is rescored exactly
    route_q[0, 0, 100] = float("nan")  # a NaN query routes no key (forced keys only)
    fast, tiled = _both(route_q, route_k, 10, local_window=2)
    assert torch.equal(fast, tiled)
    assert fast[0, 0, 100].sum() == 2


def test_bfloat16_is_read_as_stored_and_within_tolerance_of_fp64():
    """bf16 routing vectors select exactly the fp32 selection of their widened values. Against the
    fp64 scores s of the unrounded fp32 vectors, rounding moves a score by at most
    (2^-7 + 2^-16)·|q|·|k| (two bf16 roundings of relative 2^-8), so each selected key scores
    >= the K-th best fp64 score - 2·(2^-7 + 2^-16)·|q|·max|k|."""
    gen = torch.Generator().manual_seed(4)
    route_q, route_k = (torch.randn(1, 2, 900, 16, generator=gen) for _ in range(2))
    slots = 32
    bf16_q, bf16_k = route_q.bfloat16(), route_k.bfloat16()
    fast, tiled = _both(bf16_q, bf16_k, slots)
    assert torch.equal(fast, tiled)
    index, valid, _ = route_topk(bf16_q, bf16_k, slots, causal=True)
    assert torch.equal(slot_membership(index, valid, 900), fast)  # route_topk takes this kernel
    scores = route_q.double() @ route_k.double().transpose(-1, -2)
    scores = scores.masked_fill(torch.ones(900, 900, dtype=torch.bool).triu(1), float("-inf"))
    kth_best = scores.topk(slots, dim=-1).values[..., -1:]
    tolerance = 2 * (2**-7 + 2**-16) * route_q.double().norm(dim=-1, keepdim=True) \
        * route_k.double().norm(dim=-1).amax(dim=-1)[..., None, None]
    selected = scores.masked_fill(~fast, float("inf"))
    assert bool((selected >= kth_best - tolerance).all())
    # the tolerance is needed (bf16 does swap near-ties) but the sets mostly agree
    exact = route_topk_reference(route_q.double(), route_k.double(), slots, causal=True)
    agreement = (fast & exact).sum() / exact.sum()
    assert agreement > 0.95


def test_float16_routes_through_float32():
    gen = torch.Generator().manual_seed(5)
    route_q, route_k = (torch.randn(1, 1, 200, 8, generator=gen).half() for _ in range(2))
    index, valid, _ = route_topk(route_q, route_k, 12, causal=True)
    expected = route_topk_reference(route_q.float(), route_k.float(), 12, causal=True)
    assert torch.equal(slot_membership(index, valid, 200), expected)


def test_bad_arguments_raise_value_errors():
    queries = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        route_topk_rows_op(queries, queries.double(), None, 1, 3, True, 0, 0)
    with pytest.raises(ValueError, match="routing dim"):
        route_topk_rows_op(torch.randn(1, 1, 8, 65), torch.randn(1, 1, 8, 65), None, 1, 3, True, 0, 0)


def test_opcheck():
    gen = torch.Generator().manual_seed(6)
    route_q, route_k = (torch.randn(1, 2, 20, 4, generator=gen) for _ in range(2))
    torch.library.opcheck(route_topk_rows_op.op, (route_q, route_k, None, 2, 5, True, 1, 0))


@pytest.mark.parametrize("shared_routing", [False, True])
def test_bf16_attention_reads_bf16_within_tolerance_of_fp64(shared_routing):
    """routed_attention on bf16 q, k, v runs the bf16 kernels (no fp32 copies): outputs and
    gradients within 2e-2 of the fp64 reference (bf16 rounds each stored value by <= 2^-8
    relative; the arithmetic is fp32). Head dims 20 and 24 take the kernels' scalar tails; one row
    has no valid slot (zeros, no gradient)."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 2, 40, 20, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(2, 2, 40, 24, generator=gen).bfloat16()
    index = torch.randint(0, 40, (2, 1 if shared_routing else 2, 40, 7), generator=gen)
    index = torch.sort(index, dim=-1).values
    distinct = index[..., 1:] != index[..., :-1]  # valid slots name distinct keys
    valid = torch.cat([torch.ones_like(index[..., :1], dtype=torch.bool), distinct], -1)
    valid[0, :, 5] = False  # an empty row
    index, valid = index.expand(2, 2, 40, 7), valid.expand(2, 2, 40, 7)
    assert reads_bf16(q, k, v)
    weights = torch.randn(2, 2, 40, 24, generator=gen)
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        if dtype == torch.bfloat16:
            out = routed_attention(*leaves, index, valid)[0]
        else:
            out = routed_attention_reference(*leaves, index, valid)
        grads = torch.autograd.grad((out * weights.to(dtype)).sum(), leaves)
        results.append((out, *grads))
    assert results[0][0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in results[0][1:])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)
    assert not results[0][0][0, :, 5].any()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("local_window, global_tokens, masked", [(0, 0, False), (7, 2, True)])
def test_crowded_rows_switch_to_the_exact_scan_and_select_the_same(causal, local_window, global_tokens,
                                                                   masked):
    """Routing vectors drawn from 12 distinct ones (a position-blind router's first layer: one vector
    per token) tie the K-th best by hundreds of keys: those rows switch to the exact scan, and the
    selection is still route_topk_f32's, ties to the lower index (small integers score exactly, so
    the float64 reference must agree too). Random vectors do not switch, on one thread or two.
    The exact (AVX2) prefilter passes only the keys that tie the K-th best itself, not those within
    a bf16 margin of it: 3 distinct vectors crowd it as 12 crowd the bf16 one."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 3 if speculative_prefilter_exact() else 12, (2, 1500), generator=gen)
    table_q, table_k = (torch.randint(-3, 4, (12, 16), generator=gen).float() for _ in range(2))
    route_q = table_q[tokens].unsqueeze(1).expand(2, 2, 1500, 16).contiguous()
    route_k = table_k[tokens].unsqueeze(1).expand(2, 2, 1500, 16).contiguous()
    key_mask = torch.rand(2, 1500, generator=gen) > 0.1 if masked else None
    before = _exact_rows()
    fast, tiled = _both(route_q, route_k, 48, causal, key_mask, local_window, global_tokens)
    assert _exact_rows() > before
    assert torch.equal(fast, tiled)
    if not masked:
        assert torch.equal(fast, route_topk_reference(route_q.double(), route_k.double(), 48, causal=causal))
    random_q, random_k = (torch.randn(2, 2, 1500, 16, generator=gen) for _ in range(2))
    for count in (1, 2):
        with _threads(count):
            before = _exact_rows()
            _both(random_q, random_k, 48, causal)
        assert _exact_rows() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [8, 1])  # 16 rows, each one task; 2 rows, in runs of blocks
def test_the_index_is_the_same_on_one_thread_or_two_slot_order_included(dtype, batch):
    """Crowded rows (routing vectors from 16 distinct ones) make the guesses, and so the flushes and
    the order in which a query's keys are listed, depend on the blocks routed before in the row:
    tasks fixed by the shape (whole rows, or runs of a row's blocks when the rows are few), each
    routed by one thread from its start, give the same index, slot for slot, on any number of
    threads and on every call (the attention sums the slots in that order)."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(16, 16, generator=gen)
    tokens = torch.randint(0, 16, (batch, 512), generator=gen)
    route_k = table[tokens].unsqueeze(1).expand(batch, 2, 512, 16).contiguous()
    route_q = route_k + 1e-3 * torch.randn(route_k.shape, generator=gen)
    route_q, route_k = route_q.to(dtype), route_k.to(dtype)
    calls = []
    for count in (1, 2, 2, 2, 3):
        with _threads(count):
            calls.append(route_topk_rows_op(route_q, route_k, None, 2, 64, True, 0, 0))
    for index, valid in calls[1:]:
        assert torch.equal(index, calls[0][0]) and torch.equal(valid, calls[0][1])
