"""MiTA's argument check (`check_mita_args`) and the grid pooling shape it needs, shared by the
op (ops/mita/op.py), its landmark stage and its reference; imports nothing but the ops' checks."""

from __future__ import annotations

import math

from routeformer.ops._checks import check_positive


def grid_pool_shape(landmarks: int) -> tuple[int, int]:
    """The most square (rows, cols) with rows·cols = landmarks: 16 -> (4, 4), 8 -> (2, 4)."""
    rows = math.isqrt(landmarks)
    while landmarks % rows:
        rows -= 1
    return rows, landmarks // rows


def check_mita_args(
    length: int, *, landmarks: int, topk: int, route: int, causal: bool,
    grid: tuple[int, int] | None, extra_tokens: int, block: int | None = None,
) -> None:
    """Raise ValueError naming the argument when the MiTA settings do not fit a length-N input
    (length 0 checks the settings alone: an empty input gives an empty output)."""
    check_positive("landmarks", landmarks)
    check_positive("route", route)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise ValueError(f"topk must be an integer >= 0 (0 = no routed experts); got {topk!r}")
    if not isinstance(extra_tokens, int) or extra_tokens < 0:
        raise ValueError(f"extra_tokens must be an integer >= 0; got {extra_tokens!r}")
    if causal:
        if grid is not None or extra_tokens:
            raise ValueError("the causal variant pools 1-D blocks of the sequence: grid and extra_tokens "
                             "are for non-causal (vision) inputs")
        if block is not None:
            check_positive("block", block)
    elif block is not None:
        raise ValueError(f"block is the causal build's block length (bidirectional MiTA pools "
                         f"`landmarks` windows instead); got block={block!r} with causal=False")
    if grid is not None and (len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid)):
        raise ValueError(f"grid must be a pair of positive integers (h, w); got {grid!r}")
    if length == 0 or causal:
        return
    pooled = length - extra_tokens
    if pooled < 1:
        raise ValueError(f"extra_tokens ({extra_tokens}) leaves no token to pool in a length-{length} input")
    if grid is not None:
        if grid[0] * grid[1] != pooled:
            raise ValueError(f"grid {tuple(grid)} holds {grid[0] * grid[1]} tokens but the input has "
                             f"{pooled} tokens after {extra_tokens} extra token(s)")
        rows, cols = grid_pool_shape(landmarks)
        if rows > grid[0] or cols > grid[1]:
            raise ValueError(f"landmarks={landmarks} pools to a {rows}x{cols} grid, larger than the "
                             f"{grid[0]}x{grid[1]} token grid")
