"""Top-k key selection in a low-dimensional routing space (ADSR, the routing half).

Axes: B batch, R routing heads (1 when shared by all attention heads, else H), T queries, S keys,
r routing dim, K selected slots, G key group.

Routing scores s_ij = rq_i · rk_j (no softmax). Eligible keys: j <= i when causal, and real keys
of the padding mask. R_i = the `topk` eligible keys with the highest scores, plus two kinds of
forced keys that never compete for those slots: the last `local_window` tokens [i - w + 1, i] and
the first `global_tokens` positions ("memory" tokens every query reads). A query with fewer
eligible keys than slots takes all of them; the remaining slots are marked invalid. Ties: among
keys with equal scores the lower key index is selected first, in the C kernel, the PyTorch path
and the reference alike (equal routing vectors, e.g. repeated tokens under a position-blind
router, tie exactly). "Equal" means equal as computed: in float32 every path gives equal vectors
bitwise equal scores (tested); CPU float64 GEMM (the PyTorch path and the reference) may compute
the same dot product 1 ulp apart in different key columns, so in float64 such near-ties follow
the computed scores and the implementations can pick different tied keys.

Memory: queries are processed in blocks; one block's scores [B, R, block, S] live in a scratch
buffer that is reused, so nothing of size T x S is held; the result is O(T·K). Time is O(T·S·r)
for the scores (routing stays quadratic; it is cheap because r << d) plus the selection, which
is exact and two-stage: the K groups of G keys with the highest maxima contain the K highest
scores (if a top-K key's group were not among them, K other groups would each hold a larger
score), so `topk` runs over S/G group maxima and then over K·G candidates instead of over S.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive
from routeformer.ops.backends import NATIVE, TRITON, route_decode_backend, route_topk_backend
from routeformer.ops.native import native_kernels
from routeformer.ops.native.topk import (
    route_topk_op,
    route_topk_rows_op,
    route_topk_scored,
    speculative_query_tile,
)
from routeformer.ops.topk.reference import block_masks  # the eligibility rule, defined once
from routeformer.ops.topk.repeated import route_repeated_keys
from routeformer.ops.topk.slots import check_routing, routing_slots

DEFAULT_ROUTING_BLOCK = 64
DEFAULT_GROUP = 32


def _mask_block(
    scores: Tensor, start: int, stop: int, num_keys: int, causal: bool, local_window: int,
    global_tokens: int,
) -> None:
    """Apply forced (+inf) and ineligible (-inf) keys in place, touching only the columns where
    either can occur: full passes over a block's scores cost as much as computing them."""
    width = scores.shape[-1]

    def fill(first_col: int, end_col: int, forced_too: bool, ineligible_too: bool) -> None:
        if end_col <= first_col:
            return
        ineligible, forced = block_masks(start, stop, first_col, end_col, num_keys, causal,
                                          local_window, global_tokens, scores.device)
        if forced_too and forced is not None:
            scores[..., first_col:end_col].masked_fill_(forced, float("inf"))
        if ineligible_too:
            scores[..., first_col:end_col].masked_fill_(ineligible, float("-inf"))

    fill(0, min(global_tokens, width), True, False)
    if local_window:
        fill(max(0, start - local_window + 1), min(stop, width), True, False)
    # Causal: only the diagonal part (columns >= start) has future keys; else only padding columns.
    fill(start if causal else min(num_keys, width), width, False, True)


