"""Sliding-window attention (the `local` expert), blockwise.

Axes: B batch, H heads, T length, d head dim, N blocks, b block length.

Causal: token i reads keys [i - window + 1, i]. Non-causal: keys [i - window, i + window].
Fast path: cut the (internally padded) sequence into N query blocks of b tokens; every query block
attends to its own block and the ceil(window / b) blocks before it (and, non-causal, after it),
with a band mask, through `blockwise_sdpa` (SDPA's fused kernel, blocks folded into the batch).
With b = window that is the block and its neighbour(s). Time and memory O(T·(window + b)·d).
Native path (CPU, float32 / bfloat16 / float16, no explicit `block`, kernels on): the C kernel of
ops/native/local.py scores only each query's exact band (give or take five keys), flash-style
forward and backward, bf16 with bf16 pair products; time O(T·window·d), memory O(T·d + window·d).
The blockwise path is its fallback and runs everywhere else, and for packed `documents` (the
window cut at document boundaries by one more term of its band mask).
Reference (ops/local/reference.py): the dense T×T score matrix with the band mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.backends import NATIVE, local_backend
from routeformer.ops.block_attention import blockwise_sdpa
from routeformer.ops.documents import check_documents
from routeformer.ops.flops import dense_attention_flops


def in_window(offset: Tensor, window: int, causal: bool) -> Tensor:
    """offset = key position - query position -> bool: the key lies in the query's window."""
    if causal:
        return (offset <= 0) & (offset > -window)
    return offset.abs() <= window


