"""The dispatch: CPU tensors keep their paths, forced (or CUDA) tensors take the Triton kernels,
with the op's contract; importing the package never needs triton."""

import subprocess
import sys

import pytest
import torch

from routeformer.ops import backends, mita_attention, route_topk, routed_attention
from routeformer.ops.backends import force_triton
from routeformer.ops.backends import triton_serves as use_triton
from routeformer.ops.expanding import expanding_attention
from routeformer.ops.native import native_enabled
from routeformer.ops.routed_rows import (
    full_attention_rows,
    full_attention_rows_reference,
    local_attention_rows,
    local_attention_rows_reference,
    select_rows,
)
from routeformer.ops.topk import (
    append_routing_keys,
    route_cached,
    route_topk_reference,
    routed_attention_reference,
)
from tests.ops.triton._checks import assert_same_gradients
from tests.ops.triton.test_triton_gathered import make_qkv, random_routing
from tests.ops.triton.test_triton_topk_routing import integer_routing, selected_set


def test_cpu_tensors_stay_on_their_paths_unless_forced(monkeypatch):
    cpu = torch.zeros(1)
    assert not use_triton(cpu)
    with force_triton():
        assert use_triton(cpu)
        with force_triton(False):
            assert not use_triton(cpu)
        assert not use_triton(cpu.double())  # the kernels compute fp32/bf16/fp16
        monkeypatch.setenv("ROUTEFORMER_TRITON", "0")
        assert not use_triton(cpu)


def test_without_triton_nothing_breaks(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    with force_triton():
        assert not use_triton(torch.zeros(1))
    # A fresh interpreter with triton blocked imports routeformer and runs a routed op.
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch, routeformer, routeformer.ops, routeformer.ops.backends\n"
              "from routeformer.ops import route_topk\n"
              "print(route_topk(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), 2)[1].sum().item())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dispatch_functions_keep_the_ops_contracts(device):
    batch, heads, length, dim = 1, 2, 17, 8
    index, valid = random_routing(batch, heads, length, 4, causal=True)
    q, k, v = make_qkv(batch, heads, length, dim, dim, dtype=torch.bfloat16, device=device)
    with force_triton():  # the op's Triton branch, whatever the device
        out, lse = routed_attention(q, k, v, index.to(device), valid.to(device), scale=dim ** -0.5)
    assert out.dtype == lse.dtype == torch.bfloat16 and lse.shape == (batch, heads, length)
    # The reference on the CPU (the routing tensors live there): on CUDA it was handed CUDA q/k/v
    # and CPU index/valid, which failed on the lent H100.
    want = routed_attention_reference(*(t.detach().float().cpu() for t in (q, k, v)), index, valid)
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
    route_q, route_k = integer_routing(batch, 1, length, 3, seed=5)
    with force_triton():
        index, valid, scored = route_topk(route_q.to(device), route_k.to(device), 3, causal=True,
                                          key_mask=None, local_window=1, global_tokens=1)
    want = route_topk_reference(route_q, route_k, 3, causal=True, local_window=1, global_tokens=1)
    assert torch.equal(selected_set(index, valid, length), want) and scored > 0


@pytest.mark.parametrize("causal,route,shared,padded",
                         [(True, 2, True, False), (False, 2, True, False), (False, 1, True, True),
                          (False, 1, False, False)])
def test_mita_through_the_hooks_equals_the_cpu_op(causal, route, shared, padded):
    """force_triton() sends routed_parts, merge_partials and (R = 1) fused_single_route inside
    mita_attention to the kernels: outputs and gradients equal the CPU op's (what CUDA tensors get,
    checked on CPU)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=generator).requires_grad_() for _ in range(3))
    mask = None
    if padded:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[1, 30:] = False
    options = dict(landmarks=4, topk=3, route=route, shared=shared, causal=causal, mask=mask,
                   block=8 if causal else None)
    want = mita_attention(q, k, v, **options)
    with force_triton():
        got = mita_attention(q, k, v, **options)
    real = 1.0 if mask is None else mask[:, None, :, None].float()  # padded rows may hold anything
    torch.testing.assert_close(got.out * real, want.out * real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.expert_load, want.expert_load)
    weight = torch.randn(want.out.shape, generator=generator) * real
    assert_same_gradients(got.out, want.out, weight, (q, k, v))


def test_topk_ops_through_the_hooks_equal_the_cpu_ops():
    generator = torch.Generator().manual_seed(1)
    route_q, route_k = (torch.randn(2, 1, 33, 4, generator=generator) for _ in range(2))
    want = route_topk(route_q, route_k, 5, causal=True, local_window=2)
    q, k, v = make_qkv(2, 2, 33, 8, 8)
    with force_triton():
        index, valid, scored = route_topk(route_q, route_k, 5, causal=True, local_window=2)
        got, _ = routed_attention(q, k, v, index.expand(-1, 2, -1, -1), valid.expand(-1, 2, -1, -1))
    assert torch.equal(selected_set(index, valid, 33), selected_set(want[0], want[1], 33))
    assert got.grad_fn is not None and "Triton" in type(got.grad_fn).__name__
    expected, _ = routed_attention(q, k, v, index.expand(-1, 2, -1, -1), valid.expand(-1, 2, -1, -1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["full", "local"])
def test_routed_rows_through_the_hooks_match_the_references(kind):
    """meta's hard-routed rows, causal and unpadded: the banded kernel, values and gradients."""
    generator = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 2, 30, 8, generator=generator).requires_grad_() for _ in range(2))
    route = torch.rand(2, 30, generator=generator) < 0.4
    rows, valid = select_rows(route)
    q_rows = torch.randn(2, 2, rows.shape[1], 8, generator=generator).requires_grad_()
    if kind == "full":
        op, reference, options = full_attention_rows, full_attention_rows_reference, {}
    else:
        op, reference, options = local_attention_rows, local_attention_rows_reference, {"window": 5}
    with force_triton():
        got, flops = op(q_rows, k, v, rows, valid, **options)
    want = reference(q_rows, k, v, rows, valid, **options) * valid[:, None, :, None]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert flops > 0
    weight = torch.randn(want.shape, generator=generator)
    assert_same_gradients(got, want, weight, (q_rows, k, v))


