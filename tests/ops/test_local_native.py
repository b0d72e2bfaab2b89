"""The C sliding-window kernel (ops/native/local.py, local_kernels.c) behind `local_attention`:
values and gradients against the fp64 reference, bf16 against fp64 with stated tolerances,
masks, odd lengths, windows beyond the sequence, causality, opcheck and the fallback path."""

import pytest
import torch

import routeformer.ops.local.op as local_module
from routeformer.ops.local import local_attention, local_attention_reference
from routeformer.ops.native import native_enabled, native_kernels

if native_kernels(torch.zeros(1)) is None:
    pytest.skip("the native kernels are unavailable here", allow_module_level=True)

from routeformer.ops.native.local import (  # noqa: E402 - needs the library
    local_attend_backward_op,
    local_attend_op,
    local_kernel_available,
)

if not local_kernel_available():
    pytest.skip("the library was built without local_kernels.c", allow_module_level=True)


def _inputs(batch, heads, length, dim, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) for _ in range(3))
    mask = torch.rand(batch, length, generator=generator) > 0.3
    return q, k, v, mask


def _value_and_grads(function, q, k, v, grad, dtype, **options):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = function(*leaves, **options)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [leaf.grad.double() for leaf in leaves]


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls of the native path, so a test fails if the kernel silently is not used."""
    calls = []
    original = local_module._local_native
    monkeypatch.setattr(local_module, "_local_native", lambda *a: calls.append(1) or original(*a))
    return calls


CASES = [  # (length, window, dim): odd lengths, window 1, window >= T, a window not a multiple of 6,
    # head dims over several 64-column tiles (80, 130) and odd ones
    (37, 5, 16), (100, 16, 8), (203, 64, 64), (50, 100, 16), (1, 3, 8), (130, 7, 24), (64, 1, 80),
    (45, 9, 130), (29, 4, 7),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("length,window,dim", CASES)
def test_fp32_matches_fp64_reference(length, window, dim, causal, masked, native_calls):
    q, k, v, mask = _inputs(2, 3, length, dim, seed=length + window)
    mask = mask if masked else None
    grad = torch.randn(2, 3, length, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    options = dict(window=window, mask=mask, causal=causal)
    got = _value_and_grads(local_attention, q, k, v, grad, torch.float32, **options)
    want = _value_and_grads(local_attention_reference, q, k, v, grad, torch.float64, **options)
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert native_calls


@pytest.mark.parametrize("causal,dim,length,window", [
    (True, 32, 150, 40), (False, 32, 150, 40), (False, 16, 97, 7), (True, 16, 97, 7), (True, 15, 150, 40),
])
def test_bf16_within_stated_tolerance_of_fp64(causal, dim, length, window, native_calls):
    """bf16 storage, fp32 sums: the error is the rounding to bf16 (relative 2^-9 ≈ 0.002) of the
    results, of the stored output the backward reads and (even d: bf16 pair products) of the
    softmax weights and of dS before their products — each summed over the window. Stated bound,
    against the fp64 reference on the same (bf16-rounded) inputs: max |error| <= 1% of the
    tensor's largest entry + 1e-3 (measured over 36 seeded cases up to T=600, w=256: <= 0.75%;
    the blockwise PyTorch path in bf16 errs up to ~0.8%). An odd d takes the float32-product path."""
    q, k, v, mask = _inputs(2, 2, length, dim, seed=3)
    q, k, v = (t.bfloat16().double() for t in (q, k, v))
    grad = torch.randn(2, 2, length, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grad = grad.bfloat16().double()
    options = dict(window=window, mask=mask, causal=causal)
    got = _value_and_grads(local_attention, q, k, v, grad, torch.bfloat16, **options)
    want = _value_and_grads(local_attention_reference, q, k, v, grad, torch.float64, **options)
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, want, strict=True):
        error, bound = (a - b).abs().max().item(), 1e-2 * b.abs().max().item() + 1e-3
        assert error <= bound, (name, error, bound)
    assert len(native_calls) == 1


def test_float16_is_computed_in_float32(native_calls):
    q, k, v, mask = _inputs(1, 2, 40, 16, seed=4)
    out = local_attention(q.half(), k.half(), v.half(), window=9, mask=mask, causal=True)
    want = local_attention_reference(q, k, v, window=9, mask=mask, causal=True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=3e-3)
    assert native_calls


def test_padded_keys_may_hold_nan_and_rows_without_keys_are_zero():
    q, k, v, mask = _inputs(2, 2, 30, 8, seed=5)
    mask[1] = False  # batch 1: no key at all
    padded = ~mask[:, None, :, None]
    k, v = k.masked_fill(padded, float("nan")), v.masked_fill(padded, float("nan"))
    for causal in (True, False):
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        out = local_attention(*leaves, window=6, mask=mask, causal=causal)
        out.sum().backward()
        clean = [t.masked_fill(~mask[:, None, :, None], 0.0) for t in (k, v)]
        want = local_attention_reference(q, *clean, window=6, mask=mask, causal=causal)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)
        assert torch.equal(leaves[2].grad[1], torch.zeros_like(leaves[2].grad[1]))


def test_causal_outputs_do_not_depend_on_later_tokens_or_the_length():
    q, k, v, _ = _inputs(1, 2, 90, 16, seed=6, dtype=torch.float32)
    full = local_attention(q, k, v, window=20, causal=True)
    prefix = local_attention(q[:, :, :41], k[:, :, :41], v[:, :, :41], window=20, causal=True)
    torch.testing.assert_close(prefix, full[:, :, :41], atol=0, rtol=0)


def test_non_contiguous_inputs_and_the_fallback_path_agree():
    q, k, v, mask = _inputs(2, 3, 64, 16, seed=7, dtype=torch.float32)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous
    native = local_attention(q_t, k, v, window=12, mask=mask, causal=False)
    with native_enabled(False):
        fallback = local_attention(q, k, v, window=12, mask=mask, causal=False)
    torch.testing.assert_close(native, fallback, atol=1e-5, rtol=1e-5)


def test_explicit_block_and_float64_take_the_pytorch_path(native_calls):
    q, k, v, _ = _inputs(1, 1, 20, 8, seed=8)
    local_attention(q, k, v, window=4, causal=True)
    local_attention(q.float(), k.float(), v.float(), window=4, causal=True, block=8)
    assert not native_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    q, k, v, mask = _inputs(1, 2, 20, 8, seed=9, dtype=dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous: results stay contiguous
    args = (q, k, v, mask, 4, 3, 0.5)
    torch.library.opcheck(local_attend_op.op, tuple(t.requires_grad_() if torch.is_tensor(t) and
                                                    t.is_floating_point() else t for t in args))
    out, lse = local_attend_op(q.detach(), k.detach(), v.detach(), mask, 4, 3, 0.5)
    q, k, v = (t.detach() for t in (q, k, v))
    backward_args = (q, k, v, mask, out, lse, torch.ones_like(out), 4, 3, 0.5)
    torch.library.opcheck(local_attend_backward_op.op, backward_args)


def test_native_flops_closed_form_counts_every_block():
    """The executed-FLOPs formula of the kernel against a loop over its query blocks."""
    from routeformer.ops.flops import dense_attention_flops
    from routeformer.ops.local.op import NATIVE_ROWS, _native_flops

    def by_blocks(length, window, causal):
        before, after = (window - 1, 0) if causal else (window, window)
        pairs = 0
        for start in range(0, length, NATIVE_ROWS):
            rows = min(NATIVE_ROWS, length - start)
            pairs += rows * (min(length, start + rows + after) - max(0, start - before))
        return dense_attention_flops(pairs, 8)

    for length in [*range(0, 30), 257, 1000]:
        for window in (1, 5, 6, 7, 13, 256, 5000):
            for causal in (True, False):
                assert _native_flops(length, 8, window, causal) == by_blocks(length, window, causal)


def test_threads_split_rows_without_changing_results():
    q, k, v, mask = _inputs(2, 3, 70, 16, seed=10, dtype=torch.float32)
    leaves = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
    previous = torch.get_num_threads()
    results = []
    try:
        for threads, inputs in zip((1, 2), leaves, strict=True):
            torch.set_num_threads(threads)
            out = local_attention(*inputs, window=9, mask=mask, causal=True)
            out.sum().backward()
            results.append([out.detach()] + [t.grad for t in inputs])
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)
