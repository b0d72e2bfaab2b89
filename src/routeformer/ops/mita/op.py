"""MiTA: compress-and-route attention with landmark queries and top-k deformable experts.

Axes: B batch, H heads, N length, d head dim (e value dim), E experts (= landmarks), K keys per
expert (top-k width), R routed experts per query, C causal blocks of b tokens, M landmark window.

Bidirectional (Wen et al., arXiv 2602.01219, Eqs. 5-10):
  1. landmarks L [E, d]: the queries average-pooled over E uniformly spaced windows of the real
     tokens (1-D adaptive pooling; 2-D over `grid=(h, w)`); the first `extra_tokens` tokens (a CLS
     token) are left out of the pooling and are otherwise ordinary queries and keys;
  2. scores S = L Kᵀ·scale [E, N]; expert j = the top-K keys of landmark j;
  3. shared expert: landmark values V̂ = softmax(S) V; the landmarks are its keys;
  4. routing: each query goes to its top-R experts by q·Lᵀ (the same logits as the shared expert's);
  5. out = softmax over the concatenation [shared expert's E pairs; the R·K routed pairs] (a key in
     two routed experts counts twice, as in the concatenation).
Steps 1-3 are ops/mita/landmarks.py (chunked, O(N·d) memory); step 5 is ops/mita/experts.py: each
part returns its output and log-sum-exp and `merge_partials` combines them (R = 1: one fused SDPA
call per expert over [shared pairs; its K pairs]). Nothing of size N×N exists.

Causal (ours; for language models) is a streaming layer: the sequence is cut into blocks of a fixed
`block` = b tokens (not N / E: the layout must not depend on the total length, so that training,
evaluation at any length and token-by-token generation compute one function). Landmark j pools the
queries of block j once the block is complete. A query in block c reads

      keys:      block 0     block 1     block 2     block 3 (c = 3)
    shared:      L0,V̂0       L1,V̂1       L2,V̂2        ·            landmarks of the M most recent
    routed:      top-R of experts 0..2, expert j = top-K keys of blocks ≤ j      completed blocks
    local:                                           k₃₀ .. k_t   exact causal, own block only

with M = `landmarks` (a cap: the landmarks of blocks c − M .. c − 1; fewer exist early in the
sequence). Landmark j and expert j only hold queries and keys of positions < (j + 1)·b ≤ c·b, all
before the query; block 0 reads only itself. The output at position t depends on tokens ≤ t only,
and not on N. Cost O(N·(b + M + R·K)·d) for the queries plus the landmark stage, whose landmark j
scores the (j + 1)·b keys before it: N²/(2b) score pairs in all (1/b of full attention's), computed
in chunks with O(N·d) memory. K larger than the keys a landmark may read (early blocks) leaves the
rest of its expert empty; M larger than the completed blocks reads all of them; b larger than N
makes the whole input one block, i.e. exact causal attention — each is the streaming definition,
not a clamp.

Causal query side, two implementations (`ops.backends.mita_causal_backend` picks): the PyTorch parts
(own block by `local_causal_part`, the shared window by `attend_part`, the routed experts packed by
expert by `routed_parts`, merged by their log-sum-exps) — the twin, and the path for padded inputs,
R > 1 and non-CPU tensors; and, for unpadded CPU fp32/fp64 inputs with R = 1, the C kernels of
native/mita_train_kernels.c (forward and backward), which read each query's b + M + K pairs under one
softmax in one pass per (batch, head). Both take the same routing decision (computed in PyTorch) and
the same landmark stage; tests/ops/test_mita_native.py compares their values and gradients, and both
against `mita_reference`. Their speed: docs/results/mita.md ("Causal MiTA op: C kernel against
the PyTorch parts").

Padding (`mask`): padded rows may hold anything (they are zeroed first: masked_fill, not a product,
since 0·NaN = NaN). The real tokens of each row are moved to its front (a stable gather; nothing
moves for right padding), so the layout — windows, blocks, landmark counts — is that of the real
tokens alone: landmarks average real tokens only, padded keys are never scored, routed to or
in the shared expert, and the real rows equal the unpadded sequence's. (With `grid` the token grid
fixes every token's window, so there the mask only excludes padded tokens from their windows.)

Low precision: fp16/bf16 inputs are computed in fp32 (block-sized temporaries; scores, softmax,
log-sum-exp merges) and the output cast back, so the MASKED constant never meets fp16. Under
torch.autocast the op switches autocast off inside (its matmuls would otherwise run in bf16/fp16
again, landmark scores and routing logits included: bidirectional MiTA under CPU bf16 autocast
was 0.33 from fp32 in relative norm, and NaN in a layer); the output has the input's dtype.

`mita_reference` (ops/mita/reference.py) builds the same key set per query as a dense [N, E + N]
logit matrix (a key held by c routed experts gets log c added) and applies one plain softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.attention_lse import MASKED, merge_partials
from routeformer.ops.backends import NATIVE, mita_causal_backend, profile_range
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.mita.checks import check_mita_args, grid_pool_shape
from routeformer.ops.mita.experts import (
    attend_part,
    fused_single_route,
    gather_experts,
    local_causal_part,
    routed_parts,
)
from routeformer.ops.mita.landmarks import (
    landmark_attention,
    landmark_key_limit,
    landmark_pairs,
    pool_landmarks,
)
from routeformer.ops.native.mita import route_by_maximum, single_route

__all__ = ["DEFAULT_BLOCK", "DEFAULT_PACK", "MitaResult", "check_mita_args", "grid_pool_shape",
           "mita_attention"]

class _Routed(NamedTuple):
    """(values, indices) of the routed experts, as torch.topk returns them."""

    values: Tensor
    indices: Tensor


DEFAULT_PACK = 64  # queries per packed block of one expert (measured: 64-128 fastest at N >= 16k)
DEFAULT_BLOCK = 64  # causal block length b: tokens per landmark (the pre-streaming m = 8 at T = 512)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class MitaResult:
    out: Tensor  # [B, H, N, e]
    flops: int  # executed attention FLOPs (landmark scores, shared, routed, local)
    expert_load: Tensor  # [E]: fraction of (query, routed slot) pairs each expert received


# -- padding: the real tokens of each row first ---------------------------------------------------
def _compaction(mask: Tensor) -> Tensor | None:
    """Long [B, N]: a stable order putting each row's real tokens first; None if they already are."""
    lengths = mask.sum(1, keepdim=True)
    if bool((mask == (torch.arange(mask.shape[1], device=mask.device) < lengths)).all()):
        return None
    return torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)