def _block_span(window: int, block: int) -> int:
    """How many neighbour blocks on each side a query block needs to cover its window."""
    return -(-window // block)


def _neighbour_blocks(x: Tensor, block: int, span: int, causal: bool, fill=0.0) -> Tensor:
    """[B, H?, N·b, ...] -> [B, H?, N, (span + 1 or 2·span + 1)·b, ...]: each block's key set.

    The key set of block n is the blocks n - span .. n (causal) or n - span .. n + span, in
    order, so key slot s of block n holds position (n - span)·b + s. Works for keys, values
    (with a trailing feature axis) and the key-padding mask (without one).
    """
    time_axis = 2 if x.dim() == 4 else 1
    length = x.shape[time_axis]
    blocks = length // block
    after = 0 if causal else span
    pad = [0, 0] * (x.dim() - time_axis - 1) + [span * block, after * block]
    padded = F.pad(x, pad, value=fill)
    parts = [
        padded.narrow(time_axis, shift * block, length).unflatten(time_axis, (blocks, block))
        for shift in range(span + 1 + after)
    ]
    return torch.cat(parts, dim=time_axis + 1)


def _band(window: int, block: int, span: int, causal: bool, device: torch.device) -> Tensor:
    """Bool [b, key slots]: query a of a block may read key slot s of its neighbour layout.

    Key slot s sits at offset s - span·b from the block start, so its distance is s - span·b - a.
    """
    query = torch.arange(block, device=device)[:, None]
    slots = (span + 1 + (0 if causal else span)) * block
    key = torch.arange(slots, device=device)[None, :]
    return in_window(key - span * block - query, window, causal)


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, window: int, mask: Tensor | None = None,
    causal: bool = False, scale: float | None = None, block: int | None = None,
    documents: Tensor | None = None,
) -> Tensor:
    """Blockwise sliding-window softmax attention; see the module docstring.

    `block` is the query block length of the blockwise path (default: `window`, capped at 128 —
    smaller blocks score fewer keys outside the window, larger ones make bigger, more efficient
    matrix products); passing one selects that path even where the C kernel could run.
    `documents` (int [B, T], nondecreasing per row; ops/documents.py): packed sequences, a query
    reads only the keys of its window that lie in its own document (the blockwise path, with the
    document test folded into its band mask: still O(T·(window + b)) memory).
    """
    check_qkv(q, k, v, mask, causal=True)  # a window needs queries and keys on one axis
    check_positive("window", window)
    if documents is not None:
        check_documents(documents, q.shape[0], q.shape[2])
    if block is None and documents is None and (native := _native_local(q, k, v, mask)) is not None:
        return native(q, k, v, mask, window, causal, scale)
    block = default_block(window) if block is None else block
    check_positive("block", block)
    batch, heads, length, _ = q.shape
    blocks = -(-length // block)
    span = _block_span(window, block)
    pad = blocks * block - length
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        valid = F.pad(valid, (0, pad), value=False)
    key_valid = _neighbour_blocks(valid, block, span, causal, fill=False)  # [B, N, slots]
    band = _band(window, block, span, causal, q.device)
    allowed = band & key_valid[:, None, :, None, :]  # [B, 1, N, b, slots]
    if documents is not None:
        documents = documents.long()
        if pad:
            documents = F.pad(documents, (0, pad), value=-1)
        key_documents = _neighbour_blocks(documents, block, span, causal, fill=-1)  # [B, N, slots]
        query_documents = documents.view(batch, blocks, block)
        allowed = allowed & (query_documents[:, None, :, :, None] == key_documents[:, None, :, None, :])
    out = blockwise_sdpa(
        q.reshape(batch, heads, blocks, block, -1),
        _neighbour_blocks(k, block, span, causal),
        _neighbour_blocks(v, block, span, causal),
        allowed,
        scale,
    )
    return out.reshape(batch, heads, blocks * block, -1)[:, :, :length]


def _native_local(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, record: bool = True):
    """The C kernel's caller if it serves these tensors (ops/backends.py: `local_backend`), else
    None: the blockwise PyTorch path below runs."""
    return _local_native if local_backend(q, k, v, record=record)[0] == NATIVE else None


def _local_native(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, window: int, causal: bool,
                  scale: float | None) -> Tensor:
    """`local_attention` through local_kernels.c (float16 computed in float32)."""
    from routeformer.ops.native.local import NATIVE_DTYPES, local_attend_op

    length = q.shape[2]
    before, after = (window - 1, 0) if causal else (window, window)
    before, after = min(before, length), min(after, length)  # the kernel clips to [0, T) as well
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.dtype in NATIVE_DTYPES:
        return local_attend_op(q, k, v, mask, before, after, scale)[0]
    out, _ = local_attend_op(q.float(), k.float(), v.float(), mask, before, after, scale)
    return out.to(q.dtype)


def default_block(window: int) -> int:
    return min(window, 128)


def local_attention_flops(
    batch: int, heads: int, length: int, head_dim: int, window: int, causal: bool,
    block: int | None = None, native: bool | None = None,
) -> int:
    """Executed FLOPs of `local_attention`. The blockwise path: every query scores all key slots
    of its block. The C kernel (`native`; None: whether it serves CPU float32 tensors with this
    `block` now): every block of NATIVE_ROWS queries scores the keys its bands cover."""
    if native is None:
        native = block is None and local_kernel_serves_cpu()
    if native:
        return batch * heads * _native_flops(length, head_dim, window, causal)
    block = default_block(window) if block is None else block
    blocks = -(-length // block)
    span = _block_span(window, block)
    slots = (span + 1 + (0 if causal else span)) * block
    return batch * heads * dense_attention_flops(blocks * block * slots, head_dim)


NATIVE_ROWS = 6  # local_kernels.c's MR: the queries of one register tile
_PROBE = torch.zeros(1, 1, 1, 1)


def local_kernel_serves_cpu() -> bool:
    """Whether `local_attention` runs the C kernel now for CPU float32 inputs (no explicit block)."""
    return _native_local(_PROBE, _PROBE, _PROBE, None, record=False) is not None


def _native_flops(length: int, head_dim: int, window: int, causal: bool) -> int:
    """Per (batch, head): Σ over query blocks of rows x keys the block covers (q·k and p·v), in
    closed form (plain ints, so torch.compile sees a constant): block t of the full blocks covers
    keys [max(0, 6t − before), min(T, 6t + 6 + after)); a last partial block is added apart."""
    before, after = (window - 1, 0) if causal else (window, window)
    rows, full = NATIVE_ROWS, length // NATIVE_ROWS
    reach = rows + after
    below = min(full, max(0, (length - reach - 1) // rows + 1)) if length > reach else 0
    ends = rows * below * (below - 1) // 2 + reach * below + length * (full - below)
    first = before // rows + 1  # blocks from here on start past key 0
    starts = rows * (full * (full - 1) // 2 - first * (first - 1) // 2) - before * (full - first) \
        if full > first else 0
    pairs = rows * (ends - starts)
    tail = length - rows * full
    if tail:
        start = rows * full
        pairs += tail * (min(length, start + tail + after) - max(0, start - before))
    return dense_attention_flops(pairs, head_dim)
