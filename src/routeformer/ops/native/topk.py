"""The `topk` layer's C kernels (topk_kernels.c) as `torch.library` custom ops.

Axes: B batch, R routing heads (1 when every head shares one routing), H heads, T queries, S keys,
K slots, r routing dim, d key dim, e value dim, V the kernel's key tile.

- `routeformer::route_topk`: each query's K best keys (no gradient: a hard choice).
- `routeformer::route_topk_rows`: the same selection for float32 and bfloat16 routing vectors by the
  speculative kernel (topk_speculative_kernels.c: verified threshold guesses; a bf16 prefilter with
  exact fp32 rescoring on AVX-512 BF16, exact fp32 scores on AVX2), which reads bfloat16 as stored.
- `routeformer::routed_attention`: softmax attention over each query's gathered keys -> (out, lse),
  differentiable in q, k, v through `routeformer::routed_attention_backward`.

As custom ops with fake (shape-only) implementations, torch.compile keeps them in its graphs
instead of tracing the PyTorch twins (ops/topk/routing.py, ops/topk/gathered.py). bfloat16 is read as
stored by the routing and attention kernels (fp32 arithmetic); float16 is computed in float32 (see
`widened`). Outputs come back in the input's dtype, except the log-sum-exp, which stays in float32
so the backward rebuilds the weights to fp32 accuracy.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

import routeformer.ops.native as _native
from routeformer.ops._compile_marks import assume_constant_result
from routeformer.ops.native import compute_dtype, declare, kernel, native_op, pointer, suffix, widened

_PTR, _INT, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
# The C boundary of topk_kernels.c, topk_speculative_kernels.c and topk_bf16_attention_kernels.c, each
# signature written once (checked against the C prototypes by `kernel`):
# queries, keys_t, key_mask, rows, heads, length, num_keys, stride, dim, slots, causal, local_window,
# global_tokens, newest_first, index, valid, threads -> keys scored
declare(_INT, [_PTR, _PTR, _PTR, *[_INT] * 7, _I32, _INT, _INT, _I32, _PTR, _PTR, _I32],
        "route_topk_f32", "route_topk_f64")
# queries, keys, bf16, key_mask, rows, heads, length, num_keys, dim, slots, causal, local_window,
# global_tokens, index, valid, threads -> 0, or < 0 when the kernel cannot serve
declare(_INT, [_PTR, _PTR, _I32, _PTR, *[_INT] * 6, _I32, _INT, _INT, _PTR, _PTR, _I32], "route_topk_spec")
declare(_INT, [], "route_topk_spec_available", "route_topk_spec_query_tile", "route_topk_spec_refuted",
        "route_topk_spec_exact_rows", "route_topk_spec_exact")
# queries, groups, members, starts, key_group, key_mask, rows, heads, length, count, dim, slots,
# local_window, global_tokens, index, valid, threads -> scores computed (topk_groups_kernels.c)
declare(_INT, [*[_PTR] * 6, *[_INT] * 8, _PTR, _PTR, _I32], "route_topk_groups")
# q, k, v, index, valid, batch, heads, length, keys, dim, value_dim, slots, index strides (2), scale,
# out, lse, threads
declare(None, [*[_PTR] * 5, *[_INT] * 9, _F64, _PTR, _PTR, _I32],
        "routed_attention_f32", "routed_attention_f64", "routed_attention_bf16")
# q, k, v, index, valid, out, lse, grad_out, (the 9 sizes and strides), scale, grad_q, grad_k, grad_v, threads
declare(None, [*[_PTR] * 8, *[_INT] * 9, _F64, _PTR, _PTR, _PTR, _I32],
        "routed_attention_backward_f32", "routed_attention_backward_f64", "routed_attention_backward_bf16")
declare(_INT, [], "routed_attention_bf16_max_dim")
# score, key, n, m -> the m-th largest score, the m best (ties: lower key) moved to the front: the
# selection both routing kernels flush their candidates with (tests call it directly)
declare(ctypes.c_float, [_PTR, _PTR, _INT, _INT], "route_topk_keep_best_f32")


def kernel_layout(index: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """index and valid as the kernels read them: row (b, h) at b·stride(0) + h·stride(1) (0 when
    every head shares one routing), each row's slots contiguous, the same strides for both."""
    if index.stride()[2:] != (index.shape[-1], 1) or valid.stride() != index.stride():
        return index.contiguous(), valid.contiguous()
    return index, valid


