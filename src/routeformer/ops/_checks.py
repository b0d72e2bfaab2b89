"""Input validation shared by the ops: shapes [B, H, T, d] and the key-padding mask [B, T]."""

from __future__ import annotations

import torch
from torch import Tensor


def check_qkv(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool,
              grouped: bool = False) -> None:
    """Raise ``ValueError`` unless q, k, v are [B, H, T, d] tensors that fit together. `grouped`:
    k, v may have fewer heads G than q (grouped-query attention), G dividing H."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, T, d]; got {tuple(tensor.shape)}")
    heads_fit = q.shape[1] == k.shape[1] or (grouped and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0)
    if q.shape[0] != k.shape[0] or not heads_fit or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "q, k, v must share batch and head sizes (and k, v their length"
            + ("; k, v may have G heads, G dividing q's" if grouped else "") + "); got "
            f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim; got {q.shape[-1]} and {k.shape[-1]}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal attention needs as many queries as keys; got {q.shape[2]} and {k.shape[2]}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = real token); got {mask.dtype}")
        if mask.shape != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"mask must have shape [B, T] = {(k.shape[0], k.shape[2])}; got {tuple(mask.shape)}"
            )


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