def _take_tokens(t: Tensor, order: Tensor) -> Tensor:
    """t [B, H, N, d] with its tokens in `order` [B, N] (a gather: the backward scatters back)."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


# -- the two builds ---------------------------------------------------------------------------------
def _pack_size(pack: int, length: int, routes: int, experts: int) -> int:
    # Short inputs route a few queries to each expert: packs no larger than that average keep the
    # padding (which is executed work) below about half of the packed slots.
    per_expert = max(1.0, length * routes / max(1, experts))
    return min(pack, 1 << int(math.log2(per_expert)))


def _bidirectional(q, k, v, real, key_real, *, landmarks, topk, route, shared, grid, extra_tokens,
                   scale, pack):
    batch, heads, length, dim = q.shape
    value_dim = v.shape[-1]
    with _routing():
        landmark, landmark_valid = pool_landmarks(q, real, landmarks, block=None, grid=grid,
                                                  extra_tokens=extra_tokens)
        experts = landmark.shape[2]
        limit = real.sum(1, keepdim=True).expand(-1, experts) if key_real is None else \
            torch.full((batch, experts), length, device=q.device)
        landmark_values, top_index, top_valid = landmark_attention(
            landmark, k, v, limit, topk=topk, scale=scale, key_real=key_real)
    pairs = landmark_pairs(limit, batch * heads * length)
    flops = batch * heads * dense_attention_flops(pairs, dim, value_dim)

    eligible = landmark_valid[:, None, None, :]  # broadcasts to [B, H, N, E]
    if bool(eligible.all()):
        eligible = None  # every query may use every landmark: no masking anywhere below
    width, routes = top_index.shape[-1], min(route, experts)
    pack = _pack_size(pack, length, routes, experts)
    fused = width > 0 and routes == 1
    parts = []
    if shared and not fused:
        # The kernel recomputes q·Lᵀ next to the routing logits: cheaper on CPU than a
        # materialised softmax over the routing logits (Eq. 9's reuse), and counted as executed.
        parts.append(attend_part(q, landmark, landmark_values, eligible, scale))
        flops += batch * heads * dense_attention_flops(length * experts, dim, value_dim)
    counts = torch.zeros(batch * heads * experts, dtype=torch.long, device=q.device)
    if width > 0:
        expert_valid = top_valid & landmark_valid[:, None, :, None]
        expert_keys, expert_values = gather_experts(k, v, top_index)
        query_logits = q @ (landmark * scale).transpose(-1, -2)  # routing logits [B, H, N, E]
        flops += batch * heads * 2 * length * experts * dim
        if eligible is not None:
            query_logits = query_logits.masked_fill(~eligible, MASKED)
        if routes == 1:  # the maximum (a top-1 without the selection machinery), in C where it can
            maximum = route_by_maximum(query_logits)
            routed = _Routed(*maximum) if maximum is not None else query_logits.max(dim=-1, keepdim=True)
        else:
            routed = query_logits.topk(routes, dim=-1)
        slot_valid = routed.values > MASKED / 2
        if fused:
            native = single_route(
                q, query_logits if shared else None, landmark_values,
                None if eligible is None else landmark_valid, expert_keys, expert_values,
                None if bool(expert_valid.all()) else expert_valid, routed.indices[..., 0],
                slot_valid[..., 0], scale)
            if native is not None:  # inference: the C kernel (ops/native/mita.py)
                items = int(slot_valid.sum())
                flops += dense_attention_flops(items * ((experts if shared else 0) + width),
                                                           dim, value_dim)
                return native[0], flops, native[1], experts
            out, fused_flops, counts = fused_single_route(
                q, landmark, landmark_values, None if eligible is None else landmark_valid,
                expert_keys, expert_values, None if bool(expert_valid.all()) else expert_valid,
                routed.indices, slot_valid, shared, scale, pack)
            return out, flops + fused_flops, counts, experts
        routed_out, routed_lse, routed_flops, counts = routed_parts(
            q, expert_keys, expert_values, expert_valid, routed.indices, slot_valid, scale, pack)
        parts.extend((routed_out[:, :, :, slot], routed_lse[:, :, :, slot]) for slot in range(routes))
        flops += routed_flops
    return merge_partials(parts), flops, counts, experts


def _routing():
    """The profiler range `routeformer bench layers --split` counts as routing: landmark pooling, the
    landmark stage (scores, top-K key selection and, in the same pass, the shared values) and each
    query's expert choice."""
    return profile_range("routing")