# -- routing ------------------------------------------------------------------------------------
@native_op("route_topk")
def route_topk_op(queries: Tensor, keys_t: Tensor, key_mask: Tensor | None, heads: int, num_keys: int,
                  slots: int, causal: bool, local_window: int, global_tokens: int,
                  newest_first: bool = False) -> tuple[Tensor, Tensor]:
    """queries [B, R, T, r]; keys_t [B, R, S'/V, r, V] (tiles of V keys, each transposed, S' >= S
    padded); key_mask uint8 [B, S] or None -> (index long [B, R, T, K], valid bool [B, R, T, K]);
    forced keys first in a row, invalid slots point at key 0. `newest_first` scans the keys from
    the newest (for scores that grow with the key position; see topk_kernels.c): the same set."""
    batch, routes, length, dim = queries.shape
    tile = int(_native.kernel("route_topk_chunk")())  # a query, not a kernel call
    if keys_t.shape[-1] != tile or keys_t.shape[2] * tile < num_keys:
        # the kernel reads whole tiles: a narrower one would be read past its end
        raise ValueError(f"route_topk: keys_t must hold tiles of {tile} keys covering num_keys={num_keys}; "
                         f"got shape {tuple(keys_t.shape)}")
    queries, keys_t = widened(queries).contiguous(), widened(keys_t).contiguous()
    mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
    index = torch.empty(batch, routes, length, slots, dtype=torch.long, device=queries.device)
    valid = torch.empty(batch, routes, length, slots, dtype=torch.bool, device=queries.device)
    stride = keys_t.shape[2] * keys_t.shape[4]
    kernel(f"route_topk_{suffix(queries.dtype)}")(
        pointer(queries), pointer(keys_t), pointer(mask), batch * routes, heads, length, num_keys, stride,
        dim, slots, int(causal), local_window, global_tokens, int(newest_first), pointer(index),
        valid.data_ptr(), torch.get_num_threads())
    return index, valid


@route_topk_op.op.register_fake
def _route_topk_fake(queries, keys_t, key_mask, heads, num_keys, slots, causal, local_window, global_tokens,
                     newest_first=False):
    shape = (*queries.shape[:3], slots)
    return queries.new_empty(shape, dtype=torch.long), queries.new_empty(shape, dtype=torch.bool)


@assume_constant_result  # traced as a constant: no ctypes call inside a graph
def speculative_query_tile() -> int:
    """Queries per tile of the speculative routing kernel (topk_speculative_kernels.c), 0 when the
    library was built without AVX2 + FMA (the portable level) and route_topk_f32 serves float32 and
    bfloat16 instead."""
    return _speculative_query_tile()


@assume_constant_result
def speculative_prefilter_exact() -> bool:
    """Whether the speculative kernel's prefilter scores keys exactly (fp32, AVX2 + FMA or AVX-512
    without BF16: no margin, so no routing vectors make it pass most keys) rather than by the
    AVX-512 BF16 approximation with a margin (see `_one_dim_dominates` in ops/topk/routing.py)."""
    return _speculative_prefilter_exact()


@cache
def _speculative_query_tile() -> int:
    query = _native.kernel  # (not this module's `kernel`, which tests count as kernel calls)
    return int(query("route_topk_spec_query_tile")()) if query("route_topk_spec_available")() else 0


@cache
def _speculative_prefilter_exact() -> bool:
    return bool(_native.kernel("route_topk_spec_exact")())


@native_op("route_topk_rows")
def route_topk_rows_op(queries: Tensor, keys: Tensor, key_mask: Tensor | None, heads: int, slots: int,
                       causal: bool, local_window: int, global_tokens: int) -> tuple[Tensor, Tensor]:
    """The routing of `route_topk_op` (the same selection as its float32 kernel, bit for bit) by the
    speculative kernel: queries [B, R, T, r], keys [B, R, S, r] row-major, both float32 or both
    bfloat16 (read as stored: no fp32 copy is made here); key_mask uint8 [B, S] or None.
    Needs `speculative_query_tile() > 0` and r <= 64."""
    batch, routes, length, dim = queries.shape
    if keys.dtype != queries.dtype or queries.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"route_topk_rows: queries and keys must both be float32 or bfloat16; got "
                         f"{queries.dtype} and {keys.dtype}")
    queries, keys = queries.contiguous(), keys.contiguous()
    mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
    index = torch.empty(batch, routes, length, slots, dtype=torch.long, device=queries.device)
    valid = torch.empty(batch, routes, length, slots, dtype=torch.bool, device=queries.device)
    done = kernel("route_topk_spec")(
        pointer(queries), pointer(keys), int(queries.dtype == torch.bfloat16), pointer(mask), batch * routes,
        heads, length, keys.shape[2], dim, slots, int(causal), local_window, global_tokens, pointer(index),
        valid.data_ptr(), torch.get_num_threads())
    if done < 0:
        raise ValueError(f"route_topk_rows: routing dim must be 1..64, and the library built with AVX2 + FMA "
                         f"or AVX-512 BF16 (`routeformer doctor`); got dim {dim}")
    return index, valid