def test_expanding_final_pass_through_the_hook_equals_the_band_path():
    """Causal, unpadded expanding attention on the band path (the C kernels off, as on CUDA): the
    Triton final pass gives the band path's output and gradients, α and β included."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 45, 8, generator=generator).requires_grad_() for _ in range(3))
    alpha = torch.tensor([1.0, 2.0], requires_grad=True)
    beta = torch.tensor([3.0, 8.0], requires_grad=True)
    with native_enabled(False):
        want = expanding_attention(q, k, v, alpha, beta, block=16)
        with force_triton():
            got = expanding_attention(q, k, v, alpha, beta, block=16)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.horizon, want.horizon)
    weight = torch.randn(want.out.shape, generator=generator)
    leaves = (q, k, v, alpha, beta)
    assert_same_gradients(got.out, want.out, weight, leaves)


def test_cached_decode_steps_take_the_split_key_kernel_and_select_the_parallel_rows(monkeypatch):
    """ops.topk.decode on the plain key cache (what CUDA gets; forced here) routes decode-shaped
    steps — from DECODE_SPLIT_MIN_KEYS keys, lowered so the interpreter is quick — on the split-key
    kernel, records it as "route_topk_decode", and still selects the parallel causal rows (ties
    included: integer routing vectors)."""
    monkeypatch.setattr(backends, "DECODE_SPLIT_MIN_KEYS", 12)
    route_q, route_k = integer_routing(1, 2, 24, 3, seed=8)
    options = dict(local_window=2, global_tokens=1)
    want = route_topk_reference(route_q, route_k, 3, causal=True, **options)
    with force_triton(), native_enabled(False), backends.recording() as ran:
        cache, rows = {}, []
        append_routing_keys(cache, route_k[:, :, :16])
        for i in range(16, 24):  # each step caches its own routing key, then routes
            append_routing_keys(cache, route_k[:, :, i:i + 1])
            rows.append(selected_set(*route_cached(route_q[:, :, i:i + 1], cache, i, 3, **options), 24))
    assert not cache["routing_tiled"]
    assert ran.get("route_topk_decode") == "triton", ran
    assert torch.equal(torch.cat(rows, dim=2), want[:, :, 16:])
