"""The experts evaluated at selected query rows only (the hard-routing paths of `meta`).

Axes: B batch, H heads, T length, M selected rows, d head dim (e value dim), N chunks,
C packed rows per chunk.

Hard routing sends each token to one expert, so an expert must answer for a subset of the query
rows while reading every key the causal rule allows. Each op here takes the whole key/value
sequence k, v [B, H, T, d] but only the selected queries q_rows [B, H, M, d], with their
positions `rows` [B, M] (ascending) and `valid` [B, M] (batch rows select different counts, so
M is the largest count and the tail of a shorter row is padding). out_rows [B, H, M, e] equals
the dense op's output at those positions; padding slots return zeros. Cost scales with M, not T:

- `full_attention_rows` and `local_attention_rows`: the selected rows are cut into chunks of
  `chunk` consecutive rows; a chunk reads one contiguous key range — up to its last row (full),
  or from its first row's window start to its last row's window end (local) — as a view of k
  and v, through the CPU flash kernel under a mask (row_chunks.py). M causal rows cost ≈ M·T/2
  pairs (full), their share of causal attention; local rows cost ≈ M·(window + the chunk's
  spread) pairs.
- `linear_attention_rows`: the chunk states Σ φ(k) vᵀ still come from every position (that is the
  running state a query needs); the per-row work — intra-chunk quadratic form and the read of the
  prefix state — is done for the packed rows only.

C kernels (ops/native custom ops; CPU, bf16/fp16 computed in fp32, when a compiler exists): the
causal linear rows run as one sweep of the running state per (batch, head), forward and backward;
causal, unpadded full and local rows run a query-blocked banded pass when no gradient is wanted
(inference), each row over its own keys — its whole prefix (full) or its window (local) — where
the chunks read up to the chunk's last row. Their FLOPs count what they execute, replayed from the
kernels' loops (ops/native/kernel_flops.py: whole key tiles and three-row groups).

`select_rows(route)` turns a bool routing mask [B, T] into (rows, valid). The `*_reference`
twins score each selected row against every key with an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive
from routeformer.ops.backends import NATIVE, TRITON, band_rows_backend, linear_rows_backend
from routeformer.ops.flops import dense_attention_flops, matmul_flops
from routeformer.ops.full.op import full_attention
from routeformer.ops.full.reference import masked_attention_reference
from routeformer.ops.linear.op import exclusive_chunk_prefix, linear_attention
from routeformer.ops.linear.reference import DEFAULT_EPS, feature_map, masked_features
from routeformer.ops.local.op import in_window
from routeformer.ops.native import native_kernels
from routeformer.ops.native.band import band_attend
from routeformer.ops.native.kernel_flops import band_attend_flops, linear_rows_flops
from routeformer.ops.native.linear_rows import NativeLinearRows, linear_rows_features
from routeformer.ops.row_chunks import rows_attention_by_chunks

# Position given to an empty packed slot: outside every window, so the slot reads nothing.
_EMPTY_POSITION = -(1 << 40)


def select_rows(route: Tensor) -> tuple[Tensor, Tensor]:
    """bool [B, T] -> (rows long [B, M], valid bool [B, M]): the routed positions of each batch row
    in ascending order, M = the largest count; padding slots hold position 0 and valid False."""
    if route.dim() != 2 or route.dtype != torch.bool:
        raise ValueError(f"route must be a bool tensor [B, T]; got {route.dtype} {tuple(route.shape)}")
    counts = route.sum(dim=1)
    most = int(counts.max()) if route.numel() else 0
    # A stable sort of "not routed" puts the routed positions first, in their original order.
    order = torch.sort((~route).to(torch.uint8), dim=1, stable=True).indices[:, :most]
    valid = torch.arange(most, device=route.device)[None, :] < counts[:, None]
    return order.masked_fill(~valid, 0), valid


def _check_rows(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, mask: Tensor | None
) -> None:
    if q_rows.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q_rows, k, v must have shape [B, H, M or T, d]")
    if q_rows.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q_rows.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q_rows, k, v do not fit together: {tuple(q_rows.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    expected = (q_rows.shape[0], q_rows.shape[2])
    if rows.shape != expected or valid.shape != expected:
        raise ValueError(f"rows and valid must have shape [B, M] = {expected}; got "
                         f"{tuple(rows.shape)} and {tuple(valid.shape)}")
    if mask is not None and mask.shape != (k.shape[0], k.shape[2]):
        raise ValueError(f"mask must have shape [B, T] = {(k.shape[0], k.shape[2])}; got {tuple(mask.shape)}")


# -- full and local: chunks of consecutive rows over one key range (row_chunks.py) ------------
def full_attention_rows(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, mask: Tensor | None = None,
    causal: bool = True, scale: float | None = None, chunk: int = 256,
) -> tuple[Tensor, int]:
    """Softmax attention of the selected rows over their allowed keys -> (out_rows, executed FLOPs)."""
    _check_rows(q_rows, k, v, rows, valid, mask)
    check_positive("chunk", chunk)
    batch, heads, count, dim = q_rows.shape
    length, value_dim = k.shape[2], v.shape[-1]
    backend, _ = band_rows_backend("full_attention_rows", q_rows, k, v, causal, mask)
    if backend == TRITON:
        return _band_rows_triton(q_rows, k, v, rows, valid, rows + 1, scale)
    if backend == NATIVE:  # each row over its own prefix, where a chunk reads up to its last row
        # Every value row is read by most rows' prefixes: a contiguous copy pays for itself (T=4096,
        # 20% of rows, d=64: 22 + 1.7 ms against 27 ms through a head view's strides). The local
        # rows' short windows keep the strides.
        return _band_rows_native(native_kernels(q_rows, k, v), q_rows, k, v.contiguous(), rows, valid,
                                 rows + 1, scale)
    if not causal:  # every row reads every key: the dense op with the rows as its queries
        out = full_attention(q_rows, k, v, mask=mask, causal=False, scale=scale)
        return out * valid[:, None, :, None].to(out.dtype), batch * heads * dense_attention_flops(
            count * length, dim, value_dim)
    # A chunk reads the keys up to its last row: M rows cost ≈ M·T/2 pairs.
    return rows_attention_by_chunks(q_rows, k, v, rows, valid, mask, scale=scale, chunk=chunk,
                                    key_range=lambda first, last: (0, last + 1),
                                    rule=lambda keys, rows: keys <= rows)


def local_attention_rows(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, window: int,
    mask: Tensor | None = None, causal: bool = True, scale: float | None = None, chunk: int = 64,
) -> tuple[Tensor, int]:
    """Sliding-window attention ([i − window + 1, i] causal, [i − window, i + window] otherwise) of
    the selected rows -> (out_rows, executed FLOPs)."""
    _check_rows(q_rows, k, v, rows, valid, mask)
    check_positive("window", window)
    check_positive("chunk", chunk)
    backend, _ = band_rows_backend("local_attention_rows", q_rows, k, v, causal, mask)
    if backend == TRITON:
        return _band_rows_triton(q_rows, k, v, rows, valid, (rows + 1).clamp(max=window), scale)
    if backend == NATIVE:
        return _band_rows_native(native_kernels(q_rows, k, v), q_rows, k, v, rows, valid,
                                 (rows + 1).clamp(max=window), scale)
    before, after = (window - 1, 0) if causal else (window, window)
    # A chunk reads from its first row's window start to its last row's window end; it spans
    # at most `window` positions of rows, so sparse rows never make it read much more than
    # twice their windows.
    return rows_attention_by_chunks(
        q_rows, k, v, rows, valid, mask, scale=scale, chunk=chunk,
        key_range=lambda first, last: (first - before, last + after + 1),
        rule=lambda keys, rows: in_window(keys - rows, window, causal), bucket=window)


def _band_rows_triton(q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, horizon: Tensor,
                      scale: float | None) -> tuple[Tensor, int]:
    """The causal, unpadded full and local rows on the Triton banded pass: each selected row over
    the `horizon` [B, M] keys ending at its position, no decay; padding slots return zeros.
    Differentiable (the C pass serves inference only: training keeps the flash chunks, whose
    backward beats the per-query C backward: local rows, T=4096, 30% of rows, window 256: ~28
    against ~47 ms)."""
    from routeformer.ops.triton.band import band_flops, triton_band_attention  # triton is optional

    batch, heads, count, dim = q_rows.shape
    horizon = torch.where(valid, horizon, 0)
    per_row = horizon[:, None].expand(batch, heads, count).reshape(batch * heads, count)
    log_decay = torch.zeros(batch * heads, count, dtype=torch.float32, device=q_rows.device)
    out = triton_band_attention(q_rows.reshape(batch * heads, count, dim), k, v, log_decay, per_row,
                                rows, scale=scale)
    return out.view(batch, heads, count, -1), band_flops(per_row, dim, v.shape[-1])


def _band_rows_native(
    native, q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, horizon: Tensor,
    scale: float | None,
) -> tuple[Tensor, int]:
    """The banded pass of ops/native with no decay: each row over the `horizon` [B, M] keys ending
    at its position (row + 1 for full attention, min(window, row + 1) for local)."""
    batch, heads, count, dim = q_rows.shape
    horizon = torch.where(valid, horizon, 0)  # padding slots read nothing
    per_row = horizon[:, None].expand(batch, heads, count).reshape(batch * heads, count).contiguous()
    q_flat = q_rows.reshape(batch * heads, count, dim).contiguous()
    log_decay = q_rows.new_zeros(batch * heads, count)
    scale = dim ** -0.5 if scale is None else scale
    # k and v go in with their strides (head views of one projection): no copies.
    out = band_attend(native, q_flat, k, v, log_decay, per_row, rows.contiguous(), scale)
    # What the query-blocked pass executes: whole key tiles of each block's band union, values per
    # group of three rows (more than the rows' own keys when a block's rows lie far apart).
    positions = rows[:, None].expand(batch, heads, count).reshape(batch * heads, count)
    flops = band_attend_flops(per_row, positions, dim, v.shape[-1])
    return out.view(batch, heads, count, -1), flops


# -- packing rows by chunk (linear) ------------------------------------------------------------
@dataclass
class _Packing:
    slots: Tensor  # long [B, M]: flat index of each row in the packed [N·C] layout (N·C = discard)
    positions: Tensor  # long [B, N, C]: the position held by each packed slot (_EMPTY_POSITION if none)
    blocks: int  # N
    per_block: int  # C

    def pack(self, x_rows: Tensor) -> Tensor:
        """[B, H, M, e] -> [B, H, N, C, e]; empty slots hold zeros."""
        batch, heads, _, width = x_rows.shape
        index = self.slots[:, None, :, None].expand(batch, heads, -1, width)
        packed = x_rows.new_zeros(batch, heads, self.blocks * self.per_block + 1, width)
        packed = packed.scatter(2, index, x_rows)
        return packed[:, :, :-1].unflatten(2, (self.blocks, self.per_block))

    def unpack(self, x_packed: Tensor) -> Tensor:
        """[B, H, N, C, e] -> [B, H, M, e]; padding rows get zeros."""
        batch, heads = x_packed.shape[:2]
        flat = F.pad(x_packed.flatten(2, 3), (0, 0, 0, 1))  # the discard slot reads zeros
        index = self.slots[:, None, :, None].expand(batch, heads, -1, flat.shape[-1])
        return flat.gather(2, index)


def _pack_by_block(rows: Tensor, valid: Tensor, block: int, blocks: int) -> _Packing:
    batch, count = rows.shape
    block_of = torch.where(valid, rows // block, 0)
    counts = torch.zeros(batch, blocks, dtype=torch.long, device=rows.device)
    counts.scatter_add_(1, block_of, valid.long())
    per_block = max(1, int(counts.max()) if counts.numel() else 1)
    # Rows are ascending, so block n's rows sit at consecutive slots after those of blocks < n.
    first = counts.cumsum(1) - counts
    rank = torch.arange(count, device=rows.device)[None, :] - first.gather(1, block_of)
    slots = torch.where(valid, block_of * per_block + rank, blocks * per_block)
    positions = torch.full((batch, blocks * per_block + 1), _EMPTY_POSITION, dtype=torch.long,
                           device=rows.device)
    positions = positions.scatter(1, slots, torch.where(valid, rows, _EMPTY_POSITION))
    return _Packing(slots, positions[:, :-1].view(batch, blocks, per_block), blocks, per_block)


def _pad_to_blocks(x: Tensor, block: int) -> Tensor:
    pad = -x.shape[2] % block
    return F.pad(x, (0, 0, 0, pad)) if pad else x


# -- linear -------------------------------------------------------------------------------------
def linear_attention_rows(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, mask: Tensor | None = None,
    causal: bool = True, chunk: int = 64, eps: float = DEFAULT_EPS,
) -> tuple[Tensor, int]:
    """Linear attention (elu + 1 features) of the selected rows -> (out_rows, executed FLOPs)."""
    _check_rows(q_rows, k, v, rows, valid, mask)
    check_positive("chunk", chunk)
    batch, heads, count, dim = q_rows.shape
    length, value_dim = k.shape[2], v.shape[-1]
    if not causal:  # one state over every key: the dense op with the rows as its queries
        out = linear_attention(q_rows, k, v, mask=mask, causal=False, eps=eps)
        flops = matmul_flops(dim, length, value_dim) + matmul_flops(count, dim, value_dim) + 2 * count * dim
        return out * valid[:, None, :, None].to(out.dtype), batch * heads * flops
    native = native_kernels(q_rows, k, v) if linear_rows_backend(q_rows, k, v)[0] == NATIVE else None
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_rows, k, v))
    if native is not None and mask is None and not wants_grad and not torch.compiler.is_compiling():
        # Inference: the kernel applies the features itself (no phi tensors).
        out = linear_rows_features(q_rows.reshape(batch * heads, count, dim), k, v, rows, valid, eps)
        return out.view(batch, heads, count, value_dim), linear_rows_flops(rows, valid, heads, dim, value_dim)
    phi_q, phi_k = masked_features(q_rows, k, mask)
    if native is not None:  # one sweep of the running state per (batch, head) row
        return _linear_rows_native(native, phi_q, phi_k, v, rows, valid, eps)
    chunks = -(-length // chunk)
    packing = _pack_by_block(rows, valid, chunk, chunks)
    phi_k = _pad_to_blocks(phi_k, chunk).unflatten(2, (chunks, chunk))  # [B, H, N, c, d]
    values = _pad_to_blocks(v, chunk).unflatten(2, (chunks, chunk))
    packed_q = packing.pack(phi_q)  # [B, H, N, C, d]; empty slots are zero, so they read nothing
    # Within the row's chunk: keys at or before it (float mask: multiply, no masked_fill).
    key_positions = torch.arange(chunks * chunk, device=k.device).view(chunks, chunk)
    causal_mask = (key_positions[None, :, None, :] <= packing.positions[:, :, :, None]).to(phi_q.dtype)
    scores = (packed_q @ phi_k.transpose(-1, -2)) * causal_mask[:, None]
    numerator = scores @ values
    denominator = scores.sum(dim=-1, keepdim=True)
    # Before the chunk: the exclusive prefix of chunk states, from every position.
    prior_states = exclusive_chunk_prefix(phi_k.transpose(-1, -2) @ values)
    prior_norms = exclusive_chunk_prefix(phi_k.sum(dim=3))
    numerator = numerator + packed_q @ prior_states
    denominator = denominator + (packed_q * prior_norms[:, :, :, None, :]).sum(-1, keepdim=True)
    out = packing.unpack(numerator / (denominator + eps))
    per_block = packing.per_block
    flops = (chunks * (matmul_flops(per_block, dim, chunk) + matmul_flops(per_block, chunk, value_dim))
             + chunks * matmul_flops(dim, chunk, value_dim)
             + chunks * (matmul_flops(per_block, dim, value_dim) + 2 * per_block * dim))
    return out, batch * heads * flops


def _linear_rows_native(
    native, phi_q: Tensor, phi_k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, eps: float
) -> tuple[Tensor, int]:
    batch, heads, count, dim = phi_q.shape
    value_dim = v.shape[-1]
    phi_q = phi_q.reshape(batch * heads, count, dim).contiguous()
    # phi_k and v go in with their strides (e.g. head views of one projection): no copies.
    out = NativeLinearRows.apply(phi_q, phi_k, v, rows.contiguous(), valid, eps, native)
    # The sweep's chunks join the state; each group of three rows reads it, scores its chunk and
    # sums values up to its last row (ops/native/kernel_flops.py).
    flops = linear_rows_flops(rows, valid, heads, dim, value_dim)
    return out.view(batch, heads, count, value_dim), flops


# -- references ---------------------------------------------------------------------------------
def _causal_rule(offset: Tensor) -> Tensor:
    return offset <= 0


def _any_key(offset: Tensor) -> Tensor:
    return torch.ones_like(offset, dtype=torch.bool)


def _row_allowed(rows: Tensor, valid: Tensor, length: int, mask: Tensor | None, rule) -> Tensor:
    """Bool [B, 1, M, T]: key j is allowed for selected row m by `rule(offset = j − row)`."""
    offsets = torch.arange(length, device=rows.device)[None, None, :] - rows[:, :, None]
    allowed = rule(offsets) & valid[:, :, None]
    if mask is not None:
        allowed = allowed & mask[:, None, :]
    return allowed[:, None]


def full_attention_rows_reference(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, mask: Tensor | None = None,
    causal: bool = True, scale: float | None = None,
) -> Tensor:
    _check_rows(q_rows, k, v, rows, valid, mask)
    rule = _causal_rule if causal else _any_key
    return masked_attention_reference(q_rows, k, v, _row_allowed(rows, valid, k.shape[2], mask, rule), scale)


def local_attention_rows_reference(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, window: int,
    mask: Tensor | None = None, causal: bool = True, scale: float | None = None,
) -> Tensor:
    _check_rows(q_rows, k, v, rows, valid, mask)
    allowed = _row_allowed(rows, valid, k.shape[2], mask, lambda offset: in_window(offset, window, causal))
    return masked_attention_reference(q_rows, k, v, allowed, scale)


def linear_attention_rows_reference(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, *, mask: Tensor | None = None,
    causal: bool = True, eps: float = DEFAULT_EPS,
) -> Tensor:
    _check_rows(q_rows, k, v, rows, valid, mask)
    rule = _causal_rule if causal else _any_key
    allowed = _row_allowed(rows, valid, k.shape[2], mask, rule)
    weights = (feature_map(q_rows) @ feature_map(k).transpose(-1, -2)) * allowed.to(q_rows.dtype)
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + eps)