@route_topk_rows_op.op.register_fake
def _route_topk_rows_fake(queries, keys, key_mask, heads, slots, causal, local_window, global_tokens):
    shape = (*queries.shape[:3], slots)
    return queries.new_empty(shape, dtype=torch.long), queries.new_empty(shape, dtype=torch.bool)


def route_topk_scored(rows: int, length: int, stride: int, causal: bool, tile: int, query_tile: int) -> int:
    """The routing products the kernel executes (as it counts them): all `query_tile` rows of a
    query tile, keys up to a whole key tile past the tile's last query (causal) or all keys.
    Plain int arithmetic (no tensors: under torch.compile a tensor sum read back would break the
    graph, and a Python loop over the T / query_tile tiles costs on every forward)."""
    blocks = -(-length // query_tile)
    if not causal:
        return rows * blocks * query_tile * stride
    # tile t (1-based) stops at min(t·query_tile, length); its keys round up to whole key tiles:
    # Σ_t ceil(t·q / tile) over the whole tiles, in O(log) by the floor sum, plus a partial last one.
    whole = length // query_tile
    keys = tile * _floor_sum(whole, tile, query_tile, query_tile + tile - 1)
    if blocks > whole:
        keys += -(-length // tile) * tile
    return rows * query_tile * keys


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """Σ_{i=0}^{n-1} floor((a·i + b) / m) for n, m >= 1 and a, b >= 0 (the Euclid-like reduction:
    each step swaps the roles of a and m, so it takes O(log m) steps)."""
    total = 0
    while n > 0:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


# -- attention over the routed keys ---------------------------------------------------------------
BF16_MAX_DIM = 512  # head dims the bf16 kernels (topk_bf16_attention_kernels.c) hold on the stack


def reads_bf16(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the attention kernels read these as bfloat16 (no fp32 copies): all three bf16, head
    dims <= BF16_MAX_DIM."""
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16
            and max(q.shape[-1], v.shape[-1]) <= BF16_MAX_DIM)


@native_op("routed_attention")
def routed_attention_op(q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor,
                        scale: float) -> tuple[Tensor, Tensor]:
    """q [B, H, T, d], k [B, H, S, d], v [B, H, S, e], index long / valid bool [B, H, T, K] (heads may
    have stride 0) -> (out [B, H, T, e] in q's dtype, lse [B, H, T] in the compute dtype)."""
    batch, heads, length, dim = q.shape
    dtype = q.dtype
    index, valid = kernel_layout(index, valid)
    if reads_bf16(q, k, v):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out = q.new_empty(batch, heads, length, v.shape[-1])
        lse = q.new_empty(batch, heads, length, dtype=torch.float32)
        kernel("routed_attention_bf16")(
            pointer(q), pointer(k), pointer(v), index.data_ptr(), valid.data_ptr(), batch, heads, length,
            k.shape[2], dim, v.shape[-1], index.shape[-1], index.stride(0), index.stride(1), scale,
            pointer(out), pointer(lse), torch.get_num_threads())
        return out, lse
    q, k, v = (widened(t).contiguous() for t in (q, k, v))
    out = q.new_empty(batch, heads, length, v.shape[-1])
    lse = q.new_empty(batch, heads, length)
    kernel(f"routed_attention_{suffix(q.dtype)}")(
        pointer(q), pointer(k), pointer(v), index.data_ptr(), valid.data_ptr(), batch, heads, length,
        k.shape[2], dim, v.shape[-1], index.shape[-1], index.stride(0), index.stride(1), scale,
        pointer(out), pointer(lse), torch.get_num_threads())
    return out.to(dtype), lse


@routed_attention_op.op.register_fake
def _routed_attention_fake(q, k, v, index, valid, scale):
    batch, heads, length, _ = q.shape
    return (q.new_empty(batch, heads, length, v.shape[-1]),
            q.new_empty(batch, heads, length, dtype=compute_dtype(q.dtype)))


@native_op("routed_attention_backward")
def routed_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v), each in its input's dtype, from the forward's out and lse."""
    batch, heads, length, dim = q.shape
    dtypes = (q.dtype, k.dtype, v.dtype)
    index, valid = kernel_layout(index, valid)
    if reads_bf16(q, k, v) and out.dtype == grad_out.dtype == torch.bfloat16:
        q, k, v, out, grad_out = (t.contiguous() for t in (q, k, v, out, grad_out))
        lse = lse.float().contiguous()
        grad_q = torch.empty(q.shape, dtype=torch.float32)  # fp32 accumulators, narrowed below
        grad_k, grad_v = torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)
        kernel("routed_attention_backward_bf16")(
            *(pointer(t) for t in (q, k, v)), index.data_ptr(), valid.data_ptr(), pointer(out), pointer(lse),
            pointer(grad_out), batch, heads, length, k.shape[2], dim, v.shape[-1], index.shape[-1],
            index.stride(0), index.stride(1), scale, pointer(grad_q), pointer(grad_k), pointer(grad_v),
            torch.get_num_threads())
        return tuple(grad.to(dtype) for dtype, grad in zip(dtypes, (grad_q, grad_k, grad_v), strict=True))
    work = compute_dtype(q.dtype)
    q, k, v, out, grad_out = (widened(t).contiguous() for t in (q, k, v, out, grad_out))
    lse = lse.to(work).contiguous()
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kernel(f"routed_attention_backward_{suffix(work)}")(
        pointer(q), pointer(k), pointer(v), index.data_ptr(), valid.data_ptr(), pointer(out), pointer(lse),
        pointer(grad_out), batch, heads, length, k.shape[2], dim, v.shape[-1], index.shape[-1],
        index.stride(0), index.stride(1), scale, pointer(grad_q), pointer(grad_k), pointer(grad_v),
        torch.get_num_threads())
    return tuple(grad.to(dtype) for dtype, grad in zip(dtypes, (grad_q, grad_k, grad_v), strict=True))


@routed_attention_backward_op.op.register_fake
def _routed_attention_backward_fake(q, k, v, index, valid, out, lse, grad_out, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as computed


def _routed_attention_setup(ctx, inputs, output):
    q, k, v, index, valid, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, index, valid, out, lse)
    ctx.scale = scale


def _routed_attention_backward(ctx, grad_out, _grad_lse):
    # lse is returned detached by ops/topk/gathered.py: it has no gradient.
    q, k, v, index, valid, out, lse = ctx.saved_tensors
    # Always the op (never the bare function): under AOT tracing the tensors are fake.
    grad_q, grad_k, grad_v = routed_attention_backward_op.op(q, k, v, index, valid, out, lse,
                                                             grad_out.contiguous(), ctx.scale)
    return grad_q, grad_k, grad_v, None, None, None


routed_attention_op.op.register_autograd(_routed_attention_backward, setup_context=_routed_attention_setup)


def route_topk_groups(queries: Tensor, groups: Tensor, members: Tensor, starts: Tensor, key_group: Tensor,
                      key_mask: Tensor | None, heads: int, slots: int, local_window: int,
                      global_tokens: int) -> tuple[Tensor, Tensor]:
    """Causal routing by groups of equal keys (topk_groups_kernels.c; eager only, no custom op):
    queries [N, T, r] and groups [N, U, r] float32, members / key_group [N, T] and starts
    [N, U + 1] int64 as ops/topk/repeated.py builds them, key_mask [B, T] or None ->
    (index [N, T, slots] long, valid bool), the selection of route_topk_f32."""
    rows, length, dim = queries.shape
    tensors = [t.contiguous() for t in (queries, groups, members, starts, key_group)]
    mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
    index = torch.empty(rows, length, slots, dtype=torch.long)
    valid = torch.empty(rows, length, slots, dtype=torch.bool)
    done = kernel("route_topk_groups")(
        *map(pointer, tensors), pointer(mask), rows, heads, length, groups.shape[1], dim, slots, local_window,
        global_tokens, pointer(index), valid.data_ptr(), torch.get_num_threads())
    if done < 0:
        raise ValueError(f"route_topk_groups: bad sizes (rows {rows}, length {length}, dim {dim}, "
                         f"slots {slots})")
    return index, valid

