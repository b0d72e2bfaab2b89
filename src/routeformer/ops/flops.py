"""Counting the attention FLOPs an op executed (multiply-adds count as 2 FLOPs).

Every op reports what it actually computed for the call, masked-out work that was still computed
included, so that `stats["flops"]` is a measurement of executed work and not a projection.
"""

from __future__ import annotations


def matmul_flops(rows: int, inner: int, cols: int) -> int:
    """FLOPs of a [rows, inner] @ [inner, cols] product."""
    return 2 * rows * inner * cols


def dense_attention_flops(query_key_pairs: int, head_dim: int, value_dim: int | None = None) -> int:
    """FLOPs of softmax attention over `query_key_pairs` scored pairs: q.k plus p.v."""
    value_dim = head_dim if value_dim is None else value_dim
    return 2 * query_key_pairs * head_dim + 2 * query_key_pairs * value_dim
