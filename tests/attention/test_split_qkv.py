"""`split_qkv` (attention/base.py): the heads' q, k, v as views of one projection, and a backward that
writes their gradients into the projection's layout in one pass (no extra copy)."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from routeformer.attention.base import split_qkv


class _RecordOps(TorchDispatchMode):
    """The aten ops that run inside the block, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _projected(weight: torch.Tensor, batch=2, length=5, heads=2, head_dim=4) -> torch.Tensor:
    x = torch.randn(batch, length, weight.shape[1], generator=torch.Generator().manual_seed(0))
    return F.linear(x, weight).view(batch, length, 3, heads, head_dim)


def test_split_qkv_gives_the_heads_as_views_with_the_permuted_layout():
    qkv = _projected(torch.randn(24, 16))
    for part, expected in zip(split_qkv(qkv), qkv.permute(2, 0, 3, 1, 4).unbind(0), strict=True):
        assert part.shape == (2, 2, 5, 4) and part.stride() == expected.stride()
        assert part.data_ptr() == expected.data_ptr()  # a view, no copy
        torch.testing.assert_close(part, expected, rtol=0, atol=0)


def test_split_qkv_backward_is_one_stack_into_the_projection_layout():
    seed = torch.Generator().manual_seed(1)
    weights = [torch.randn(24, 16, generator=seed).requires_grad_() for _ in range(2)]
    weights[1].data.copy_(weights[0].data)
    splits = (split_qkv, lambda qkv: qkv.permute(2, 0, 3, 1, 4).unbind(0))  # ours, the old form
    recorded = []
    for weight, split in zip(weights, splits, strict=True):
        out = F.scaled_dot_product_attention(*split(_projected(weight)), is_causal=True)
        with _RecordOps() as ops:
            out.square().sum().backward()
        recorded.append(ops.ops)
    torch.testing.assert_close(weights[0].grad, weights[1].grad, rtol=1e-6, atol=1e-6)
    ours, old = recorded
    assert ours.count("aten.stack") == 1 and "aten.clone" not in ours, ours
    assert "aten.clone" in old  # the check can fail: the old form copied the stacked gradients again
