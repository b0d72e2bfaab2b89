"""Rotary position embedding (RoPE; Su et al. 2021) as a pure function.

Axes: B batch, H heads, T length, d head dim (even).
Feature pairs are rotated by angle position · base^(-2i/d), in the "half split" convention
(feature i paired with feature i + d/2), as GPT-NeoX and Llama do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_angles(positions: Tensor, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin [B, 1, T, d] for long positions [B, T]."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head dim; got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, H, T, d] by precomputed angles; relative offsets survive the dot product."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