def _causal(q, k, v, real, *, landmarks, topk, route, shared, block, scale, pack):
    batch, heads, length, dim = q.shape
    value_dim = v.shape[-1]
    with _routing():
        landmark, landmark_valid = pool_landmarks(q, real, landmarks, block=block, grid=None, extra_tokens=0)
    experts = landmark.shape[2]  # completed blocks some query reads: ⌈N/b⌉ − 1
    unpadded = bool(real.all())
    native = experts > 0 and mita_causal_backend(q, k, v, padded=not unpadded, routes=route)[0] == NATIVE
    if native:
        local_out = local_lse = None
        flops = batch * heads * dense_attention_flops(_local_pairs(length, block), dim, value_dim)
    else:
        local_out, local_lse, flops = local_causal_part(q, k, v, None if unpadded else real, block, scale)
    counts = torch.zeros(batch * heads * experts, dtype=torch.long, device=q.device)
    if experts == 0:  # one block: exact causal attention
        return local_out, flops, counts, experts
    parts = [(local_out, local_lse)]
    limit = landmark_key_limit(real.sum(1), experts, block)
    with _routing():
        landmark_values, top_index, top_valid = landmark_attention(landmark, k, v, limit, topk=topk,
                                                                   scale=scale)
    pairs = landmark_pairs(limit, batch * heads * length)
    flops += batch * heads * dense_attention_flops(pairs, dim, value_dim)
    if native:
        out, query_flops, counts = _causal_native(q, k, v, landmark, landmark_values, top_index, top_valid,
                                                  landmarks=landmarks, shared=shared, block=block,
                                                  scale=scale)
        return out, flops + query_flops, counts, experts

    # The landmark window of every block c: blocks c − M .. c − 1 ([C, M], −M..−1 for block 0).
    blocks, window = experts + 1, min(landmarks, experts)
    window_index = (torch.arange(blocks, device=q.device)[:, None] - window
                    + torch.arange(window, device=q.device)[None, :])
    window_ok = (window_index >= 0) & landmark_valid[:, window_index.clamp_min(0)]  # [B, C, M]
    window_index = window_index.clamp_min(0)
    window_ok = window_ok[:, None, :, None, :]  # [B, 1, C, 1, M]
    window_landmarks = landmark[:, :, window_index]  # [B, H, C, M, d]
    pad = blocks * block - length
    query_blocks = F.pad(q, (0, 0, 0, pad)).view(batch, heads, blocks, block, dim)

    def unblock(t: Tensor) -> Tensor:  # [B, H, C, b, ...] -> [B, H, N, ...]
        return t.reshape(batch, heads, blocks * block, *t.shape[4:])[:, :, :length]

    if shared:
        allowed = window_ok.expand(batch, heads, blocks, 1, window).reshape(batch, heads * blocks, 1, window)
        out, lse = attend_part(query_blocks.flatten(1, 2), window_landmarks.flatten(1, 2),
                               landmark_values[:, :, window_index].flatten(1, 2), allowed, scale)
        parts.append((unblock(out.view(batch, heads, blocks, block, value_dim)),
                      unblock(lse.view(batch, heads, blocks, block))))
        flops += batch * heads * dense_attention_flops(blocks * block * window, dim, value_dim)
    width = top_index.shape[-1]
    if width > 0:
        routes = min(route, window)
        with _routing():
            query_logits = query_blocks @ (window_landmarks * scale).transpose(-1, -2)  # [B, H, C, b, M]
            routed = query_logits.masked_fill(~window_ok, MASKED).topk(routes, dim=-1)
            expert = window_index[None, None, :, None, :].expand(batch, heads, -1, block, -1)
            assignment = unblock(expert.gather(-1, routed.indices))  # global expert index [B, H, N, R]
            slot_valid = unblock(routed.values > MASKED / 2)
        flops += batch * heads * 2 * blocks * block * window * dim
        expert_keys, expert_values = gather_experts(k, v, top_index)
        expert_valid = top_valid & landmark_valid[:, None, :, None]
        routed_out, routed_lse, routed_flops, counts = routed_parts(
            q, expert_keys, expert_values, expert_valid, assignment, slot_valid, scale,
            _pack_size(pack, length, routes, experts))
        parts.extend((routed_out[:, :, :, slot], routed_lse[:, :, :, slot]) for slot in range(routes))
        flops += routed_flops
    return merge_partials(parts), flops, counts, experts


