"""The C kernels as torch.library custom ops (ops/native): `opcheck` on every op, torch.compile
keeps them in one graph (fullgraph) with eager's values and gradients, and bfloat16 inputs are
served by the kernels (not the PyTorch twins) within stated tolerances of float64 references."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from routeformer.ops import apply_rotary, route_topk, routed_attention
from routeformer.ops.expanding import expanding_attention
from routeformer.ops.native import native_kernels
from routeformer.ops.native.band import (
    band_attend_op,
    band_attention_backward_op,
    band_attention_op,
    expanding_infer_op,
)
from routeformer.ops.native.linear_rows import linear_rows_backward_op, linear_rows_op
from routeformer.ops.native.mita_train import mita_causal_query_side, mita_causal_query_side_backward
from routeformer.ops.native.rotary import rotary_op
from routeformer.ops.native.topk import route_topk_op, routed_attention_backward_op, routed_attention_op
from routeformer.ops.rotary import rotary_angles
from routeformer.ops.routed_rows import linear_attention_rows

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no C compiler here")


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _routing(length=20, heads=2, slots=4):
    index, valid, _ = route_topk(_randn(1, heads, length, 4, seed=1), _randn(1, heads, length, 4, seed=2),
                                 slots, causal=True, local_window=1)
    return index, valid


def _band_inputs(length=12, rows=2):
    horizon = torch.clamp(torch.arange(length) % 5 + 1, max=torch.arange(length) + 1).repeat(rows, 1)
    return (_randn(rows, length, 4, seed=3), _randn(rows, length, 4, seed=4), _randn(rows, length, 3, seed=5),
            -_randn(rows, length, seed=6).abs() * 0.1, horizon)


def _linear_inputs(length=12):
    positions = torch.tensor([[1, 4, 5, 9, 11]])
    valid = torch.tensor([[True, True, False, True, True]])
    phi = [_randn(*shape, seed=seed).abs() + 0.1 for seed, shape in
           enumerate([(2, 5, 4), (1, 2, length, 4)], start=7)]
    return phi[0], phi[1], _randn(1, 2, length, 3, seed=9), positions, valid


def _mita_inputs(length=20, block=4, experts=4, width=3):
    """q, k, v, landmarks, their values, expert keys/values, key_ok, assignment for a causal input of
    5 blocks (the last block's landmark is never read)."""
    q, k, v = (_randn(1, 2, length, 4, seed=seed) for seed in (20, 21, 22))
    landmark, landmark_values = _randn(1, 2, experts, 4, seed=23), _randn(1, 2, experts, 4, seed=24)
    expert_keys = _randn(1, 2, experts, width, 4, seed=25)
    expert_values = _randn(1, 2, experts, width, 4, seed=26)
    key_ok = torch.ones(1, 2, experts, width, dtype=torch.uint8)
    key_ok[:, :, 0, -1] = 0
    block_of = torch.arange(length) // block
    assignment = (block_of - 1).clamp_min(-1).repeat(1, 2, 1)  # the most recent completed block, or none
    return q, k, v, landmark, landmark_values, expert_keys, expert_values, key_ok, assignment


def _opcheck_cases():
    q, k, v = (_randn(1, 2, 20, 4, seed=seed) for seed in (10, 11, 12))
    index, valid = _routing()
    out, lse = routed_attention_op(q, k, v, index, valid, 0.5)
    band = _band_inputs()
    band_out = band_attention_op(*band, 0.5)
    phi_q, phi_k, values, positions, valid_rows = _linear_inputs()
    rows_out = linear_rows_op(phi_q, phi_k, values, positions, valid_rows, 1e-6)
    cos, sin = (t[:, 0, :, :2].contiguous() for t in rotary_angles(torch.arange(6)[None], 4))
    tile = native_kernels(torch.zeros(1)).route_topk_chunk()  # the kernel reads whole tiles of keys
    keys_t = torch.zeros(1, 2, 1, 4, tile, dtype=torch.float64)  # one zero-padded tile, transposed
    keys_t[:, :, 0, :, :8] = _randn(1, 2, 8, 4, seed=13).transpose(-1, -2)
    mita = _mita_inputs()
    mita_out, mita_lse = mita_causal_query_side(*mita, 4, 2, True, 0.5)
    return {
        "mita_causal_query_side": (mita_causal_query_side, (*mita, 4, 2, True, 0.5), True),
        "mita_causal_query_side_backward": (
            mita_causal_query_side_backward,
            (*mita, mita_out, mita_lse, torch.ones_like(mita_out), 4, 2, True, 0.5), False),
        "route_topk": (route_topk_op, (_randn(1, 2, 8, 4), keys_t, None, 2, 8, 3, True, 1, 0), False),
        "routed_attention": (routed_attention_op, (q, k, v, index, valid, 0.5), True),
        "routed_attention_backward": (routed_attention_backward_op,
                                      (q, k, v, index, valid, out, lse, torch.ones_like(out), 0.5), False),
        "band_attend": (band_attend_op, (band[0], band[1][None], band[2][None], *band[3:], None, 0.5), False),
        "band_attention": (band_attention_op, (*band, 0.5), True),
        "band_attention_backward": (band_attention_backward_op,
                                    (*band, band_out, torch.ones_like(band_out), 0.5), False),
        "expanding_infer": (expanding_infer_op, (band[0], band[1], torch.tensor([1.0, 2.0]).double(),
                                                 torch.tensor([3.0, 1.0]).double(), 2, 0.01, 4, 0.5), False),
        "linear_rows": (linear_rows_op, (phi_q, phi_k, values, positions, valid_rows, 1e-6), True),
        "linear_rows_backward": (linear_rows_backward_op, (phi_q, phi_k, values, positions, valid_rows,
                                                           rows_out, torch.ones_like(rows_out), 1e-6), False),
        "rotary": (rotary_op, (_randn(1, 2, 6, 4), cos.double(), sin.double(), None, 1.0), True),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args, differentiable = _opcheck_cases()[name]
    if differentiable:  # the autograd registration is checked with gradients flowing
        args = tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                     for a in args)
    torch.library.opcheck(op.op, args)


class _GraphRecorder:
    """A torch.compile backend (AOT autograd, as inductor traces: forward and backward graphs)
    that records which routeformer ops the graphs call and runs them as traced."""

    def __init__(self):
        self.ops = set()
        self.backend = aot_autograd(fw_compiler=self._record, bw_compiler=self._record)

    def _record(self, graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("routeformer."):
                self.ops.add(str(node.target).split(".")[1])
        return make_boxed_func(graph_module.forward)

    def __call__(self, graph_module, example_inputs):
        return self.backend(graph_module, example_inputs)


def _compiled_matches_eager(function, inputs, expected_ops):
    """function(*inputs) -> tensor: compiled with fullgraph=True it calls `expected_ops` and gives
    eager's values and gradients (float64, so equal up to summation order)."""
    torch._dynamo.reset()
    recorder = _GraphRecorder()
    compiled = torch.compile(function, backend=recorder, fullgraph=True)
    results = []
    for run in (function, compiled):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = run(*leaves)
        weights = _randn(*out.shape, seed=99)
        # Routing inputs get no gradient (a hard choice): None for both runs.
        grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
        results.append((out.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-12, rtol=1e-10)
    assert any(grad is not None for grad in results[0][1])
    for compiled_grad, eager_grad in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-12, rtol=1e-10)
    assert expected_ops <= recorder.ops, recorder.ops


def test_compiled_topk_keeps_the_kernels():
    def topk(q, k, v, route_q, route_k):
        index, valid, _ = route_topk(route_q.detach(), route_k.detach(), 4, causal=True, local_window=2)
        return routed_attention(q, k, v, index, valid)[0]

    inputs = [_randn(2, 2, 30, 8, seed=seed) for seed in range(3)]
    inputs += [_randn(2, 2, 30, 4, seed=seed) for seed in (3, 4)]
    _compiled_matches_eager(topk, inputs, {"route_topk", "routed_attention", "routed_attention_backward"})


def test_compiled_linear_rows_and_rotary_keep_the_kernels():
    positions, valid = torch.tensor([[0, 3, 4, 8, 10]]), torch.tensor([[True, True, True, False, True]])
    cos, sin = rotary_angles(torch.arange(12)[None], 4)

    def rows(q_rows, k, v):
        k = apply_rotary(k, cos.double(), sin.double())
        return linear_attention_rows(q_rows, k, v, positions, valid)[0]

    inputs = [_randn(1, 2, 5, 4, seed=1), _randn(1, 2, 12, 4, seed=2), _randn(1, 2, 12, 3, seed=3)]
    _compiled_matches_eager(rows, inputs, {"rotary", "linear_rows", "linear_rows_backward"})


def test_compiled_expanding_keeps_the_kernels():
    """The inference steps' counts are read back as ints (FLOP statistics): not fullgraph, but the
    custom ops stay in the graphs."""
    alpha, beta = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 1.0], dtype=torch.float64)
    torch._dynamo.reset()
    recorder = _GraphRecorder()
    function = lambda q, k, v: expanding_attention(q, k, v, alpha, beta).out  # noqa: E731
    compiled = torch.compile(function, backend=recorder)
    q, k, v = (_randn(1, 2, 40, 4, seed=seed).requires_grad_() for seed in range(3))
    out, expected = compiled(q, k, v), function(q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-10)
    assert {"expanding_infer", "band_attention", "band_attention_backward"} <= recorder.ops, recorder.ops


def test_route_topk_refuses_tiles_the_kernel_would_read_past():
    # a tile narrower than the kernel's was read out of bounds (found by opcheck's clones)
    narrow = _randn(1, 2, 4, 8).view(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="tiles of"):
        route_topk_op(_randn(1, 2, 8, 4), narrow, None, 2, 8, 3, True, 1, 0)
