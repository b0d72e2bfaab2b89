"""Every fast op equals its reference twin, forward and input gradients."""

from functools import partial

import pytest
import torch

from routeformer.ops import (
    full_attention,
    full_attention_reference,
    linear_attention,
    linear_attention_reference,
    local_attention,
    local_attention_reference,
)

LENGTHS = [1, 7, 64, 257, 1000]

OPS = {
    "full": (full_attention, full_attention_reference),
    "linear": (linear_attention, linear_attention_reference),
    "local-w1": (partial(local_attention, window=1), partial(local_attention_reference, window=1)),
    "local-w16": (partial(local_attention, window=16), partial(local_attention_reference, window=16)),
    "local-w100": (
        partial(local_attention, window=100), partial(local_attention_reference, window=100)
    ),
}

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_inputs(length, dtype, padded, seed=0, batch=2, heads=2, dim=16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=gen) for _ in range(3))
    mask = None
    if padded:
        # Sequence 0 is whole; sequence 1 has random holes and a padded tail.
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[1] = torch.rand(length, generator=gen) > 0.3
        mask[1, length - length // 4 :] = False
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], mask


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / (expected.float().norm() + 1e-12)).item()


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_matches_reference_fp32(op_name, length, causal, padded):
    fast, reference = OPS[op_name]
    (q, k, v), mask = make_inputs(length, torch.float32, padded)
    out = fast(q, k, v, mask=mask, causal=causal)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = reference(q, k, v, mask=mask, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("causal", [True, False])
def test_fast_matches_reference_bf16(op_name, causal):
    fast, reference = OPS[op_name]
    (q, k, v), mask = make_inputs(257, torch.bfloat16, padded=True)
    out = fast(q, k, v, mask=mask, causal=causal)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # The reference runs in fp32 on the same (bf16-rounded) inputs: it is the exact answer.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(q32, k32, v32, mask=mask, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        # A one-key window has exactly zero q/k gradients, where fused kernels leave ~1e-7 of noise.
        tiny = (grad.float() - ref_grad).abs().max() < 1e-5
        assert tiny or relative_error(grad, ref_grad) < 5e-2


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("causal", [True, False])
def test_query_with_no_keys_returns_zeros(op_name, causal):
    fast, reference = OPS[op_name]
    (q, k, v), _ = make_inputs(20, torch.float32, padded=False)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0] = False  # sequence 0 has no real key at all
    mask[1, :5] = False  # causal: the first five queries of sequence 1 see no key
    for op in (fast, reference):
        out = op(q, k, v, mask=mask, causal=causal)
        assert torch.isfinite(out).all()
        assert out[0].abs().max() == 0
        if causal:
            assert out[1, :, :5].abs().max() == 0
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


def test_linear_chunk_size_does_not_change_the_result():
    (q, k, v), mask = make_inputs(300, torch.float32, padded=True)
    outs = [linear_attention(q, k, v, mask=mask, causal=True, chunk=c) for c in (1, 17, 64, 512)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


def test_local_window_covering_the_sequence_equals_full_attention():
    (q, k, v), mask = make_inputs(50, torch.float32, padded=True)
    for causal in (True, False):
        local = local_attention(q, k, v, window=50, mask=mask, causal=causal)
        full = full_attention_reference(q, k, v, mask=mask, causal=causal)
        torch.testing.assert_close(local, full, atol=2e-5, rtol=2e-5)


def test_local_reads_only_its_window():
    (q, k, v), _ = make_inputs(40, torch.float32, padded=False)
    out = local_attention(q, k, v, window=8, causal=True)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, :10] += 5.0  # keys 0..9 are outside the window of queries >= 17
    v2[:, :, :10] -= 3.0
    out2 = local_attention(q, k2, v2, window=8, causal=True)
    torch.testing.assert_close(out[:, :, 17:], out2[:, :, 17:])
    assert not torch.allclose(out[:, :, :17], out2[:, :, :17])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: full_attention(q[0], q, q), "q must have shape"),
        (lambda q: local_attention(q, q, q, window=0), "window must be a positive integer"),
        (lambda q: linear_attention(q, q, q, mask=torch.ones(2, 5)), "mask must be a bool"),
        (
            lambda q: full_attention(q, q, q, mask=torch.ones(2, 4, dtype=torch.bool)),
            "mask must have shape",
        ),
        (lambda q: full_attention(q, q[:, :, :3], q[:, :, :3], causal=True), "causal attention"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match=message):
        call(q)


@pytest.mark.parametrize("chunks", [1, 5, 200])  # 200: past the matrix-product path, the cumsum one
def test_exclusive_chunk_prefix_sums_the_chunks_before(chunks):
    from routeformer.ops.linear import exclusive_chunk_prefix

    states = torch.randn(2, 3, chunks, 4, 5, dtype=torch.float64)
    expected = torch.stack([states[:, :, :n].sum(dim=2) for n in range(chunks)], dim=2)
    # The prefix is summed in fp32 by design, hence fp32 tolerances on float64 input.
    torch.testing.assert_close(exclusive_chunk_prefix(states), expected, atol=1e-5, rtol=1e-5)