@torch.no_grad()
def route_topk(
    route_q: Tensor, route_k: Tensor, topk: int, *, causal: bool = True, key_mask: Tensor | None = None,
    local_window: int = 0, global_tokens: int = 0, block: int = DEFAULT_ROUTING_BLOCK,
    group: int = DEFAULT_GROUP, position_dim: bool = False,
) -> tuple[Tensor, Tensor, int]:
    """Select each query's keys. Returns (index [B, R, T, K] long, valid [B, R, T, K] bool,
    routing scores computed) with K = `routing_slots(...)`. Order of slots within a row is
    unspecified; valid entries of a row are distinct keys; invalid slots point at key 0.
    No gradient flows through selection (it is a hard top-k); see the `topk` layer for how the
    router is trained.

    `position_dim=True` says the last routing dim of route_k holds key positions (the `topk`
    layer's recency feature): the native CPU path then takes the tiled kernel, which such a dim
    does not slow down (see `_one_dim_dominates`), without reading the data — the same choice
    eagerly and under torch.compile. The selection is the same either way.

    Causal routing on CPU whose keys repeat (few distinct routing vectors: a position-blind
    router's first layer) is routed by groups of equal keys (ops/topk/repeated.py), eagerly,
    with the same selection; the check sorts the first few hundred keys' fingerprints a row (the
    whole row's only where those repeat).
    """
    check_routing(route_q, route_k, key_mask, causal)
    check_positive("topk", topk)
    check_positive("block", block)
    check_positive("group", group)
    if local_window < 0 or global_tokens < 0:
        raise ValueError(f"local_window and global_tokens must be >= 0; got {local_window}, {global_tokens}")
    if causal and not position_dim and route_q.device.type == "cpu":
        # Routing keys that repeat (a position-blind router's first layer): route by groups.
        repeated = route_repeated_keys(route_q, route_k, topk, key_mask, local_window, global_tokens)
        if repeated is not None:
            return repeated
    batch, heads, length, _ = route_q.shape
    num_keys = route_k.shape[2]
    slots = routing_slots(topk, local_window, global_tokens, num_keys)
    backend, _ = route_topk_backend(route_q, route_k, slots)
    if backend == TRITON:  # (triton is optional: imported only here)
        if not causal and route_decode_backend(route_q, num_keys) is not None:  # few queries, many keys
            from routeformer.ops.triton.topk_decode_routing import triton_route_topk_decode

            return triton_route_topk_decode(route_q, route_k, topk, key_mask=key_mask,
                                            local_window=local_window, global_tokens=global_tokens)
        from routeformer.ops.triton.topk_routing import triton_route_topk

        return triton_route_topk(route_q, route_k, topk, causal=causal, key_mask=key_mask,
                                 local_window=local_window, global_tokens=global_tokens)
    if backend == NATIVE:
        return _route_topk_native(native_kernels(route_q, route_k), route_q, route_k, slots, causal,
                                  key_mask, local_window, global_tokens, position_dim)
    padded_keys = math.ceil(num_keys / group) * group
    keys_t = torch.zeros(batch, heads, route_k.shape[-1], padded_keys, dtype=route_k.dtype,
                         device=route_k.device)
    keys_t[..., :num_keys] = route_k.transpose(-1, -2)
    masked_keys = None  # [B, 1, 1, padded S], True = padded key
    if key_mask is not None:
        masked_keys = torch.ones(batch, 1, 1, padded_keys, dtype=torch.bool, device=key_mask.device)
        masked_keys[..., :num_keys] = ~key_mask[:, None, None, :]
    index = torch.empty(batch, heads, length, slots, dtype=torch.long, device=route_q.device)
    valid = torch.empty(batch, heads, length, slots, dtype=torch.bool, device=route_q.device)
    scratch = route_q.new_empty(batch * heads * min(block, length) * padded_keys)
    scored = 0
    for start in range(0, length, block):
        stop = min(length, start + block)
        # Causal rows never look past their own block: score only the keys up to it.
        width = min(padded_keys, math.ceil(stop / group) * group) if causal else padded_keys
        scores = scratch[: batch * heads * (stop - start) * width].view(batch, heads, stop - start, width)
        torch.matmul(route_q[:, :, start:stop], keys_t[..., :width], out=scores)
        scored += batch * heads * (stop - start) * width
        _mask_block(scores, start, stop, num_keys, causal, local_window, global_tokens)
        if masked_keys is not None:
            scores.masked_fill_(masked_keys[..., :width], float("-inf"))
        take = min(slots, width)
        # One score beyond the K slots (when there is one) tells whether the K-th best is tied
        # with an unselected key: only then does the tie rule have to choose (see _break_ties).
        extra = int(width > take)
        if width // group > take + extra:
            # Two-stage exact selection (see the module docstring).
            rows = batch * heads * (stop - start)
            grouped = scores.view(rows, width // group, group)
            best_groups = grouped.amax(dim=-1).topk(take + extra, dim=-1, sorted=False).indices
            # Copy each chosen group's G contiguous scores at once (advanced indexing), not per element.
            candidates = grouped[torch.arange(rows, device=scores.device)[:, None], best_groups]
            values, picked = candidates.view(rows, -1).topk(take + extra, dim=-1, sorted=True)
            chosen = best_groups.gather(-1, picked // group) * group + picked % group
            values = values.view(batch, heads, stop - start, take + extra)
            chosen = chosen.view(batch, heads, stop - start, take + extra)
        else:
            values, chosen = scores.topk(take + extra, dim=-1, sorted=True)
        values, chosen = _break_ties(scores, values, chosen, take)
        ok = values > float("-inf")
        index[:, :, start:stop, :take] = torch.where(ok, chosen, torch.zeros_like(chosen))
        valid[:, :, start:stop, :take] = ok
        if take < slots:
            index[:, :, start:stop, take:] = 0
            valid[:, :, start:stop, take:] = False
    return index, valid, scored


def _break_ties(scores: Tensor, values: Tensor, chosen: Tensor, take: int) -> tuple[Tensor, Tensor]:
    """The `take` best keys of each row with the documented tie rule, from the `take` (+1 when the
    row has more keys) best in descending order: where the K-th best score equals the (K+1)-th,
    torch.topk's choice among the tied keys is unspecified, so those rows are re-selected by a
    stable sort, which keeps equal scores in index order (the lower index wins, as in the C kernel
    and the reference). Ties happen in practice: equal tokens give equal routing vectors when the
    router ignores position."""
    if values.shape[-1] > take:
        ambiguous = (values[..., take - 1] == values[..., take]) & (values[..., take - 1] > float("-inf"))
        values, chosen = values[..., :take], chosen[..., :take]
        if bool(ambiguous.any()):
            rows = scores[ambiguous]  # [n, width]
            order = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :take]
            chosen = chosen.clone()
            values = values.clone()
            chosen[ambiguous] = order
            values[ambiguous] = rows.gather(-1, order)
    return values, chosen


def _one_dim_dominates(route_k: Tensor, ratio: float = 8.0) -> bool:
    """Whether one routing dim's largest |k| exceeds `ratio` x the median over dims of the largest
    |k_d| (in some routing row), eagerly only. Such a dim — the `topk` layer's recency feature, the
    key position itself, up to T — makes the speculative kernel's bf16 prefilter margin
    (proportional to Σ_d |q_d|·max_j |k_jd|) wide enough to pass most keys: measured at T = 16384
    with the layer's own routing vectors, 7.9 s against the tiled kernel's 3.0 s (same selection);
    on vectors without such a dim the speculative kernel is 1.5-2x faster. The AVX2 build's exact
    prefilter has no margin, but its threshold guess (K-th best / |q| of the last block) lags the
    position term: at T = 16384, ROUTEFORMER_ISA=avx2, r = 16 + a position dim, 2.5-7 s against the
    tiled kernel's newest-first scan's 0.4-1.5 s. Under torch.compile the
    speculative kernel is kept (a host read here would break the graph) unless the caller says
    which dim holds positions (`route_topk(position_dim=True)`, as the `topk` layer does)."""
    if torch.compiler.is_compiling() or route_k.numel() == 0:
        return False
    largest = route_k.detach().abs().amax(dim=2).float()  # [B, R, r]
    return bool((largest.amax(-1) > ratio * largest.median(-1).values).any())


def _route_topk_native(
    native, route_q: Tensor, route_k: Tensor, slots: int, causal: bool, key_mask: Tensor | None,
    local_window: int, global_tokens: int, position_dim: bool = False,
) -> tuple[Tensor, Tensor, int]:
    """`route_topk` by the fused C kernels (ops/native/topk.py, custom ops): same contract; forced
    keys first in a row. float32, bfloat16 (read as stored) and float16 (widened) take the
    speculative kernel where the library has one (AVX-512 BF16: a bf16 prefilter; AVX2 + FMA: exact
    fp32 scores) except on rows with a dominant or declared position dim, float64 the tiled kernel;
    both select the same keys. The product count is the kernel's closed form; queries whose threshold guess is
    refuted and routed again (~0.1% on random routing vectors) are not counted twice."""
    batch, heads, length, _ = route_q.shape
    num_keys = route_k.shape[2]
    tile = native.route_topk_chunk()
    query_tile = speculative_query_tile() if route_q.dtype != torch.float64 else 0
    if query_tile and not position_dim and not _one_dim_dominates(route_k):
        if route_q.dtype == torch.float16:
            route_q, route_k = route_q.float(), route_k.float()
        mask = None if key_mask is None else key_mask.to(torch.uint8)
        index, valid = route_topk_rows_op(route_q, route_k, mask, heads, slots, causal, local_window,
                                          global_tokens)
        stride = -(-num_keys // tile) * tile
        return index, valid, route_topk_scored(batch * heads, length, stride, causal, tile, query_tile)
    # [B, R, S' / V, r, V]: tiles of V keys, each transposed (see the kernel's layout note).
    stride = -(-num_keys // tile) * tile
    keys_t = F.pad(route_k, (0, 0, 0, stride - num_keys)).unflatten(2, (stride // tile, tile))
    keys_t = keys_t.transpose(-1, -2).contiguous()
    mask = None if key_mask is None else key_mask.to(torch.uint8)
    # A position dim (recency): the newest keys score best, so scanning them first sets a high
    # threshold at once (topk_kernels.c).
    index, valid = route_topk_op(route_q, keys_t, mask, heads, num_keys, slots, causal, local_window,
                                 global_tokens, position_dim)
    scored = route_topk_scored(batch * heads, length, stride, causal, tile, native.route_topk_query_tile())
    return index, valid, scored


def add_random_slots(
    index: Tensor, valid: Tensor, count: int, *, causal: bool, key_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Append `count` exploration slots per query holding uniformly random eligible keys.

    A random key already in the row (or a padded key) is marked invalid rather than redrawn, so
    the slot count stays fixed and the result keeps the distinct-keys contract.
    """
    if count <= 0:
        return index, valid
    batch, heads, length, _ = index.shape
    num_keys = length if causal or key_mask is None else key_mask.shape[1]
    uniform = torch.rand(batch, heads, length, count, generator=generator, device=index.device)
    if causal:
        limit = torch.arange(1, length + 1, device=index.device).view(1, 1, length, 1)
    else:
        limit = torch.full((1, 1, 1, 1), num_keys, device=index.device)
    extra = (uniform * limit).long().clamp_max(limit - 1)
    duplicate = ((extra.unsqueeze(-1) == index.unsqueeze(-2)) & valid.unsqueeze(-2)).any(dim=-1)
    # Two random slots may draw the same key: keep the first.
    earlier = (extra.unsqueeze(-1) == extra.unsqueeze(-2)).tril(diagonal=-1).any(dim=-1)
    ok = ~duplicate & ~earlier
    if key_mask is not None:
        ok = ok & key_mask[:, None, None, :].expand(batch, heads, length, -1).gather(-1, extra)
    return torch.cat([index, extra], dim=-1), torch.cat([valid, ok], dim=-1)