def _local_pairs(length: int, block: int) -> int:
    """(query, key) pairs of the own-block causal part: a triangle per block."""
    full, rest = divmod(length, block)
    return full * block * (block + 1) // 2 + rest * (rest + 1) // 2


def _causal_native(q, k, v, landmark, landmark_values, top_index, top_valid, *, landmarks, shared, block,
                   scale):
    """The causal query side (own block, shared window, routed expert, R = 1, unpadded input) by the
    C kernels (ops/native/mita_train.py), forward and backward: what `_causal`'s PyTorch parts
    compute, under one softmax per query. Routing (no gradient: a hard argmax) is decided here, in
    PyTorch, exactly as the PyTorch path decides it. Returns (out, executed FLOPs, bucket counts)."""
    from routeformer.ops.native.mita_train import mita_causal_query_side

    batch, heads, length, dim = q.shape
    value_dim, experts = v.shape[-1], landmark.shape[2]
    blocks, window = experts + 1, min(landmarks, experts)
    width = top_index.shape[-1]
    rows_per_block = torch.full((blocks,), block, dtype=torch.long)
    rows_per_block[-1] = length - (blocks - 1) * block
    window_sizes = torch.arange(blocks).clamp_max(window)  # landmarks block c reads: min(c, M)
    pairs = batch * heads * int((rows_per_block * window_sizes).sum()) if shared else 0  # all groups
    flops = 0
    if width > 0:
        with torch.no_grad(), _routing():  # the logits only pick the expert (the kernel rescores them)
            window_index = (torch.arange(blocks, device=q.device)[:, None] - window
                            + torch.arange(window, device=q.device)[None, :])
            window_ok = window_index >= 0  # [C, M]; every landmark of an unpadded input is valid
            window_index = window_index.clamp_min(0)
            pad = blocks * block - length
            query_blocks = F.pad(q.detach(), (0, 0, 0, pad)).view(batch, heads, blocks, block, dim)
            window_landmarks = landmark.detach()[:, :, window_index] * scale  # [B, H, C, M, d]
            query_logits = query_blocks @ window_landmarks.transpose(-1, -2)  # [B, H, C, b, M]
            routed = query_logits.masked_fill(~window_ok[:, None, :], MASKED).topk(1, dim=-1)
            assignment = window_index[None, None, :, None, :].expand(batch, heads, -1, block, -1) \
                .gather(-1, routed.indices)
            assignment = torch.where(routed.values > MASKED / 2, assignment, -1)
            assignment = assignment.reshape(batch, heads, blocks * block)[:, :, :length].contiguous()
        flops += batch * heads * 2 * blocks * block * window * dim
        expert_keys, expert_values = gather_experts(k, v, top_index)
        key_ok = None if bool(top_valid.all()) else top_valid.to(torch.uint8)
        valid = assignment >= 0
        pairs += int(valid.sum()) * width  # (query, routed key) pairs of all groups
        group = torch.arange(batch * heads, device=q.device).view(batch, heads, 1) * experts
        counts = torch.bincount((group + assignment)[valid], minlength=batch * heads * experts)
    else:
        assignment = torch.full((batch, heads, length), -1, dtype=torch.long, device=q.device)
        expert_keys = q.new_zeros(batch, heads, experts, 0, dim)
        expert_values = v.new_zeros(batch, heads, experts, 0, value_dim)
        key_ok = None
        counts = torch.zeros(batch * heads * experts, dtype=torch.long, device=q.device)
    out, _ = mita_causal_query_side(q, k, v, landmark, landmark_values, expert_keys, expert_values, key_ok,
                                    assignment, block, window, shared, float(scale))
    flops += dense_attention_flops(pairs, dim, value_dim)
    return out, flops, counts


