"""Rotary embedding: the fused C pass equals its PyTorch twin, forward and backward, and keeps the
property rotary exists for (scores depend on relative positions only)."""

import pytest
import torch

from routeformer.ops import rotary
from routeformer.ops.rotary import apply_rotary, apply_rotary_reference, rotary_angles

B, H, T, D = 2, 3, 23, 8


@pytest.fixture
def native_calls(monkeypatch):
    calls = []
    original = rotary.NativeRotary

    class Counted(original):
        @staticmethod
        def apply(*args):
            calls.append(1)
            return original.apply(*args)

    monkeypatch.setattr(rotary, "NativeRotary", Counted)
    return calls


def angles(offset=0):
    positions = torch.arange(T)[None].expand(B, -1) + torch.tensor([[offset], [offset + 5]])
    return rotary_angles(positions, D)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("selected", [False, True])
def test_rotary_matches_reference_forward_and_backward(dtype, selected, implementation, native_calls):
    gen = torch.Generator().manual_seed(0)
    # A head view of one [B, T, 2·H·d] projection, as the layers pass it: strided.
    projection = torch.randn(B, T, 2 * H * D, dtype=dtype, generator=gen)
    x = projection[..., H * D:].unflatten(-1, (H, D)).transpose(1, 2)
    rows = None
    if selected:  # routed query rows: an ascending subset of positions per batch row
        rows = torch.stack([torch.randperm(T, generator=gen)[:9].sort().values for _ in range(B)])
        x = x[:, :, :9]
    cos, sin = angles()
    leaf = x.detach().requires_grad_()
    out = apply_rotary(leaf, cos, sin, rows)
    expected_leaf = x.detach().requires_grad_()
    expected = apply_rotary_reference(expected_leaf, cos, sin, rows)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    assert out.is_contiguous()
    weights = torch.randn(out.shape, dtype=dtype, generator=gen)
    (grad,) = torch.autograd.grad((out * weights).sum(), leaf)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), expected_leaf)
    torch.testing.assert_close(grad, expected_grad, atol=tolerance, rtol=tolerance)
    assert len(native_calls) == (1 if implementation == "native" else 0)


def test_rotary_gradient_passes_gradcheck(implementation):
    cos, sin = angles()
    x = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


def test_rotary_scores_depend_only_on_relative_position(implementation):
    """q at i and k at j score the same after shifting both positions by the same offset."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(B, H, T, D, dtype=torch.float64, generator=gen) for _ in range(2))
    scores = []
    for offset in (0, 17):
        cos, sin = angles(offset)
        scores.append(apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2))
    # The angles are fp32 (rotary_angles), hence the tolerance.
    torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=1e-5)
    cos, sin = angles()
    assert not torch.allclose(apply_rotary(q, cos, sin), q), "the rotation must move the vectors"


def test_rotary_rejects_bad_rows():
    cos, sin = angles()
    x = torch.randn(B, H, 4, D)
    with pytest.raises(ValueError, match="rows must have shape"):
        apply_rotary(x, cos, sin, torch.zeros(B, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="rows must index"):
        apply_rotary(x, cos, sin, torch.full((B, 4), T, dtype=torch.long))
