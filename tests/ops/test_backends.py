"""The dispatch (ops/backends.py): forcing each backend this machine has makes every op that has
a kernel for it run it, the layer reports the backend that ran, and the values equal the PyTorch
backend's; forcing a backend the machine lacks says what is missing."""

import sys

import pytest
import torch

from routeformer.attention import build_attention, list_attentions
from routeformer.ops import backends, native
from routeformer.ops.backends import BackendUnavailable, force_backend, recording
from routeformer.ops.native import native_kernels
from routeformer.ops.triton import triton_available

DIM, HEADS, LENGTH = 16, 2, 40
# Mechanisms whose ops have C kernels that serve a causal fp32 layer at this size (local's needs
# AVX-512, so it is checked only where it built; topk routes, not its dense path, at dense_below=0).
HAS_NATIVE = {"expanding", "linear", "meta", "topk"}
needs_native = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no native kernels here")


def run_layer(name: str, backend: str | None, grad: bool = True, causal: bool = True):
    """(output, the layer's result) of mechanism `name` on one fixed input, under `backend`."""
    torch.manual_seed(0)
    options = {"dense_below": 0, "topk": 8} if name == "topk" else {}
    layer = build_attention(name, dim=DIM, heads=HEADS, causal=causal, **options).eval()
    x = torch.randn(1, LENGTH, DIM, generator=torch.Generator().manual_seed(1))
    reads_meta = getattr(layer, "reads_meta_mask", False)
    extra = {"meta_mask": torch.arange(LENGTH)[None] % 5 == 0} if reads_meta else {}
    with torch.set_grad_enabled(grad), (force_backend(backend) if backend else recording()):
        result = layer(x.requires_grad_(grad), **extra)
    return result.out.detach(), result


@pytest.mark.parametrize("name", list(list_attentions()))
def test_forced_torch_runs_every_op_in_pytorch(name):
    _, result = run_layer(name, "torch")
    assert result.backend == "torch"
    assert set(result.backends.values()) <= {"torch"}, result.backends


@needs_native
@pytest.mark.parametrize("name", sorted(HAS_NATIVE))
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_forced_native_is_reported_and_equals_torch(name, grad):
    out, result = run_layer(name, "native", grad)
    assert "native" in result.backend.split("+"), result.backends
    assert set(result.backends.values()) <= {"native", "torch", "native+torch"}
    want, _ = run_layer(name, "torch", grad)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-4)


@needs_native
def test_default_cpu_dispatch_reports_native_for_the_routed_ops():
    _, result = run_layer("topk", None)
    assert result.backends["route_topk"] == result.backends["routed_attention"] == "native"
    assert result.backend == "native"


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("name", ["topk", "mita"])
def test_forced_triton_is_reported_and_equals_torch(name):
    """On CPU tensors the kernels run in Triton's interpreter (ops/triton/_common.py). MiTA
    bidirectional: causal MiTA at this length is one block, attended densely."""
    causal = name != "mita"
    out, result = run_layer(name, "triton", causal=causal)
    assert "triton" in result.backend.split("+"), result.backends
    expected = {"topk": {"route_topk", "routed_attention"}, "mita": {"mita_fused_single_route"}}
    assert {op for op, ran in result.backends.items() if ran == "triton"} >= expected[name]
    want, _ = run_layer(name, "torch", causal=causal)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-3)


def test_a_pure_pytorch_mechanism_reports_torch():
    _, result = run_layer("full", None)
    assert result.backend == "torch"


def test_unknown_backend_is_a_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="backend must be one of triton, native, torch; got 'cuda'"):
        with force_backend("cuda"):
            pass


def test_forcing_triton_without_triton_says_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    with pytest.raises(BackendUnavailable, match="triton package is not installed"):
        with force_backend("triton"):
            pass


def test_forcing_native_without_a_build_says_why(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(native.build, "_WHY_NOT", {"reason": "no C compiler found"})
    with pytest.raises(BackendUnavailable, match="native C kernels did not build: no C compiler found"):
        with force_backend("native"):
            pass


def test_forced_backend_overrides_the_switches_and_is_restored(monkeypatch):
    monkeypatch.setenv("ROUTEFORMER_NATIVE", "0")
    assert native_kernels(torch.zeros(1)) is None
    if backends.native_kernels_built():
        with force_backend("native"):
            assert native_kernels(torch.zeros(1)) is not None
    monkeypatch.delenv("ROUTEFORMER_NATIVE")
    with force_backend("torch"):
        assert native_kernels(torch.zeros(1)) is None and not backends.triton_serves(torch.zeros(1))
    assert (native_kernels(torch.zeros(1)) is None) == (not backends.native_kernels_built())


def test_recording_nests_and_joins_backends():
    with recording() as outer:
        backends.chosen("op", "native", "")
        with recording() as inner:
            backends.chosen("op", "torch", "")
        assert inner == {"op": "torch"}
    assert outer == {"op": "native+torch"}
    assert backends.joined("torch", "triton", "native+torch") == "triton+native+torch"


def test_topk_dense_threshold_is_the_dispatch_table():
    q = torch.zeros(1, 1, 4, 8)
    want = backends.TOPK_DENSE_BELOW["native" if native_kernels(q) is not None else "torch"]
    assert backends.topk_dense_below(q, q, q) == want
    with force_backend("torch"):
        assert backends.topk_dense_below(q, q, q) == 1024
