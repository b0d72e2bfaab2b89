"""Linear attention with the elu(x) + 1 feature map (the `linear` expert; Katharopoulos et al. 2020).

Axes: B batch, H heads, T length, d head dim (e value dim), N chunks, C chunk length.

    out_i = phi(q_i)·S_i / (phi(q_i)·z_i + eps),   phi(x) = elu(x) + 1,
    S_i = sum_{j in keys(i)} phi(k_j) v_jᵀ,          z_i = sum_{j in keys(i)} phi(k_j)
where keys(i) is every real key (non-causal) or the real keys j <= i (causal).

Non-causal: associativity, S and z once for the whole sequence, O(T·d·e).
Causal: chunked. Inside a chunk of C tokens, the masked quadratic form (phi(q) phi(k)ᵀ ∘ tril) v;
across chunks, a d×e state per chunk, prefix-summed over chunks (states from chunks before the
query's own). Memory O(T·C + (T/C)·d·e), never the T·d·e of a per-token cumulative sum.
Reference (ops/linear/reference.py): the explicit per-position sum, written as the dense
masked matrix phi(q) phi(k)ᵀ.
A padded key has phi(k) = 0, so it adds nothing to S or z; a query with no key returns zeros.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.backends import NATIVE, linear_backend
from routeformer.ops.flops import matmul_flops
from routeformer.ops.linear.reference import DEFAULT_EPS, masked_features  # the spec's map
from routeformer.ops.native import linear as native_linear


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, causal: bool = False,
    chunk: int = 64, eps: float = DEFAULT_EPS,
) -> Tensor:
    """Normalised linear attention; see the module docstring.

    Causal fp32/bf16 CPU inputs go to the native kernels (ops/native/linear.py: feature map, chunk
    sweep and an explicit chunked backward in C, chunks of their own size); `chunk` is then unused.
    Everything else (and `native_enabled(False)`) runs the chunked PyTorch form below."""
    check_qkv(q, k, v, mask, causal=causal)
    check_positive("chunk", chunk)
    if linear_backend(q, k, v, causal)[0] == NATIVE:
        return native_linear.causal_linear_attention(q, k, v, mask, eps)
    phi_q, phi_k = masked_features(q, k, mask)
    if not causal:
        state = phi_k.transpose(-1, -2) @ v  # [B, H, d, e]
        normaliser = phi_k.sum(dim=2, keepdim=True)  # [B, H, 1, d]
        numerator = phi_q @ state
        denominator = (phi_q * normaliser).sum(dim=-1, keepdim=True)
        return numerator / (denominator + eps)
    return _causal_chunked(phi_q, phi_k, v, chunk, eps)


def _causal_chunked(phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk: int, eps: float) -> Tensor:
    batch, heads, length, dim = phi_q.shape
    value_dim = v.shape[-1]
    chunks = -(-length // chunk)
    pad = chunks * chunk - length
    if pad:  # padded keys have phi = 0 and contribute nothing; padded queries are dropped
        phi_q, phi_k, v = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    phi_q = phi_q.reshape(batch, heads, chunks, chunk, dim)
    phi_k = phi_k.reshape(batch, heads, chunks, chunk, dim)
    v = v.reshape(batch, heads, chunks, chunk, value_dim)

    # Within a chunk: the masked quadratic form.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    scores = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~causal, 0.0)  # [B, H, N, C, C]
    numerator = scores @ v
    denominator = scores.sum(dim=-1, keepdim=True)

    # Across chunks: state of all chunks strictly before each chunk (exclusive prefix sum).
    prior_states = exclusive_chunk_prefix(phi_k.transpose(-1, -2) @ v)  # [B, H, N, d, e]
    prior_norms = exclusive_chunk_prefix(phi_k.sum(dim=3))  # [B, H, N, d]
    numerator = numerator + phi_q @ prior_states
    denominator = denominator + (phi_q * prior_norms[:, :, :, None, :]).sum(dim=-1, keepdim=True)

    out = numerator / (denominator + eps)
    return out.reshape(batch, heads, chunks * chunk, value_dim)[:, :, :length]


# Up to this many chunks the exclusive prefix sum is one matrix product (O(N²) but a single GEMM);
# beyond it a cumsum (O(N)) wins. Measured on the 2-core CPU with d = e = 64: 2.7 vs 8 ms at N = 64,
# 29 vs 19 ms at N = 256.
_PREFIX_BY_MATMUL_UP_TO = 128


def exclusive_chunk_prefix(per_chunk: Tensor) -> Tensor:
    """[B, H, N, ...] -> for each chunk n, the sum over chunks < n, in fp32 so that a bf16 run does
    not lose the long-range state."""
    batch, heads, chunks = per_chunk.shape[:3]
    # The trailing size spelled out: -1 is ambiguous for an empty batch or length.
    flat = per_chunk.reshape(batch, heads, chunks, math.prod(per_chunk.shape[3:])).float()
    if chunks <= _PREFIX_BY_MATMUL_UP_TO:
        prefix = torch.ones(chunks, chunks, device=per_chunk.device).tril(-1) @ flat
    else:
        prefix = flat.cumsum(dim=2) - flat
    return prefix.view(per_chunk.shape).to(per_chunk.dtype)


def linear_attention_flops(
    batch: int, heads: int, length: int, head_dim: int, value_dim: int, causal: bool,
    chunk: int = 64,
) -> int:
    """Executed FLOPs (matrix products; the elementwise feature map is not counted)."""
    if not causal:
        per_head = matmul_flops(head_dim, length, value_dim) + matmul_flops(length, head_dim, value_dim)
        return batch * heads * (per_head + 2 * length * head_dim)
    chunks = -(-length // chunk)
    padded = chunks * chunk
    intra = chunks * (matmul_flops(chunk, head_dim, chunk) + matmul_flops(chunk, chunk, value_dim))
    states = chunks * matmul_flops(head_dim, chunk, value_dim)
    inter = matmul_flops(padded, head_dim, value_dim) + 2 * padded * head_dim
    return batch * heads * (intra + states + inter)
