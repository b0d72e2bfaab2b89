"""Triton kernels: the routing top-K selection in the decode shape (few queries, many keys), with the
keys split over programs as flash-decoding splits them.

Axes: B batch, R routing heads, t queries (a cached decoding step has one), S keys (the cached
routing keys), r routing dim, C key chunks, K slots (padded to KP, a power of two).

Why: `_route_topk_kernel` (ops/triton/topk_routing.py) gives one program a block of queries and
all their keys. A decoding step routes one query over every cached key, so one program scans all
S keys while the rest of the GPU idles (measured on an H100 at 64k keys: 71.5 ms a step,
docs/results/gpu.md). Here the keys of each (b, r, query block) are cut into C chunks:

1. `_route_chunks_kernel`, grid (C, B·R, query blocks): each program scores one chunk of keys and
   keeps each query's top-K of that chunk as packed (score, key) int64 pairs, written to a
   [B·R, t, C, KP] buffer (unfilled slots hold the empty pair, below every real one);
2. `_merge_chunks_kernel`, grid (B·R, query blocks): each program reads its queries' C·KP pairs a
   tile at a time, keeps the top-K and unpacks them into (index, valid).

Both stages use topk_routing.py's helpers (`score_pairs`, `merge_pairs`, `store_selection`): the pair
packs the score's order-preserving bits above 2³² − 1 − key, so the larger pair has the higher score
or, among equal scores, the lower key, and a pair names its key. The top-K of the union of the
chunks' top-K lists is then the top-K of all keys under the same order, so the selection and tie
rule are exactly `route_topk`'s: forced keys (+inf) first, ties to the lower key index, slots
scoring -inf invalid and pointing at key 0. Scores are exact fp32 elementwise products (no TF32),
as in the one-program kernel, so the two kernels select the same keys for the same vectors.

The contract is `route_topk(causal=False)`'s (the call a cached decoding step makes, ops/topk/
decode.py): key masks, `local_window` (query i's keys (i - w, i]) and `global_tokens` as there.
The keys may be a strided view (the cache's live rows inside a larger buffer): only the routing
dim must be contiguous, so a step copies none of them.

Chunk and tile sizes are chosen from the shape and the GPU's SM count by reasoning, not by
measurement: no GPU has run or timed these kernels yet (they are tested in Triton's interpreter and
compiled for sm_80/sm_90 without a GPU), and this module claims no speed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from routeformer.ops.topk.slots import routing_slots
from routeformer.ops.triton._common import kernel, next_power_of_2
from routeformer.ops.triton.topk_routing import (
    check_triton_routing,
    empty_pairs,
    load_queries,
    merge_pairs,
    score_pairs,
    store_selection,
)


@kernel
def _route_chunks_kernel(
    RQ, RK, KEY_MASK, PARTIAL,
    routing_heads, length, num_keys, dim, slots, local_window, global_tokens,
    stride_kb, stride_kh, stride_kl, chunk, chunks,
    HAS_MASK: tl.constexpr, BLOCK_Q: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_c = tl.program_id(0)
    br = tl.program_id(1).to(tl.int64)
    b = br // routing_heads
    head = br % routing_heads
    rows = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    queries, row_ok, offs_r, r_ok = load_queries(RQ, br, length, dim, rows, BLOCK_R)
    offs_k = tl.arange(0, KP)
    keys = RK + b * stride_kb + head * stride_kh
    best = empty_pairs(BLOCK_Q, KP)
    first = pid_c * chunk  # chunk is a multiple of TILE: the tiles end at the chunk's end
    for start in range(first, tl.minimum(num_keys, first + chunk), TILE):
        cols = start + tl.arange(0, TILE)
        packed = score_pairs(queries, keys, stride_kl, KEY_MASK + b * num_keys, rows, row_ok, cols, offs_r,
                             r_ok, num_keys, local_window, global_tokens, False, HAS_MASK, BLOCK_Q, TILE)
        best = merge_pairs(best, packed, slots, offs_k, BLOCK_Q, KP)
    out = ((br * length + rows[:, None]) * chunks + pid_c) * KP + offs_k[None, :]
    tl.store(PARTIAL + out, best, mask=row_ok[:, None])


@kernel
def _merge_chunks_kernel(
    PARTIAL, INDEX, VALID,
    length, slots, width,
    BLOCK_Q: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr,
):
    br = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < length
    offs_k = tl.arange(0, KP)
    best = empty_pairs(BLOCK_Q, KP)
    for start in range(0, width, TILE):  # width = C·KP pairs a query
        cols = start + tl.arange(0, TILE)
        packed = tl.load(PARTIAL + (br * length + rows[:, None]) * width + cols[None, :],
                         mask=row_ok[:, None] & (cols < width)[None, :], other=-9223372036854775807)
        best = merge_pairs(best, packed, slots, offs_k, BLOCK_Q, KP)
    store_selection(INDEX, VALID, best, br, length, slots, rows, row_ok, offs_k, BLOCK_Q, KP)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sizes(device: torch.device, rows: int, num_keys: int, block_q: int, block_r: int, tile: int | None,
           chunk: int | None) -> tuple[int, int]:
    """(tile, chunk): keys scored per step and keys per program. CUDA: a score tile of at most
    8192 products (BLOCK_Q x TILE x BLOCK_R registers), and about two programs per SM in all, each
    scanning whole tiles. Interpreter (CPU tensors): a few chunks, so that the merge runs."""
    if tile is None:
        if device.type == "cuda":
            tile = max(16, min(512, 8192 // (block_q * block_r)))
        else:
            tile = max(16, min(256, next_power_of_2(-(-num_keys // 4))))
    elif tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16; got {tile}")
    if chunk is None:
        programs = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 4
        per_row = max(1, -(-programs // rows))
        chunk = max(tile, -(-num_keys // per_row))
        chunk = -(-chunk // tile) * tile
    elif chunk < 1 or chunk % tile:
        raise ValueError(f"chunk must be a positive multiple of tile ({tile}); got {chunk}")
    return tile, chunk


@torch.no_grad()
def triton_route_topk_decode(
    route_q: Tensor, route_k: Tensor, topk: int, *, key_mask: Tensor | None = None, local_window: int = 0,
    global_tokens: int = 0, tile: int | None = None, chunk: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """`route_topk(route_q, route_k, topk, causal=False, ...)` by the split-key kernels: (index
    [B, R, t, K] long, valid bool, scores computed = B·R·t·S), slots sorted best first (forced keys
    first). route_k may be a strided view whose last dim is contiguous (it is not copied).
    `tile` (a power of two >= 16): keys scored per step; `chunk` (a multiple of tile): keys per
    program; defaults from the shape (`_sizes`). The tests set them small to run many chunks."""
    check_triton_routing(route_q, route_k, topk, key_mask, False, local_window, global_tokens)
    batch, heads, length, dim = route_q.shape
    num_keys = route_k.shape[2]
    slots = routing_slots(topk, local_window, global_tokens, num_keys)
    device = route_q.device
    index = torch.zeros(batch, heads, length, slots, dtype=torch.long, device=device)
    valid = torch.zeros(batch, heads, length, slots, dtype=torch.int8, device=device)
    if index.numel() == 0:
        return index, valid.bool(), 0
    if route_k.stride(-1) != 1:
        route_k = route_k.contiguous()
    block_q = min(16, next_power_of_2(length))
    block_r = next_power_of_2(dim)
    kp = next_power_of_2(slots)
    query_blocks = triton.cdiv(length, block_q)
    tile, chunk = _sizes(device, batch * heads * query_blocks, num_keys, block_q, block_r, tile, chunk)
    chunks = triton.cdiv(num_keys, chunk)
    # Every slot of every (row, chunk) list is written (unfilled ones with the empty pair).
    partial = torch.empty(batch * heads, length, chunks, kp, dtype=torch.long, device=device)
    mask = key_mask.to(torch.int8).contiguous() if key_mask is not None else index  # unused when no mask
    _route_chunks_kernel[(chunks, batch * heads, query_blocks)](
        route_q.contiguous(), route_k, mask, partial,
        heads, length, num_keys, dim, slots, local_window, global_tokens,
        route_k.stride(0), route_k.stride(1), route_k.stride(2), chunk, chunks,
        HAS_MASK=key_mask is not None, BLOCK_Q=block_q, KP=kp, TILE=tile, BLOCK_R=block_r)
    width = chunks * kp
    # A merge tile: up to 1024 pairs a query block, and at least one chunk's list (KP) and 16.
    merge_tile = max(16, min(next_power_of_2(width), max(kp, 1024 // block_q)))
    _merge_chunks_kernel[(batch * heads, query_blocks)](
        partial, index, valid, length, slots, width, BLOCK_Q=block_q, KP=kp, TILE=merge_tile)
    return index, valid.bool(), batch * heads * length * num_keys