# -- the op -------------------------------------------------------------------------------------
def mita_attention(
    q: Tensor, k: Tensor, v: Tensor, *, landmarks: int = 25, topk: int = 25, route: int = 1,
    shared: bool = True, causal: bool = False, block: int | None = None,
    grid: tuple[int, int] | None = None, extra_tokens: int = 0, mask: Tensor | None = None,
    scale: float | None = None, pack: int = DEFAULT_PACK,
) -> MitaResult:
    """MiTA attention over q, k, v [B, H, N, d] (see the module docstring for the algorithm).

    landmarks: E, the landmark queries (= experts); causal: M, the most recent completed blocks
    whose landmarks a query reads. topk: K keys per expert (0 = Agent attention, compression
    only); route: R experts per query; shared: keep the shared compressed expert (False =
    route-only); block: the causal block length b (default DEFAULT_BLOCK; causal only); grid: (h, w)
    of an image token grid for 2-D pooling; extra_tokens: leading tokens (CLS) left out of the
    pooling; mask: bool key padding [B, N] (True = real). An empty input (B = 0 or N = 0) gives
    an empty output.
    """
    if torch.is_autocast_enabled(q.device.type):  # fp32 inside (see the module docstring)
        with torch.autocast(q.device.type, enabled=False):
            return mita_attention(q, k, v, landmarks=landmarks, topk=topk, route=route, shared=shared,
                                  causal=causal, block=block, grid=grid, extra_tokens=extra_tokens,
                                  mask=mask, scale=scale, pack=pack)
    check_qkv(q, k, v, mask, causal=True)  # MiTA is self-attention: as many queries as keys
    batch, heads, length, dim = q.shape
    check_mita_args(length if batch else 0, landmarks=landmarks, topk=topk, route=route, causal=causal,
                    grid=grid, extra_tokens=extra_tokens, block=block)
    check_positive("pack", pack)
    if not shared and topk == 0 and not causal:
        raise ValueError("shared=False with topk=0 leaves a query no key to attend to")
    block = (DEFAULT_BLOCK if block is None else block) if causal else None
    if batch == 0 or length == 0:
        return MitaResult(v * 0, 0, q.new_zeros(0))
    scale = dim ** -0.5 if scale is None else scale
    dtype = q.dtype
    if dtype in _LOW_PRECISION:  # fp32 scores, softmax and merges (see the module docstring)
        q, k, v = q.float(), k.float(), v.float()
    order, key_real = None, None
    if mask is None or (not torch.compiler.is_compiling() and bool(mask.all())):
        real = torch.ones(batch, length, dtype=torch.bool, device=q.device)
    else:
        q, k, v = (t.masked_fill(~mask[:, None, :, None], 0.0) for t in (q, k, v))
        real = mask
        if grid is None:
            order = _compaction(mask)
            if order is not None:
                q, k, v = (_take_tokens(t, order) for t in (q, k, v))
                real = real.gather(1, order)
        else:
            key_real = mask
    options = {"landmarks": landmarks, "topk": topk, "route": route, "shared": shared, "scale": scale,
               "pack": pack}
    if causal:
        out, flops, counts, experts = _causal(q, k, v, real, block=block, **options)
    else:
        out, flops, counts, experts = _bidirectional(q, k, v, real, key_real, grid=grid,
                                                     extra_tokens=extra_tokens, **options)
    if order is not None:
        out = _take_tokens(out, torch.argsort(order, dim=1))
    load = counts.view(-1, experts).sum(0).to(out.dtype) if experts else out.new_zeros(0)
    return MitaResult(out.to(dtype), int(flops), load / load.sum().clamp_min(1))


# -- the specification ----------------------------------------------------------------------------
