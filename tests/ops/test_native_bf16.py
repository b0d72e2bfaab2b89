"""bfloat16 on the C kernels: bf16 inputs are served by the kernels (computed in fp32, results
rounded to bf16), not by the PyTorch twins, and land within stated tolerances of float64
references computed from the same (bf16-representable) values.

Tolerances: the outputs are rounded to bf16 (8 significant bits, relative step 2^-8 ≈ 0.4%), so
values of magnitude <= ~3 are compared with atol = rtol = 2e-2; everything else is fp32 arithmetic.
"""

import pytest
import torch

from routeformer.ops import (
    apply_rotary,
    route_topk,
    route_topk_reference,
    routed_attention,
    routed_attention_reference,
)
from routeformer.ops.expanding import expanding_attention, expanding_attention_reference
from routeformer.ops.native import band, linear_rows, native_kernels, rotary, topk
from routeformer.ops.rotary import apply_rotary_reference, rotary_angles
from routeformer.ops.routed_rows import (
    linear_attention_rows,
    linear_attention_rows_reference,
    local_attention_rows,
    local_attention_rows_reference,
    select_rows,
)
from routeformer.ops.topk import slot_membership

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")
TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel calls of each native module (proves the bf16 call did not take the twin)."""
    calls = {}
    for module in (topk, band, linear_rows, rotary):
        def counted(*args, module=module, original=module.kernel):
            name = module.__name__.rsplit(".", 1)[-1]
            calls[name] = calls.get(name, 0) + 1
            return original(*args)
        monkeypatch.setattr(module, "kernel", counted)
    return calls


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _grads(function, inputs, weights):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = function(*leaves)
    return out, torch.autograd.grad((out * weights.to(out.dtype)).sum(), leaves)


def _assert_matches(out, grads, expected, expected_grads):
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad, **TOLERANCE)


@pytest.mark.parametrize("dim", [16, 21])  # 21: the vector loops' scalar tails (8- and 16-lane)
def test_topk_routing_and_attention_in_bf16(kernel_calls, dim):
    route_q, route_k = _bf16(2, 2, 50, 8, seed=0), _bf16(2, 2, 50, 8, seed=1)
    index, valid, _ = route_topk(route_q, route_k, 6, causal=True, local_window=2)
    # The kernel scores the bf16 values in fp32: the reference's fp32 selection, exactly.
    expected_set = route_topk_reference(route_q.float(), route_k.float(), 6, causal=True, local_window=2)
    assert torch.equal(slot_membership(index, valid, 50), expected_set)
    q, k, v = (_bf16(2, 2, 50, dim, seed=seed) for seed in (2, 3, 4))
    weights = _bf16(2, 2, 50, dim, seed=5)
    out, grads = _grads(lambda q, k, v: routed_attention(q, k, v, index, valid)[0], (q, k, v), weights)
    expected, expected_grads = _grads(lambda q, k, v: routed_attention_reference(q, k, v, index, valid),
                                      (q.double(), k.double(), v.double()), weights.double())
    _assert_matches(out, grads, expected, expected_grads)
    assert kernel_calls["topk"] == 3  # routing, forward, backward


def test_linear_and_local_rows_in_bf16(kernel_calls):
    q, k, v = (_bf16(2, 2, 40, 8, seed=seed) for seed in (6, 7, 8))
    rows, valid = select_rows(torch.rand(2, 40, generator=torch.Generator().manual_seed(9)) < 0.4)
    q_rows = q[:, :, : rows.shape[1]]
    weights = _bf16(2, 2, rows.shape[1], 8, seed=10)
    out, grads = _grads(lambda q, k, v: linear_attention_rows(q, k, v, rows, valid)[0], (q_rows, k, v),
                        weights)
    expected, expected_grads = _grads(lambda q, k, v: linear_attention_rows_reference(q, k, v, rows, valid),
                                      (q_rows.double(), k.double(), v.double()), weights.double())
    _assert_matches(out, grads, expected, expected_grads)
    assert kernel_calls["linear_rows"] == 2
    with torch.no_grad():  # the banded pass serves inference
        local, _ = local_attention_rows(q_rows, k, v, rows, valid, window=6)
    expected = local_attention_rows_reference(q_rows.double(), k.double(), v.double(), rows, valid, window=6)
    assert local.dtype == torch.bfloat16 and kernel_calls["band"] == 1
    torch.testing.assert_close(local.double() * valid[:, None, :, None], expected, **TOLERANCE)


def test_rotary_in_bf16(kernel_calls):
    x = _bf16(2, 3, 17, 8, seed=11)
    cos, sin = rotary_angles(torch.arange(17)[None].expand(2, -1), 8)
    weights = _bf16(2, 3, 17, 8, seed=12)
    out, grads = _grads(lambda x: apply_rotary(x, cos, sin), (x,), weights)
    expected, expected_grads = _grads(lambda x: apply_rotary_reference(x, cos.double(), sin.double()),
                                      (x.double(),), weights.double())
    _assert_matches(out, grads, expected, expected_grads)
    assert kernel_calls["rotary"] == 2


def test_expanding_in_bf16(kernel_calls):
    """The horizons are integers found by thresholds: bf16 inputs are the same numbers in fp32 and
    fp64, so the horizons agree unless a threshold falls between fp32 and fp64 rounding (checked)."""
    q, k, v = (_bf16(1, 2, 48, 8, seed=seed) for seed in (13, 14, 15))
    alpha, beta = torch.tensor([1.0, 3.0]), torch.tensor([5.0, 2.0])
    weights = _bf16(1, 2, 48, 8, seed=16)
    result = {}

    def native(q, k, v):
        result["native"] = expanding_attention(q, k, v, alpha, beta)
        return result["native"].out

    def reference(q, k, v):
        out, result["horizon"], _ = expanding_attention_reference(q, k, v, alpha.double(), beta.double())
        return out

    out, grads = _grads(native, (q, k, v), weights)
    expected, expected_grads = _grads(reference, (q.double(), k.double(), v.double()), weights.double())
    assert torch.equal(result["native"].horizon, result["horizon"])
    _assert_matches(out, grads, expected, expected_grads)
    assert kernel_calls["band"] == 3  # inference steps, final pass, its backward
