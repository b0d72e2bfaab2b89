"""The experts at selected query rows equal their dense-mask references, forward and backward."""

import pytest
import torch

from routeformer.ops import routed_rows, row_chunks
from routeformer.ops.full import full_attention
from routeformer.ops.linear import linear_attention
from routeformer.ops.local import local_attention
from routeformer.ops.native.kernel_flops import band_attend_flops
from routeformer.ops.routed_rows import (
    full_attention_rows,
    full_attention_rows_reference,
    linear_attention_rows,
    linear_attention_rows_reference,
    local_attention_rows,
    local_attention_rows_reference,
    select_rows,
)
from routeformer.ops.row_chunks import chunk_starts

B, H, D = 2, 3, 8


def gather_rows(x, rows):
    return x.gather(2, rows[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[-1]))


def inputs(length, seed, routed=(0.4, 0.8), masked=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, length, D, generator=gen, dtype=torch.float64) for _ in range(3))
    route = torch.rand(B, length, generator=gen) < torch.tensor(routed, dtype=torch.float64)[:, None]
    mask = torch.rand(B, length, generator=gen) < 0.85 if masked else None
    rows, valid = select_rows(route)
    return q, k, v, rows, valid, mask


CASES = {
    "full": (full_attention_rows, full_attention_rows_reference, {"chunk": 5}, {}),
    "local": (local_attention_rows, local_attention_rows_reference, {"window": 6, "chunk": 4}, {"window": 6}),
    "linear": (linear_attention_rows, linear_attention_rows_reference, {"chunk": 5}, {}),
}


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls into the C kernels by the row ops: linear (autograd function) and the
    banded forward of full and local rows (inference only)."""
    calls = {"linear": 0, "band": 0}

    linear = routed_rows.NativeLinearRows

    class CountedLinear(linear):
        @staticmethod
        def apply(*args):
            calls["linear"] += 1
            return linear.apply(*args)

    def counted_band(*args, band=routed_rows.band_attend):
        calls["band"] += 1
        return band(*args)

    monkeypatch.setattr(routed_rows, "NativeLinearRows", CountedLinear)
    monkeypatch.setattr(routed_rows, "band_attend", counted_band)
    return calls


def test_select_rows_lists_routed_positions_in_order():
    route = torch.tensor([[True, False, True, True], [False, False, True, False]])
    rows, valid = select_rows(route)
    assert rows.tolist() == [[0, 2, 3], [2, 0, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="route must be a bool"):
        select_rows(route.long())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
# 100: several of the C linear sweep's 32-key chunks, with rows in each.
@pytest.mark.parametrize("length", [1, 13, 37, 100])
def test_rows_match_reference_forward_and_backward(
    name, causal, masked, length, implementation, native_calls
):
    fast, reference, fast_options, reference_options = CASES[name]
    q, k, v, rows, valid, mask = inputs(length, seed=length, masked=masked)
    q_rows = gather_rows(q, rows).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out, flops = fast(q_rows, k, v, rows, valid, mask=mask, causal=causal, **fast_options)
    expected = reference(q_rows, k, v, rows, valid, mask=mask, causal=causal, **reference_options)
    real = valid[:, None, :, None]
    # The linear op's prefix sum runs in fp32 by design, hence its looser tolerance.
    tolerance = 1e-6 if name == "linear" else 1e-10
    torch.testing.assert_close(out * real, expected * real, atol=tolerance, rtol=tolerance)
    assert (out * ~real).abs().max() == 0, "padding slots must return zeros"
    assert flops > 0
    weights = torch.randn(out.shape, dtype=out.dtype) * real
    grads = torch.autograd.grad((out * weights).sum(), (q_rows, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q_rows, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5 if name == "linear" else 1e-9, rtol=1e-5)
    # The C kernels serve the causal linear rows (forward and backward); full and local rows that
    # want a gradient stay on the flash chunks.
    served = implementation == "native" and causal and name == "linear"
    assert native_calls["linear"] == (1 if served else 0)
    assert native_calls["band"] == 0


@pytest.mark.parametrize("name", list(CASES))
def test_rows_read_strided_head_views(name, implementation):
    """Keys and values as head views of one [B, T, 2·H·d] projection (the layers' layout, read in
    place by the C kernels): the same values and gradients as contiguous copies."""
    fast, reference, fast_options, reference_options = CASES[name]
    q, _, _, rows, valid, _ = inputs(29, seed=11)
    gen = torch.Generator().manual_seed(3)
    projection = torch.randn(B, 29, 2 * H * D, dtype=torch.float64, generator=gen)
    k, v = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in projection.chunk(2, dim=-1))
    assert not k.is_contiguous()
    q_rows = gather_rows(q, rows)
    for grad in (True, False):
        leaves = [t.detach().requires_grad_(grad) for t in (q_rows, k, v)]  # k, v stay strided views
        with torch.set_grad_enabled(grad):
            out, _ = fast(*leaves, rows, valid, causal=True, **fast_options)
        expected = reference(*(t.detach().contiguous() for t in leaves), rows, valid, causal=True,
                             **reference_options)
        real = valid[:, None, :, None]
        # The PyTorch linear op's prefix sum runs in fp32 by design, hence the looser tolerance.
        tolerance = 1e-6 if name == "linear" else 1e-9
        torch.testing.assert_close(out * real, expected * real, atol=tolerance, rtol=tolerance)
        if grad:
            contiguous = [t.detach().contiguous().requires_grad_() for t in leaves]
            want = torch.autograd.grad((reference(*contiguous, rows, valid, causal=True, **reference_options)
                                        * real).sum(), contiguous)
            got = torch.autograd.grad((out * real).sum(), leaves)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=10 * tolerance, rtol=10 * tolerance)


@pytest.mark.parametrize("length", [1, 13, 37, 100])
@pytest.mark.parametrize(("name", "window"), [("full", None), ("local", 1), ("local", 6), ("local", 40)])
def test_rows_without_gradient_match_reference(name, length, window, implementation, native_calls):
    """Inference: causal, unpadded full and local rows run the query-blocked C pass (every padding
    slot and window clipped at position 0 included), equal to the reference."""
    fast, reference, _, _ = CASES[name]
    options = {} if window is None else {"window": window}
    q, k, v, rows, valid, _ = inputs(length, seed=length + (window or 0))
    q_rows = gather_rows(q, rows)
    with torch.no_grad():
        out, flops = fast(q_rows, k, v, rows, valid, causal=True, **options)
    expected = reference(q_rows, k, v, rows, valid, causal=True, **options)
    real = valid[:, None, :, None]
    torch.testing.assert_close(out * real, expected * real, atol=1e-10, rtol=1e-10)
    assert (out * ~real).abs().max() == 0, "padding slots must return zeros"
    assert native_calls["band"] == (1 if implementation == "native" else 0)
    pairs = int(torch.where(valid, (rows + 1).clamp(max=window or length), 0).sum())
    # fp32 runs the vectorised paths (register tiles, 8-lane exponentials, weighted rows).
    with torch.no_grad():
        single, _ = fast(q_rows.float(), k.float(), v.float(), rows, valid, causal=True, **options)
    torch.testing.assert_close(single * real, (expected * real).float(), atol=1e-5, rtol=1e-5)
    if implementation == "native":  # the query-blocked pass: whole key tiles, three-row groups
        horizon = torch.where(valid, (rows + 1).clamp(max=window or length), 0)
        per_row, positions = (t[:, None].expand(B, H, -1).reshape(B * H, -1) for t in (horizon, rows))
        assert flops == band_attend_flops(per_row, positions, D, D) >= H * 4 * D * pairs


@pytest.mark.parametrize("causal", [True, False])
def test_rows_equal_the_dense_ops_at_the_selected_positions(causal, implementation):
    """The reference itself is pinned to the dense experts: every row selected = the dense op."""
    length = 29
    q, k, v, _, _, _ = inputs(length, seed=3)
    rows, valid = select_rows(torch.ones(B, length, dtype=torch.bool))
    dense = {
        "full": full_attention(q, k, v, causal=causal),
        "local": local_attention(q, k, v, window=6, causal=causal),
        "linear": linear_attention(q, k, v, causal=causal),
    }
    for name, (fast, _, options, _) in CASES.items():
        out, _ = fast(q, k, v, rows, valid, causal=causal, **options)
        torch.testing.assert_close(out, dense[name], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_rows_cost_less_than_the_dense_op(name, implementation):
    """Executed FLOPs fall with the share of rows selected (10% of 1024 rows here)."""
    fast = CASES[name][0]
    # Default blocks and chunks (64): rows are packed per block, which needs room for many rows.
    options = {"window": 64} if name == "local" else {}
    length = 1024
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, D, generator=gen) for _ in range(3))
    few = torch.rand(1, length, generator=gen) < 0.1
    every = torch.ones(1, length, dtype=torch.bool)
    flops = {}
    for label, route in (("few", few), ("every", every)):
        rows, valid = select_rows(route)
        _, flops[label] = fast(gather_rows(q, rows), k, v, rows, valid, causal=True, **options)
    # The linear expert's running state is built from every key whatever the rows (d·e per key,
    # as much as one row's read of it), so its cost can only fall towards half.
    assert flops["few"] < (0.6 if name == "linear" else 0.5) * flops["every"], flops


def test_rows_reject_mismatched_shapes():
    q, k, v, rows, valid, _ = inputs(9, seed=0)
    with pytest.raises(ValueError, match="rows and valid"):
        full_attention_rows(gather_rows(q, rows), k, v, rows[:, :1], valid, causal=True)
    with pytest.raises(ValueError, match="mask must have shape"):
        local_attention_rows(gather_rows(q, rows), k, v, rows, valid, window=3,
                             mask=torch.ones(B, 4, dtype=torch.bool))


@pytest.mark.parametrize("name", ["full", "local"])
@pytest.mark.parametrize("causal", [True, False])
def test_rows_without_the_blocked_pass_match_reference(name, causal, monkeypatch):
    """The per-chunk SDPA fallback (GPU) equals the reference too, forward and backward."""
    monkeypatch.setattr(row_chunks, "blocked_attention_fits", lambda q, v: False)
    fast, reference, fast_options, reference_options = CASES[name]
    q, k, v, rows, valid, mask = inputs(23, seed=5, masked=True)
    q_rows = gather_rows(q, rows).requires_grad_()
    out, _ = fast(q_rows, k, v, rows, valid, mask=mask, causal=causal, **fast_options)
    expected = reference(q_rows, k, v, rows, valid, mask=mask, causal=causal, **reference_options)
    real = valid[:, None, :, None]
    torch.testing.assert_close(out * real, expected * real)
    grad, = torch.autograd.grad((out * real).sum(), q_rows)
    expected_grad, = torch.autograd.grad((expected * real).sum(), q_rows)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("name", list(CASES))
def test_rows_with_every_key_masked_return_zeros_and_no_nan(name, implementation):
    fast, _, options, _ = CASES[name]
    q, k, v, rows, valid, _ = inputs(17, seed=2)
    mask = torch.ones(B, 17, dtype=torch.bool)
    mask[1] = False  # batch row 1 has no real key at all
    q_rows = gather_rows(q, rows).requires_grad_()
    out, _ = fast(q_rows, k, v, rows, valid, mask=mask, causal=True, **options)
    assert out[1].abs().max() == 0 and torch.isfinite(out).all()
    grad, = torch.autograd.grad(out.sum(), q_rows)
    assert grad[1].abs().max() == 0 and torch.isfinite(grad).all()


def test_chunks_of_sparse_rows_stay_within_a_bucket():
    positions = torch.tensor([[0, 1, 2, 3, 9, 10, 30, 31, 32]])
    assert chunk_starts(positions, chunk=3, bucket=None) == [0, 3, 6]
    # Buckets of 8 positions: [0..3] | [9, 10] | [30, 31] | [32]; then at most 3 rows per chunk.
    assert chunk_starts(positions, chunk=3, bucket=8) == [0, 3, 4, 6, 8]
