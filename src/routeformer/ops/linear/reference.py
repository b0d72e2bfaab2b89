"""Linear attention with the elu(x) + 1 feature map, the specification (`linear_attention_reference`).

Axes: B batch, H heads, T length, d head dim (e value dim).

    out_i = phi(q_i)·S_i / (phi(q_i)·z_i + eps),   phi(x) = elu(x) + 1,
    S_i = sum_{j in keys(i)} phi(k_j) v_jᵀ,          z_i = sum_{j in keys(i)} phi(k_j)

Written the obvious way: the explicit sum over positions as the dense masked matrix phi(q) phi(k)ᵀ,
O(T²). `DEFAULT_EPS`, `feature_map` and `masked_features` are defined here and imported by the
fast path (ops/linear/op.py): the feature map is the specification, and this twin imports no fast
path (tests/ops/test_references_independent.py).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_qkv

DEFAULT_EPS = 1e-6


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0."""
    return F.elu(x) + 1.0


def masked_features(q: Tensor, k: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(phi(q), phi(k)) with padded keys' features zeroed, so they add nothing to any state."""
    phi_q, phi_k = feature_map(q), feature_map(k)
    if mask is not None:
        phi_k = phi_k * mask[:, None, :, None].to(phi_k.dtype)
    return phi_q, phi_k


def linear_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, causal: bool = False,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """The specification of `linear_attention`: the explicit sum over positions (dense, O(T²))."""
    check_qkv(q, k, v, mask, causal=causal)
    phi_q, phi_k = masked_features(q, k, mask)
    weights = phi_q @ phi_k.transpose(-1, -2)  # [B, H, T, T]: phi(q_i)·phi(k_j)
    if causal:
        weights = weights.tril()
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + eps)
