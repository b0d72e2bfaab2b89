"""Top-k routing and gathered attention against their dense references."""

import pytest
import torch

from routeformer.ops import (
    add_random_slots,
    gathered_dot,
    gathered_dot_reference,
    route_topk,
    route_topk_reference,
    routed_attention,
    routed_attention_reference,
)
from routeformer.ops.native import native_kernels
from routeformer.ops.native.topk import speculative_query_tile
from routeformer.ops.topk import slot_membership


@pytest.fixture(autouse=True)
def every_test_on_both(implementation):
    """Every test here runs twice: on the fused C kernels (ops/native) and on the PyTorch ops."""


def routing_inputs(length, heads=3, dim=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, length, dim, generator=gen),
            torch.randn(2, heads, length, dim, generator=gen))


def expected_scored(implementation, length, causal, group, block, rows=2 * 3, tiled=False):
    """Routing products each implementation executes: query blocks score whole key groups (tiles)
    up to the block's last query (causal) or all keys; the C kernel always scores whole tiles
    (`tiled`: the tiled kernel, which route_topk(position_dim=True) takes)."""
    if implementation == "native":
        lib = native_kernels(torch.zeros(1))
        query_tile = 0 if tiled else speculative_query_tile()
        group, block = lib.route_topk_chunk(), query_tile or lib.route_topk_query_tile()
        padded = -(-length // group) * group
        per_block = [block * (min(-(-(start + block) // group) * group, padded) if causal else padded)
                     for start in range(0, length, block)]
    else:
        padded = -(-length // group) * group
        per_block = [(min(length, start + block) - start)
                     * (min(padded, -(-min(length, start + block) // group) * group) if causal else padded)
                     for start in range(0, length, block)]
    return rows * sum(per_block)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "length, topk, local_window, global_tokens, group, block",
    [(37, 5, 0, 0, 4, 8), (37, 5, 3, 2, 4, 8), (100, 64, 0, 0, 32, 128), (300, 8, 4, 1, 8, 64),
     (65, 3, 0, 0, 2, 7)],
)
@pytest.mark.parametrize("position_dim", [False, True])  # True: the tiled kernel, newest keys first
def test_route_topk_selects_the_reference_set(
    implementation, causal, length, topk, local_window, global_tokens, group, block, position_dim
):
    route_q, route_k = routing_inputs(length)
    key_mask = torch.ones(2, length, dtype=torch.bool)
    key_mask[1, length - 5:] = False
    key_mask[0, 3] = False
    index, valid, scored = route_topk(
        route_q, route_k, topk, causal=causal, key_mask=key_mask, local_window=local_window,
        global_tokens=global_tokens, block=block, group=group, position_dim=position_dim,
    )
    member = slot_membership(index, valid, length)
    assert valid.sum() == member.sum(), "valid slots must name distinct keys"
    reference = route_topk_reference(route_q, route_k, topk, causal=causal, key_mask=key_mask,
                                     local_window=local_window, global_tokens=global_tokens)
    assert torch.equal(member, reference)
    assert scored == expected_scored(implementation, length, causal, group, block, tiled=position_dim)


def test_causal_routing_takes_every_key_when_fewer_than_k_are_eligible():
    route_q, route_k = routing_inputs(10)
    index, valid, _ = route_topk(route_q, route_k, 4, causal=True, block=3, group=2)
    assert valid.sum(-1)[0, 0].tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    member = slot_membership(index, valid, 10)
    assert not member.triu(diagonal=1).any(), "a causal query selected a future key"


def test_forced_keys_are_always_selected():
    route_q, route_k = routing_inputs(40)
    index, valid, _ = route_topk(route_q, route_k, 2, causal=True, local_window=3, global_tokens=2)
    member = slot_membership(index, valid, 40)
    for i in range(40):
        for j in list(range(max(0, i - 2), i + 1)) + [j for j in (0, 1) if j <= i]:
            assert member[:, :, i, j].all()


def test_random_slots_are_eligible_and_distinct():
    route_q, route_k = routing_inputs(50)
    index, valid, _ = route_topk(route_q, route_k, 4, causal=True)
    gen = torch.Generator().manual_seed(3)
    index, valid = add_random_slots(index, valid, 6, causal=True, generator=gen)
    assert index.shape[-1] == 10
    member = slot_membership(index, valid, 50)
    assert valid.sum() == member.sum()
    assert not member.triu(diagonal=1).any()
    assert valid[..., 4:].any(), "exploration added nothing"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float64, 8), (torch.float32, 8), (torch.float32, 32)])
def test_routed_attention_matches_reference_forward_and_gradients(causal, dtype, head_dim):
    """fp32 runs the kernels' vector exp (native) against the float64 reference."""
    gen = torch.Generator().manual_seed(4)
    shape = (2, 3, 45)
    q = torch.randn(*shape, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(*shape, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(*shape, 5, generator=gen, dtype=torch.float64)
    key_mask = torch.ones(2, 45, dtype=torch.bool)
    key_mask[1, 40:] = False
    index, valid, _ = route_topk(q, k, 6, causal=causal, key_mask=key_mask, group=4)
    index, valid = add_random_slots(index, valid, 2, causal=causal, key_mask=key_mask, generator=gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ours_q, ours_k, ours_v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = routed_attention(ours_q, ours_k, ours_v, index, valid, block=16)
    expected = routed_attention_reference(q, k, v, index, valid)
    tolerance = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(out.double(), expected, **tolerance)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, (ours_q, ours_k, ours_v), grad.to(dtype))
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, msg=f"grad {name}", **tolerance)
    # lse is the log-sum-exp of the valid logits
    logits = gathered_dot_reference(q, k, index) * head_dim ** -0.5
    torch.testing.assert_close(lse.double(), logits.masked_fill(~valid, float("-inf")).logsumexp(-1).detach(),
                               **tolerance)


@pytest.mark.parametrize("head_dim, value_dim, routed, random",
                         [(72, 70, 30, 7), (16, 130, 16, 0), (3, 17, 1, 0)])
def test_routed_attention_fp32_across_slot_and_column_chunks(head_dim, value_dim, routed, random):
    """The AVX-512 fp32 kernels work on 16 slots and 16/64 columns at a time: slot counts and dims
    that leave partial chunks (and a row with invalid slots in every chunk) against float64."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 2, 60, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 60, value_dim, generator=gen, dtype=torch.float64)
    index, valid, _ = route_topk(q, k, routed, causal=True)
    index, valid = add_random_slots(index, valid, random, causal=True, generator=gen)
    valid = valid & (torch.rand(valid.shape, generator=gen) > 0.2)  # holes in every 16-slot chunk
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ours_q, ours_k, ours_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, _ = routed_attention(ours_q, ours_k, ours_v, index, valid, block=16)
    expected = routed_attention_reference(q, k, v, index, valid)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=3e-6)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, (ours_q, ours_k, ours_v), grad.float())
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, msg=f"grad {name}", rtol=1e-5, atol=3e-6)


def test_routed_attention_rows_without_keys_are_zero():
    q, k, v = (torch.randn(1, 1, 4, 3) for _ in range(3))
    index = torch.zeros(1, 1, 4, 2, dtype=torch.long)
    valid = torch.zeros(1, 1, 4, 2, dtype=torch.bool)
    valid[0, 0, 2, 0] = True
    out, lse = routed_attention(q, k, v, index, valid)
    assert torch.equal(out[0, 0, [0, 1, 3]], torch.zeros(3, 3)) and torch.isinf(lse[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 2], v[0, 0, 0])


def test_gathered_dot_matches_reference_with_gradients():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, 2, 30, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 2, 30, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 30, (2, 2, 30, 7), generator=gen)
    ours = gathered_dot(a, b, index, block=8)
    theirs = gathered_dot_reference(a, b, index)
    torch.testing.assert_close(ours, theirs)
    grad = torch.randn_like(ours)
    for x, y in zip(torch.autograd.grad(ours, (a, b), grad), torch.autograd.grad(theirs, (a, b), grad),
                    strict=True):
        torch.testing.assert_close(x, y)


def test_bad_routing_arguments_raise_value_errors():
    route_q, route_k = routing_inputs(8)
    with pytest.raises(ValueError, match="topk must be a positive integer"):
        route_topk(route_q, route_k, 0)
    with pytest.raises(ValueError, match="route_q and route_k must be"):
        route_topk(route_q, route_k[..., :2], 2)
    with pytest.raises(ValueError, match="key_mask must be bool"):
        route_topk(route_q, route_k, 2, key_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="index must be a long tensor"):
        routed_attention(route_q, route_k, route_k, torch.zeros(2, 3, 8, 2), torch.ones(2, 3, 8, 2).bool())


def test_routed_attention_reads_a_routing_shared_by_all_heads():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 70, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    shared_q, shared_k = (torch.randn(2, 1, 70, 4, generator=gen) for _ in range(2))
    index, valid, _ = route_topk(shared_q, shared_k, 9, causal=True, local_window=2)
    index, valid = index.expand(2, 3, 70, -1), valid.expand(2, 3, 70, -1)  # head stride 0
    out, _ = routed_attention(q, k, v, index, valid)
    torch.testing.assert_close(out, routed_attention_reference(q, k, v, index, valid))


def test_native_kernels_fall_back_to_pytorch_with_a_warning_when_compiling_fails(tmp_path, monkeypatch):
    from routeformer.ops.native import build as native_build

    monkeypatch.delenv("ROUTEFORMER_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(tmp_path / "cache"))
    native_build.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="run in PyTorch"):
            assert native_kernels(torch.zeros(1)) is None
        route_q, route_k = routing_inputs(20)
        index, valid, _ = route_topk(route_q, route_k, 3)  # the PyTorch path
        assert torch.equal(slot_membership(index, valid, 20), route_topk_reference(route_q, route_k, 3))
    finally:
        native_build.load.cache_clear()


def test_non_causal_routing_of_fewer_queries_than_keys():
    """The decoding shape: a few new queries routed over a longer key cache."""
    gen = torch.Generator().manual_seed(6)
    route_q, route_k = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 90, 4, generator=gen)
    key_mask = torch.ones(2, 90, dtype=torch.bool)
    key_mask[0, 80:] = False
    index, valid, _ = route_topk(route_q, route_k, 7, causal=False, key_mask=key_mask, global_tokens=2)
    reference = route_topk_reference(route_q, route_k, 7, causal=False, key_mask=key_mask, global_tokens=2)
    assert torch.equal(slot_membership(index, valid, 90), reference)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("position_dim", [False, True])  # True: the tiled kernel, newest keys first
def test_ties_go_to_the_lower_key_index(implementation, causal, position_dim):
    """Routing vectors drawn from a few distinct values tie exactly in most rows; every
    implementation (and scan order) must pick the same set, the lower indices among equal scores."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 4, generator=gen)
    length = 150
    route_q = table[torch.randint(0, 6, (2, 3, length), generator=gen)]
    route_k = table[torch.randint(0, 6, (2, 3, length), generator=gen)]
    index, valid, _ = route_topk(route_q, route_k, 5, causal=causal, block=16, group=4,
                                 position_dim=position_dim)
    member = slot_membership(index, valid, length)
    reference = route_topk_reference(route_q, route_k, 5, causal=causal)
    assert torch.equal(member, reference)
    # The rule itself, on a row where every key scores the same: keys 0..4 (causal: up to i).
    same = torch.ones(1, 1, length, 4)
    index, valid, _ = route_topk(same, same, 5, causal=causal, block=16, group=4, position_dim=position_dim)
    member = slot_membership(index, valid, length)[0, 0]
    expected = torch.zeros(length, length, dtype=torch.bool)
    expected[:, :5] = True
    if causal:
        expected &= torch.ones(length, length, dtype=torch.bool).tril()
    assert torch.equal(member, expected)


def test_routing_product_count_matches_a_loop_over_query_tiles():
    from routeformer.ops.native.topk import route_topk_scored

    def by_loop(rows, length, stride, causal, tile, query_tile):
        blocks = -(-length // query_tile)
        if not causal:
            return rows * blocks * query_tile * stride
        stops = (min(t * query_tile, length) for t in range(1, blocks + 1))
        return rows * query_tile * sum(-(-stop // tile) * tile for stop in stops)

    for length in (1, 5, 6, 7, 16, 17, 95, 96, 97, 1000, 4099):
        for tile, query_tile in ((16, 6), (16, 4), (8, 12), (32, 1)):
            for causal in (True, False):
                assert route_topk_scored(3, length, 4112, causal, tile, query_tile) == \
                    by_loop(3, length, 4112, causal, tile, query_tile), (length, tile, query_tile, causal)


def test_a_position_like_routing_dim_takes_the_tiled_kernel_with_the_same_selection():
    from routeformer.ops.topk import routing as topk_routing

    gen = torch.Generator().manual_seed(3)
    route_q, route_k = torch.randn(1, 2, 300, 5, generator=gen), torch.randn(1, 2, 300, 5, generator=gen)
    assert not topk_routing._one_dim_dominates(route_k)
    # the topk layer's recency feature: the key position itself in one dim
    route_k[..., -1] = torch.arange(300.0)
    route_q[..., -1] = 0.05
    assert topk_routing._one_dim_dominates(route_k)
    index, valid, _ = route_topk(route_q, route_k, 8, causal=True)
    expected = route_topk_reference(route_q.double(), route_k.double(), 8, causal=True)
    assert torch.equal(slot_membership(index, valid, 300), expected)


def test_position_dim_takes_the_tiled_kernel_without_reading_the_data(implementation, monkeypatch):
    from routeformer.ops.topk import routing as topk_routing

    gen = torch.Generator().manual_seed(4)
    route_q, route_k = torch.randn(1, 2, 200, 5, generator=gen), torch.randn(1, 2, 200, 5, generator=gen)
    route_k[..., -1], route_q[..., -1] = torch.arange(200.0), 0.05
    expected = route_topk_reference(route_q.double(), route_k.double(), 8, causal=True)
    calls = []
    monkeypatch.setattr(topk_routing, "_one_dim_dominates", lambda keys: calls.append(keys) or False)
    for position_dim in (False, True):  # the data check (forced to say no) then the caller's word
        index, valid, _ = route_topk(route_q, route_k, 8, causal=True, position_dim=position_dim)
        assert torch.equal(slot_membership(index, valid, 200), expected)
    # position_dim=True chose without the check (which only the speculative kernel's path runs)
    assert len(calls) == (1 if implementation == "native" and speculative_query_tile() else 0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("position_dim", [False, True])
def test_float64_routing_selects_the_reference_set_in_both_scan_orders(implementation, causal, position_dim):
    # float64 takes the tiled kernel (route_topk_f64) on the native path; a recency-like last dim
    # and a few exact ties (keys repeated) exercise the newest-first scan's `>=` test.
    gen = torch.Generator().manual_seed(5)
    route_q = torch.randn(2, 2, 90, 6, generator=gen, dtype=torch.float64)
    route_k = torch.randn(2, 2, 90, 6, generator=gen, dtype=torch.float64)
    route_k[:, :, 40:50] = route_k[:, :, 10:20]  # equal keys: equal scores
    route_k[..., -1], route_q[..., -1] = torch.arange(90.0, dtype=torch.float64) / 30, 0.3
    route_q[:, :, ::2, -1] = 0.0  # these queries ignore the position dim: their repeated keys tie
    key_mask = torch.rand(2, 90, generator=gen) > 0.1
    index, valid, _ = route_topk(route_q, route_k, 7, causal=causal, key_mask=key_mask, local_window=3,
                                 global_tokens=2, position_dim=position_dim)
    expected = route_topk_reference(route_q, route_k, 7, causal=causal, key_mask=key_mask, local_window=3,
                                    global_tokens=2)
    assert torch.equal(slot_membership(index, valid, 90), expected)
