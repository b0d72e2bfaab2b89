"""Triton kernel: the routing top-K selection of `routeformer.ops.topk.route_topk`.

Axes: B batch, R routing heads, T queries, S keys, r routing dim, K slots (padded to KP, a power
of two).

Same contract and tie rule as `route_topk` (its reference twin is `route_topk_reference`): scores
s_ij = rq_i · rk_j; forced keys (the last `local_window` positions up to i, the first
`global_tokens`) score +inf, ineligible ones (future keys when causal, padded keys, beyond S) -inf;
each query keeps its K = `routing_slots(...)` best, lower key index first among equal scores; slots
whose score is -inf are invalid and point at key 0.

One program serves BLOCK_T queries of one (b, r). It scores the keys a tile at a time and keeps,
per query, a running top-K list. To make one integer comparison carry both the order and the tie
rule, each (score, key) pair is packed into one int64: the high 32 bits are the score's float bits
mapped to an integer of the same order, the low 32 bits are 2³² − 1 − key, so the larger packed
value has the higher score or, among equal scores, the lower key. A tile is merged into the list
only when it holds a pair above some query's K-th best, by K extractions of the maximum of (list ∪
tile) — K·(K + tile) comparisons, no sort: `tl.sort` is a bitonic network whose XOR reductions
Triton's interpreter runs element by element in Python (seconds per call), and K extractions are
as cheap on a GPU for K <= 64. Causal queries score only the keys up to their
block's last row. Nothing of size T x S is stored. Scores are computed in fp32 (inputs of any
float dtype are converted in registers) as an elementwise product and sum, not `tl.dot`, so they
are the exact fp32 dot products (no TF32 rounding that would reorder near ties).

The scoring, packing, merge and unpacking are `@triton.jit` helpers (`score_pairs`, `merge_pairs`,
`store_selection`) that the decode-shaped kernels (ops/triton/topk_decode_routing.py: one query's keys
split over many programs) call too, so both paths select by one rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from routeformer.ops.topk.slots import check_routing, routing_slots
from routeformer.ops.triton._common import check_device, check_float, kernel, next_power_of_2


# The (score, key) pairs as int64 and the running top-K list, shared with the decode-shaped kernel
# (ops/triton/topk_decode_routing.py), so that both select by one rule.
@triton.jit
def load_queries(RQ, br, length, dim, rows, BLOCK_R: tl.constexpr):
    """The routing queries `rows` of routing row br as fp32 [rows, BLOCK_R] (zeros past `length` and
    `dim`), with the masks and dim offsets `score_pairs` takes: (queries, row_ok, offs_r, r_ok)."""
    row_ok = rows < length
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < dim
    queries = tl.load(RQ + br * length * dim + rows[:, None] * dim + offs_r[None, :],
                      mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    return queries, row_ok, offs_r, r_ok


@triton.jit
def empty_pairs(BLOCK_T: tl.constexpr, KP: tl.constexpr):
    """A [BLOCK_T, KP] top-K list holding no pair: every slot below every packed pair (the lowest
    packed pair is key(-inf)·2³²)."""
    return tl.full([BLOCK_T, KP], -9223372036854775807, tl.int64)


@triton.jit
def score_pairs(queries, KEYS, key_stride, KEY_MASK, rows, row_ok, cols, offs_r, r_ok, num_keys,
                local_window, global_tokens, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK_T: tl.constexpr, TILE: tl.constexpr):
    """The packed pairs [BLOCK_T, TILE] of the fp32 queries [BLOCK_T, BLOCK_R] (rows `rows`) with
    the keys `cols` (key j at KEYS + j·key_stride; KEY_MASK: this batch row's [S] int8 mask),
    forced keys +inf and ineligible ones -inf (module docstring); rows past the block are empty."""
    col_ok = cols < num_keys
    keys = tl.load(KEYS + cols[:, None] * key_stride + offs_r[None, :],
                   mask=col_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    scores = tl.sum(queries[:, None, :] * keys[None, :, :], axis=2)
    forced = ((cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - local_window)) \
        | (cols[None, :] < global_tokens)
    scores = tl.where(forced, float("inf"), scores)
    ineligible = ~col_ok[None, :] | ~row_ok[:, None]
    if CAUSAL:
        ineligible = ineligible | (cols[None, :] > rows[:, None])
    if HAS_MASK:
        real = tl.load(KEY_MASK + cols, mask=col_ok, other=0) != 0
        ineligible = ineligible | ~real[None, :]
    scores = tl.where(ineligible, float("-inf"), scores)
    scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 and 0.0 are one score
    bits = scores.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    # int64 constants built as tensors: a bare 4294967295 would be typed uint32 by the compiler.
    packed = (ordered.to(tl.int64) << 32) | (tl.full([BLOCK_T, TILE], 4294967295, tl.int64)
                                              - cols[None, :].to(tl.int64))
    return tl.where(row_ok[:, None], packed, -9223372036854775807)


@triton.jit
def merge_pairs(best, packed, slots, offs_k, BLOCK_T: tl.constexpr, KP: tl.constexpr):
    """The top-`slots` list (sorted descending, [BLOCK_T, KP]) of best ∪ packed ([BLOCK_T, any])."""
    # Merge only when some query of the block has a pair beating its current K-th best (after
    # the first tiles, most tiles of a long sequence are skipped: the C kernel's threshold).
    kth = tl.min(tl.where(offs_k[None, :] < slots, best, 9223372036854775807), axis=1)
    if tl.max((tl.max(packed, axis=1) > kth).to(tl.int32), axis=0) > 0:
        # Top-`slots` of (best ∪ tile) by repeated extraction of the maximum: pairs are unique
        # (the key is in the low bits), so removing the maximum removes exactly one pair.
        merged = empty_pairs(BLOCK_T, KP)
        for slot in range(0, slots):
            top = tl.maximum(tl.max(best, axis=1), tl.max(packed, axis=1))
            merged = tl.where(offs_k[None, :] == slot, top[:, None], merged)
            best = tl.where(best == top[:, None], -9223372036854775807, best)
            packed = tl.where(packed == top[:, None], -9223372036854775807, packed)
        best = merged
    return best


@triton.jit
def unpack_pairs(best, BLOCK_T: tl.constexpr, KP: tl.constexpr):
    """(key int64, valid bool) of each slot of a top-K list: pairs scoring -inf (and empty slots)
    are invalid and point at key 0."""
    ok = (best >> 32) > -2139095041  # above key(-inf), the ordered integer of -inf's bits
    low_bits = tl.full([BLOCK_T, KP], 4294967295, tl.int64)
    return tl.where(ok, low_bits - (best & low_bits), 0), ok


@triton.jit
def store_selection(INDEX, VALID, best, br, length, slots, rows, row_ok, offs_k, BLOCK_T: tl.constexpr,
                    KP: tl.constexpr):
    """Write the top-K lists `best` of `rows` of routing row br as (index, valid) [.., length, slots]."""
    chosen, ok = unpack_pairs(best, BLOCK_T, KP)
    out = br * length * slots + rows[:, None] * slots + offs_k[None, :]
    store_ok = row_ok[:, None] & (offs_k < slots)[None, :]
    tl.store(INDEX + out, chosen, mask=store_ok)
    tl.store(VALID + out, ok.to(tl.int8), mask=store_ok)


@kernel
def _route_topk_kernel(
    RQ, RK, KEY_MASK, INDEX, VALID,
    routing_heads, length, num_keys, dim, slots, local_window, global_tokens,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    br = tl.program_id(1).to(tl.int64)  # int64 offsets: B·R·T·r may pass 2³¹
    b = br // routing_heads
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    queries, row_ok, offs_r, r_ok = load_queries(RQ, br, length, dim, rows, BLOCK_R)
    offs_k = tl.arange(0, KP)
    best = empty_pairs(BLOCK_T, KP)  # sorted descending
    end = num_keys
    if CAUSAL:
        end = tl.minimum(num_keys, (pid_t + 1) * BLOCK_T)
    for start in range(0, end, TILE):
        cols = start + tl.arange(0, TILE)
        packed = score_pairs(queries, RK + br * num_keys * dim, dim, KEY_MASK + b * num_keys, rows, row_ok,
                             cols, offs_r, r_ok, num_keys, local_window, global_tokens, CAUSAL, HAS_MASK,
                             BLOCK_T, TILE)
        best = merge_pairs(best, packed, slots, offs_k, BLOCK_T, KP)
    store_selection(INDEX, VALID, best, br, length, slots, rows, row_ok, offs_k, BLOCK_T, KP)


def check_triton_routing(route_q: Tensor, route_k: Tensor, topk: int, key_mask: Tensor | None, causal: bool,
                         local_window: int, global_tokens: int) -> None:
    """The routing kernels' argument checks (this file's and the decode-shaped one's): ValueError
    naming the argument."""
    check_routing(route_q, route_k, key_mask, causal)
    if topk < 1:
        raise ValueError(f"topk must be >= 1; got {topk}")
    if local_window < 0 or global_tokens < 0:
        raise ValueError(f"local_window and global_tokens must be >= 0; got {local_window}, {global_tokens}")
    check_float("route_q", route_q)
    check_float("route_k", route_k)
    check_device(*(t for t in (route_q, route_k, key_mask) if t is not None))


@torch.no_grad()
def triton_route_topk(
    route_q: Tensor, route_k: Tensor, topk: int, *, causal: bool = True, key_mask: Tensor | None = None,
    local_window: int = 0, global_tokens: int = 0, tile: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """`route_topk` by the Triton kernel: (index [B, R, T, K] long, valid bool, scores computed:
    the (query, key) pairs the kernel scored, causal blocks counting up to their last row).
    `tile` (a power of two >= 16): keys scored per step; default 64 on CUDA, all keys (up to 256)
    on CPU. The tests set it small to run the tile-by-tile merge in the interpreter."""
    check_triton_routing(route_q, route_k, topk, key_mask, causal, local_window, global_tokens)
    batch, heads, length, dim = route_q.shape
    num_keys = route_k.shape[2]
    slots = routing_slots(topk, local_window, global_tokens, num_keys)
    index = torch.zeros(batch, heads, length, slots, dtype=torch.long, device=route_q.device)
    valid = torch.zeros(batch, heads, length, slots, dtype=torch.int8, device=route_q.device)
    if index.numel() == 0:
        return index, valid.bool(), 0
    # GPU: a [16, 64, r] score tile per step. Interpreter (CPU tensors): every step is a numpy call,
    # so one tile holds all the keys of a short test sequence.
    on_cpu = route_q.device.type == "cpu"
    block_t = 32 if on_cpu else 16
    if tile is None:
        tile = min(256, max(16, next_power_of_2(num_keys))) if on_cpu else 64
    elif tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16; got {tile}")
    mask = key_mask.to(torch.int8).contiguous() if key_mask is not None else index  # unused when no mask
    grid = (triton.cdiv(length, block_t), batch * heads)
    _route_topk_kernel[grid](
        route_q.contiguous(), route_k.contiguous(), mask, index, valid,
        heads, length, num_keys, dim, slots, local_window, global_tokens,
        CAUSAL=causal, HAS_MASK=key_mask is not None,
        BLOCK_T=block_t, KP=next_power_of_2(slots), TILE=tile, BLOCK_R=next_power_of_2(dim))
    scored = 0
    for start in range(0, length, block_t):
        stop = min(length, start + block_t)
        scored += (stop - start) * (min(num_keys, stop) if causal else num_keys)
    return index, valid.bool(), batch * heads * scored
