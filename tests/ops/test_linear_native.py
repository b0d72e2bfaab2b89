"""The native causal linear attention kernels (ops/native/linear.py) against the fp64 reference and
the PyTorch chunked path: values and gradients, fp32 and bf16, masks, odd lengths, strides."""

import pytest
import torch

from routeformer.ops.linear import linear_attention, linear_attention_reference
from routeformer.ops.native import linear as native_linear
from routeformer.ops.native import native_enabled, native_kernels

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no native kernels here")

# Relative (Frobenius) error against the fp64 reference. fp32: products accumulate in fp32 over up
# to T terms. bf16: inputs and outputs are rounded to 8 bits of mantissa (2^-9 relative each), and
# so are the operands of the d×e state products (the sums stay fp32): measured 2e-3 (out) to 6e-3
# (dq) at d = 64, T = 2048, vs 4e-3 to 1.1e-2 for the PyTorch bf16 path.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def make_inputs(length, dim=16, value_dim=16, batch=2, heads=2, padded=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, heads, length, value_dim, generator=gen, dtype=torch.float64)
    mask = None
    if padded:
        mask = torch.rand(batch, length, generator=gen) > 0.3
        mask[-1, length - length // 4:] = False  # a padded tail
    return (q, k, v), mask


def relative_error(actual, expected):
    """‖actual − expected‖ / ‖expected‖, the norm floored at 1e-2 per element (at T = 1 the true dq
    is 0 and fp32 leaves ~1e-7 of cancellation)."""
    floor = 1e-2 * expected.numel() ** 0.5
    return ((actual.double() - expected).norm() / max(expected.norm().item(), floor)).item()


def values_and_grads(op, inputs, mask, grad_out, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = op(*leaves, mask=mask, causal=True)
    return out, torch.autograd.grad(out, leaves, grad_out.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, dim, value_dim, padded", [
    (1, 16, 16, False), (15, 8, 24, True), (64, 16, 16, False), (65, 16, 16, True),
    (200, 24, 40, True), (333, 80, 72, False),  # > 64 wide: two column strips; lengths off the chunk
])
def test_native_matches_the_fp64_reference(dtype, length, dim, value_dim, padded):
    inputs, mask = make_inputs(length, dim, value_dim, padded=padded)
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    ref = linear_attention_reference(*ref_leaves, mask=mask, causal=True)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
    out, grads = values_and_grads(linear_attention, inputs, mask, grad_out, dtype)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    for name, grad, ref_grad in zip("qkv", grads, ref_grads, strict=True):
        assert relative_error(grad, ref_grad) < TOLERANCE[dtype], name


def test_native_matches_the_pytorch_path_and_is_used():
    inputs, mask = make_inputs(300, padded=True)
    grad_out = torch.randn(2, 2, 300, 16, dtype=torch.float64)
    out, grads = values_and_grads(linear_attention, inputs, mask, grad_out, torch.float32)
    assert "routeformer_causal_linear" in out.grad_fn.name()  # the custom op's registered backward
    with native_enabled(False):
        torch_out, torch_grads = values_and_grads(linear_attention, inputs, mask, grad_out, torch.float32)
    assert "causal_linear" not in torch_out.grad_fn.name()
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    for grad, torch_grad in zip(grads, torch_grads, strict=True):
        torch.testing.assert_close(grad, torch_grad, atol=1e-5, rtol=1e-5)


def test_bf16_state_over_many_chunks_stays_close():
    # 40 chunks of 64: the running state is fp32, so the error does not grow with the length.
    inputs, _ = make_inputs(2560, batch=1, heads=1)
    ref = linear_attention_reference(*inputs, causal=True)
    out = linear_attention(*(t.bfloat16() for t in inputs), causal=True)
    assert relative_error(out[..., -64:, :], ref[..., -64:, :]) < TOLERANCE[torch.bfloat16]


def test_strided_inputs_give_the_contiguous_result():
    inputs, mask = make_inputs(70, padded=True)
    # [B, T, H, d] storage seen as [B, H, T, d], as an attention layer's head split gives.
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2).float() for t in inputs]
    assert not strided[0].is_contiguous()
    expected = linear_attention(*(t.float().contiguous() for t in inputs), mask=mask, causal=True)
    torch.testing.assert_close(linear_attention(*strided, mask=mask, causal=True), expected)


