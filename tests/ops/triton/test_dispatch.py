"""The dispatch: CPU tensors keep their paths, forced (or CUDA) tensors take the Triton kernels,
with the op's contract; importing the package never needs triton."""

import subprocess
import sys

import torch

from routeformer.ops.gathered import routed_attention_reference
from routeformer.ops.topk_routing import route_topk_reference
from routeformer.ops.triton import dispatch
from routeformer.ops.triton.dispatch import force_triton, use_triton
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
              "import torch, routeformer, routeformer.ops, routeformer.ops.triton.dispatch\n"
              "from routeformer.ops import route_topk\n"
              "print(route_topk(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), 2)[1].sum().item())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dispatch_functions_keep_the_ops_contracts(device):
    batch, heads, length, dim = 1, 2, 17, 8
    index, valid = random_routing(batch, heads, length, 4, causal=True)
    q, k, v = make_qkv(batch, heads, length, dim, dim, dtype=torch.bfloat16, device=device)
    out, lse = dispatch.routed_attention(q, k, v, index.to(device), valid.to(device), dim ** -0.5)
    assert out.dtype == lse.dtype == torch.bfloat16 and lse.shape == (batch, heads, length)
    want = routed_attention_reference(*(t.detach().float() for t in (q, k, v)), index, valid)
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
    route_q, route_k = integer_routing(batch, 1, length, 3, seed=5)
    index, valid, scored = dispatch.route_topk(route_q.to(device), route_k.to(device), 3, causal=True,
                                               key_mask=None, local_window=1, global_tokens=1)
    want = route_topk_reference(route_q, route_k, 3, causal=True, local_window=1, global_tokens=1)
    assert torch.equal(selected_set(index, valid, length), want) and scored > 0
