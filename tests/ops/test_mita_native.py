"""MiTA's inference kernels (ops/native/mita.py, native/mita_kernels.c) against their PyTorch twins:
the routed step (R = 1) against `fused_single_route`, the streaming top-K against torch.topk, the
key-blocked landmark forward against `landmark_attention_reference` (values, key sets, gradients),
the whole op under no_grad against `mita_reference`; and bf16 memory linear in N."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from routeformer.ops.mita import (
    landmark_attention,
    landmark_attention_reference,
    mita_attention,
    mita_reference,
)
from routeformer.ops.mita import landmarks as mita_landmarks
from routeformer.ops.mita.experts import fused_single_route
from routeformer.ops.native import native_enabled, native_kernels
from routeformer.ops.native.mita import StreamingTopK, route_by_maximum, single_route

pytestmark = pytest.mark.skipif(native_kernels(torch.zeros(1)) is None, reason="no native kernels")


def _routing_case(experts, width, dim, length, dtype, masked, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    batch, heads = 2, 2
    q, landmark, landmark_values = randn(batch, heads, length, dim), randn(batch, heads, experts, dim), \
        randn(batch, heads, experts, dim)
    keys, values = randn(batch, heads, experts, width, dim), randn(batch, heads, experts, width, dim)
    landmark_ok = expert_valid = None
    slot_valid = torch.ones(batch, heads, length, dtype=torch.bool)
    if masked:
        landmark_ok = torch.rand(batch, experts, generator=gen) > 0.3
        expert_valid = torch.rand(batch, heads, experts, width, generator=gen) > 0.3
        slot_valid = torch.rand(batch, heads, length, generator=gen) > 0.2
    assignment = torch.randint(0, experts, (batch, heads, length), generator=gen)
    if landmark_ok is not None:  # routed experts are eligible ones, as the op guarantees
        assignment = torch.where(landmark_ok[:, None, None, :].expand(-1, heads, length, -1)
                                 .gather(-1, assignment[..., None])[..., 0], assignment, 0)
        landmark_ok[:, 0] = True
    return q, landmark, landmark_values, landmark_ok, keys, values, expert_valid, assignment, slot_valid


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("sizes", "dtype"), [((5, 3, 8, 37), torch.float64),  # the generic loop
                                              ((64, 64, 64, 300), torch.float32)])  # the AVX-512 tiles
def test_routed_step_matches_its_pytorch_twin(sizes, dtype, masked, shared):
    experts, width, dim, length = sizes
    q, landmark, landmark_values, landmark_ok, keys, values, expert_valid, assignment, slot_valid = \
        _routing_case(experts, width, dim, length, dtype, masked)
    scale = dim ** -0.5
    logits = q @ (landmark * scale).transpose(-1, -2)
    native = single_route(q, logits if shared else None, landmark_values, landmark_ok, keys, values,
                          expert_valid, assignment, slot_valid, scale)
    assert native is not None
    twin, _, counts = fused_single_route(q, landmark, landmark_values, landmark_ok, keys, values,
                                         expert_valid, assignment[..., None], slot_valid[..., None],
                                         shared, scale, pack=4)
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(native[0], twin, **tolerance)
    torch.testing.assert_close(native[1], counts)


def test_routed_step_declines_when_a_gradient_is_wanted():
    case = list(_routing_case(5, 3, 8, 10, torch.float64, False))
    case[0].requires_grad_()
    logits = case[0] @ case[1].transpose(-1, -2)
    assert single_route(case[0], logits, *case[2:], 0.5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_route_by_maximum_matches_torch_max(dtype):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 50, 7, generator=gen, dtype=dtype)
    logits[0, 0, 0] = 1.0  # a tie: the first maximum wins
    logits[1, 2, 3] = torch.tensor([-1e30] * 7, dtype=dtype)  # every landmark masked
    values, indices = route_by_maximum(logits)
    expected = logits.max(dim=-1, keepdim=True)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(indices, expected.indices) and int(indices[0, 0, 0]) == 0
    assert route_by_maximum(logits.requires_grad_()) is None  # a gradient wanted: PyTorch's max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_streaming_top_k_matches_torch_topk(dtype):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 7, 100, generator=gen, dtype=dtype)  # [B, H, E, N], distinct values
    selector = StreamingTopK.make(scores, 6, 7, 9)
    for lo in range(0, 100, 23):  # blocks of transposed scores, the last one short
        selector.update(scores[..., lo:lo + 23].transpose(-1, -2), lo)
    torch.testing.assert_close(selector.indices((2, 3, 7)), scores.topk(9, dim=-1).indices)


@pytest.mark.parametrize("native", [True, False])
def test_key_blocked_landmark_forward_matches_its_reference(monkeypatch, native):
    """Every landmark reads every key (the bidirectional build without padding): the key-blocked
    online softmax, with the streaming top-K or torch.topk, and the chunked backward."""
    monkeypatch.setattr(mita_landmarks, "_KEY_BLOCK", 7)  # several blocks, the last one short
    gen = torch.Generator().manual_seed(2)
    landmark = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 20, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    limit = torch.full((2, 6), 20)
    with native_enabled(native):
        fast = landmark_attention(landmark, k, v, limit, topk=5, scale=0.3)
    slow = landmark_attention_reference(landmark, k, v, limit, topk=5, scale=0.3)
    torch.testing.assert_close(fast[0], slow[0])
    assert torch.equal(fast[1], slow[1]) and bool(fast[2].all())
    weight = torch.randn_like(slow[0])
    for a, b in zip(torch.autograd.grad((fast[0] * weight).sum(), (landmark, k, v)),
                    torch.autograd.grad((slow[0] * weight).sum(), (landmark, k, v)), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("extra_tokens", [0, 1])
def test_inference_at_kernel_sizes_matches_the_reference(padded, extra_tokens):
    """m = k = d = 64, fp32, no gradient: pooling by equal windows, the key-blocked landmark stage,
    the streaming top-K and the AVX-512 routed step, against the dense specification."""
    length = 64 * 5 + extra_tokens
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, length, 64, generator=gen) for _ in range(3))
    mask = None
    if padded:
        mask = torch.ones(1, length, dtype=torch.bool)
        mask[0, -40:] = False
    options = {"landmarks": 64, "topk": 64, "extra_tokens": extra_tokens, "mask": mask}
    with torch.no_grad():
        fast = mita_attention(q, k, v, **options).out
        with native_enabled(False):
            twin = mita_attention(q, k, v, **options).out
    slow = mita_reference(q.double(), k.double(), v.double(), **options).float()
    real = slice(None) if mask is None else mask[0]
    torch.testing.assert_close(fast[:, :, real], slow[:, :, real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast[:, :, real], twin[:, :, real], atol=2e-5, rtol=1e-4)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any op output had."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_memory_is_linear_in_length(monkeypatch, causal):
    """bf16 runs the blocked fp32 path, not a dense fallback: the largest tensor any op makes grows
    linearly with N (a dense or N²/m fallback would grow 4x or more per doubling at these sizes).
    The causal landmark stage scores N²/b pairs in chunks of `_CHUNK_ELEMENTS`: made small here so
    that the chunk bound, not the default 4M-element chunk, shows at these lengths."""
    monkeypatch.setattr(mita_landmarks, "_CHUNK_ELEMENTS", 1 << 14)
    largest = {}
    for length in (1024, 2048, 4096):
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, 2, length, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3))
        with _LargestTensor() as probe:
            result = mita_attention(q, k, v, landmarks=8, topk=8, causal=causal, block=16 if causal else None)
            result.out.float().sum().backward()
        largest[length] = probe.largest
    assert largest[4096] <= 2.2 * largest[2048] <= 4.9 * largest[1024]
    assert largest[4096] <= 2 * 16 * 4096 * 8  # a few [B, H, N, d]-sized tensors at most


def test_forward_bench_runs_at_toy_size(tmp_path):
    """`python -m routeformer.bench.mita_bench` end to end at a toy length (one record, a table)."""
    from routeformer.bench.mita_bench import bench_mita_forward, main

    records = bench_mita_forward([256], landmarks=8, topk=8, repeats=1, heads=1, head_dim=16)
    assert records[0]["length"] == 256 and records[0]["speedup"] > 0
    output = tmp_path / "forward.md"
    assert main(["--lengths", "128", "--repeats", "1", "--output", str(output)]) == 0
    assert "| 128 | non-causal |" in output.read_text()
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        main(["--repeats", "0"])


# -- the causal query side in training (native/mita_train_kernels.c) ------------------------------
CAUSAL_CASES = [  # (length, dim, block, landmarks, topk, shared, dtype)
    (23, 8, 4, 2, 3, True, torch.float64),  # generic dims, a window of 2 of 5 landmarks
    (37, 8, 5, 9, 12, False, torch.float64),  # route-only; topk wider than early blocks' keys
    (130, 32, 32, 16, 64, True, torch.float64),  # d = 32 path, window wider than the landmarks
    (300, 64, 32, 4, 0, True, torch.float64),  # agent (topk = 0), d = 64 path
    (261, 32, 64, 16, 64, True, torch.float32),  # compare --long's head size and budget
    (97, 16, 16, 3, 20, True, torch.float32),  # d = 16 path, a ragged last block
    (650, 8, 300, 2, 10, True, torch.float64),  # blocks > MT_BLOCKED: the per-query backward
]


def _causal_inputs(length, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, length, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize(("length", "dim", "block", "landmarks", "topk", "shared", "dtype"), CAUSAL_CASES,
                         ids=str)
def test_causal_training_kernel_matches_its_twin_and_the_reference(length, dim, block, landmarks, topk,
                                                                   shared, dtype):
    from routeformer.ops.backends import recording

    q, k, v = _causal_inputs(length, dim, dtype)
    options = {"landmarks": landmarks, "topk": topk, "shared": shared, "causal": True, "block": block}
    weight = torch.randn(2, 2, length, dim, dtype=dtype, generator=torch.Generator().manual_seed(1))
    with recording() as ran:
        fast = mita_attention(q, k, v, **options)
    assert ran.get("mita_causal_query_side") == "native"
    with native_enabled(False):
        twin = mita_attention(q, k, v, **options)
    slow = mita_reference(q, k, v, **options)
    torch.testing.assert_close(fast.out, twin.out)
    torch.testing.assert_close(fast.out, slow)
    torch.testing.assert_close(fast.expert_load, twin.expert_load)  # the same routing decisions
    fast_grads = torch.autograd.grad((fast.out * weight).sum(), (q, k, v))
    for other in (twin.out, slow):
        other_grads = torch.autograd.grad((other * weight).sum(), (q, k, v))
        for mine, theirs in zip(fast_grads, other_grads, strict=True):
            torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("case", ["padded", "route 2"])
def test_causal_training_kernel_leaves_padding_and_several_routes_to_pytorch(case):
    from routeformer.ops.backends import recording

    q, k, v = _causal_inputs(23, 8, torch.float64)
    mask = torch.ones(2, 23, dtype=torch.bool)
    if case == "padded":
        mask[1, -5:] = False
    options = {"landmarks": 3, "topk": 4, "causal": True, "block": 4, "route": 2 if case == "route 2" else 1}
    with recording() as ran:
        mita_attention(q, k, v, mask=mask, **options)
    assert ran["mita_causal_query_side"] == "torch"


def test_causal_training_kernel_counts_its_executed_flops():
    """The kernel executes triangles of the own blocks (not the PyTorch path's padded squares), so it
    reports fewer FLOPs than the twin, never more, and about the pairs it reads."""
    q, k, v = (t.detach() for t in _causal_inputs(256, 16, torch.float32))
    options = {"landmarks": 4, "topk": 8, "causal": True, "block": 16}
    fast = mita_attention(q, k, v, **options)
    with native_enabled(False):
        twin = mita_attention(q, k, v, **options)
    assert 0 < fast.flops <= twin.flops
    # per (b, h): own-block triangles, ≤ 4 landmarks, 8 routed keys, routing logits, landmark stage
    per_query_pairs = (16 + 1) / 2 + 4 + 8
    assert fast.flops >= 2 * 2 * 256 * per_query_pairs * 4 * 16 * 0.8