def test_causal_and_independent_of_the_total_length():
    (q, k, v), _ = make_inputs(150)
    q, k, v = q.float(), k.float(), v.float()
    full = linear_attention(q, k, v, causal=True)
    for t in (1, 63, 64, 100):
        torch.testing.assert_close(linear_attention(q[:, :, :t], k[:, :, :t], v[:, :, :t], causal=True),
                                   full[:, :, :t], atol=1e-6, rtol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 90:] += 3.0
    v2[:, :, 90:] -= 2.0
    changed = linear_attention(q, k2, v2, causal=True)
    torch.testing.assert_close(changed[:, :, :90], full[:, :, :90])
    assert not torch.allclose(changed[:, :, 90:], full[:, :, 90:])


def test_padded_keys_may_hold_nan():
    (q, k, v), mask = make_inputs(100, padded=True)
    q, k, v = q.float(), k.float(), v.float().requires_grad_()
    k, v_nan = k.masked_fill(~mask[:, None, :, None], float("nan")), v.detach().clone()
    v_nan[~mask[:, None, :, None].expand_as(v_nan)] = float("nan")
    out = linear_attention(q, k, v_nan, mask=mask, causal=True)
    clean = linear_attention(q, k.nan_to_num(0.0), v.detach().nan_to_num(0.0), mask=mask, causal=True)
    torch.testing.assert_close(out, clean)


def test_non_causal_and_other_dtypes_take_the_pytorch_path():
    (q, k, v), mask = make_inputs(50, padded=True)
    for dtype, causal in ((torch.float32, False), (torch.float64, True), (torch.float16, True)):
        args = [t.to(dtype) for t in (q, k, v)]
        with native_enabled(False):
            expected = linear_attention(*args, mask=mask, causal=causal)
        actual = linear_attention(*args, mask=mask, causal=causal)
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    assert not native_linear.supported(q.half(), k.half(), v.half())


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 2, 0, 8)])
def test_empty_inputs(shape):
    q = torch.randn(*shape, requires_grad=True)
    out = linear_attention(q, q, q, causal=True)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    (q, k, v), mask = make_inputs(37, dim=8, value_dim=12, padded=True)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    for save_states in (True, False):
        torch.library.opcheck(native_linear.causal_linear.op, (q, k, v, mask, 1e-6, save_states))
    out, den, states = native_linear.causal_linear.op(q, k, v, mask, 1e-6, True)
    grad_out = torch.randn_like(out)
    inputs = (q.detach(), k.detach(), v.detach(), mask, out.detach(), den)
    torch.library.opcheck(native_linear.causal_linear_backward.op, (*inputs, states, grad_out))
    # Without saved states the backward recomputes them: the same gradients.
    expected = native_linear.causal_linear_backward.op(*inputs, states, grad_out)
    recomputed = native_linear.causal_linear_backward.op(*inputs, states[:0].reshape(0), grad_out)
    for got, want in zip(recomputed, expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_threads_split_heads_without_changing_the_result():
    inputs, mask = make_inputs(130, batch=3, heads=3, padded=True)
    grad_out = torch.randn(3, 3, 130, 16, dtype=torch.float64)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(values_and_grads(linear_attention, inputs, mask, grad_out, torch.float32))
    finally:
        torch.set_num_threads(threads)
    (out_1, grads_1), (out_2, grads_2) = results
    torch.testing.assert_close(out_2, out_1, atol=0, rtol=0)
    for grad_2, grad_1 in zip(grads_2, grads_1, strict=True):
        torch.testing.assert_close(grad_2, grad_1, atol=0, rtol=0)
