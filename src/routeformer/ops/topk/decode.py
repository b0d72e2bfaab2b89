"""Cached decoding of top-k routing (the `topk` layer's step): route one new query over the cached
routing keys, with the parallel pass's kernel family and tie rule.

Axes: B batch, R routing heads, t new queries, L cached keys (0 .. i for query i), r routing dim
(+1 with the recency feature), V the C kernel's key tile, K slots.

The routing keys of every token are cached beside its keys/values (`append_routing_keys`). On CPU
with the native kernels they are stored directly in the layout the routing kernel reads (tiles of
V keys, each transposed: ops/native/topk_kernels.c), in a buffer that grows by doubling, so a step
reads each cached routing key once and copies nothing (the parallel path re-tiles its keys per
call). Elsewhere (no C compiler, CUDA) they are a plain [B, R, L, r] buffer (`ops.decode.append_rows`)
and a step calls `route_topk`, which dispatches as the parallel pass does; on CUDA its rule for
the decode shape (`ops.backends.route_decode_backend`: few queries, thousands of keys) takes the
split-key kernel (ops/triton/topk_decode_routing.py), which spreads the step's keys over many
programs and reads the cache's strided view in place; same selection and tie rule.

A step selects, for query i, what the parallel `route_topk(causal=True)` selects for row i:
the forced keys (the last `local_window` tokens [i - w + 1, i] and the first `global_tokens`
positions) plus the best-scoring other keys j <= i, min(i + 1, K + w + g) slots in all, ties to the
lower key index. It is computed as one non-causal routing call over the keys before the window,
0 .. i - w (all of them eligible for query i): the call's own `global_tokens` forces the global
keys there and keeps them out of the competition, its slot count is the parallel row's routed
slots plus those globals, and the window's keys are appended (forced, never competing). The
routing scores of a (query, key) pair are computed by the same kernel on the same vectors as in
the parallel pass, so near-ties resolve alike too (tested row by row with exact ties).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.backends import NATIVE, routing_cache_backend
from routeformer.ops.decode import append_rows
from routeformer.ops.native.topk import route_topk_op
from routeformer.ops.topk.routing import route_topk, routing_slots


def _tile() -> int:
    from routeformer.ops import native as _native

    return int(_native.library().route_topk_chunk())


def routing_uses_tiles(route_k: Tensor) -> bool:
    """Whether the cached routing keys take the native kernel's tiled layout (CPU, kernels loaded,
    a dtype they read)."""
    return routing_cache_backend(route_k)[0] == NATIVE


def append_routing_keys(cache: dict, route_k: Tensor) -> None:
    """Cache the routing keys route_k [B, R, t, r] of the next t tokens (stream indices
    `cache["routing_filled"]` ..), in place with doubling growth (first allocation:
    `cache["reserve"]` keys when set). The layout is chosen at the first call and kept."""
    if "routing_tiled" not in cache:
        cache["routing_tiled"] = int(routing_uses_tiles(route_k))
    if not cache["routing_tiled"]:
        append_rows(cache, {"keys": route_k}, prefix="routing_", capacity=cache.get("reserve") or None)
        return
    tile = _tile()
    filled, new = cache.get("routing_filled", 0), route_k.shape[2]
    need = filled + new
    buffer = cache.get("routing_tiles")  # [B, R, tiles, r, V]: the kernel's layout, zero-padded
    room = 0 if buffer is None else buffer.shape[2] * tile
    if need > room:
        size = max(need, 2 * room, cache.get("reserve", 0) if buffer is None else 0)
        batch, routes, _, dim = route_k.shape
        fresh = route_k.new_zeros(batch, routes, -(-size // tile), dim, tile)
        if buffer is not None:
            used = -(-filled // tile)
            fresh[:, :, :used].copy_(buffer[:, :, :used])
        cache["routing_tiles"] = buffer = fresh
    where = torch.arange(filled, need, device=route_k.device)
    # Key j goes to tile j // V, lane j % V (advanced indices apart: the result is [t, B, R, r]).
    buffer[:, :, where // tile, :, where % tile] = route_k.permute(2, 0, 1, 3).to(buffer.dtype)
    cache["routing_filled"] = need


def cached_routing_keys(cache: dict) -> Tensor:
    """The cached routing keys as [B, R, L, r] (a copy in the tiled layout: for tests and
    diagnostics, not for a step)."""
    if not cache["routing_tiled"]:
        return cache["routing_keys"]
    tiles = cache["routing_tiles"]
    keys = tiles.transpose(-1, -2).flatten(2, 3)
    return keys[:, :, :cache["routing_filled"]]


def route_cached(
    route_q: Tensor, cache: dict, first: int, topk: int, *, local_window: int = 0, global_tokens: int = 0,
    position_dim: bool = False,
) -> tuple[Tensor, Tensor]:
    """Slots of the new queries route_q [B, R, t, r] of stream indices first .. first + t - 1 over the
    cached routing keys (which already include theirs): (index long [B, R, t, S], valid bool
    [B, R, t, S]), S = the largest row's slot count, invalid slots pointing at key 0. Row i holds the
    set the parallel causal `route_topk` selects for query i (see the module docstring). One routing
    call per new query (a decoding step has one)."""
    rows = []
    for offset in range(route_q.shape[2]):
        rows.append(_route_one(route_q[:, :, offset:offset + 1], cache, first + offset, topk,
                               local_window, global_tokens, position_dim))
    width = max(index.shape[-1] for index, _ in rows)
    index = route_q.new_zeros(*route_q.shape[:3], width, dtype=torch.long)
    valid = torch.zeros(index.shape, dtype=torch.bool, device=route_q.device)
    for offset, (row_index, row_valid) in enumerate(rows):
        index[:, :, offset, :row_index.shape[-1]] = row_index[:, :, 0]
        valid[:, :, offset, :row_valid.shape[-1]] = row_valid[:, :, 0]
    return index, valid


def _route_one(route_q: Tensor, cache: dict, i: int, topk: int, local_window: int, global_tokens: int,
               position_dim: bool) -> tuple[Tensor, Tensor]:
    batch, routes = route_q.shape[:2]
    keys = i + 1
    slots = routing_slots(topk, local_window, global_tokens, keys)
    window_first = max(0, i - local_window + 1) if local_window else keys
    before = window_first  # keys 0 .. window_first - 1: the globals among them, and the candidates
    globals_before = min(global_tokens, before)
    routed = slots - (keys - window_first) - globals_before
    parts_index, parts_valid = [], []
    if before and routed + globals_before > 0:
        wanted = routed + globals_before
        query = route_q.contiguous()
        if cache["routing_tiled"]:
            index, valid = route_topk_op.function(
                query, cache["routing_tiles"], None, routes, before, wanted, False, 0, global_tokens,
                position_dim)
        else:
            cached = cache["routing_keys"][:, :, :before]
            index, valid, _ = route_topk(query, cached, max(1, routed), causal=False,
                                         global_tokens=global_tokens, position_dim=position_dim)
            index, valid = index[..., :wanted], valid[..., :wanted]
        parts_index.append(index)
        parts_valid.append(valid)
    if window_first < keys:
        window = torch.arange(window_first, keys, device=route_q.device)
        parts_index.append(window.expand(batch, routes, 1, -1))
        parts_valid.append(torch.ones(batch, routes, 1, keys - window_first, dtype=torch.bool,
                                      device=route_q.device))
    return torch.cat(parts_index, dim=-1), torch.cat(parts_valid, dim=-1)
