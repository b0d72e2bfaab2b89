"""Meta-attention among meta-token positions (Shah et al., "Language Modeling with Learned
Meta-Tokens", arXiv 2509.16278), packed.

Axes: B batch, H heads, T length, M packed meta slots (the largest meta count of the batch),
d head dim.

The layer's output at position i is

    out_i = Attn(q_i; keys j <= i)                              (standard causal attention)
          + [i is meta] · g_i · Attn(q'_i; meta keys j <= i)    (meta-attention)

where g_i is 1 ("add", the paper's combination) or a learned gate, and q', k', v' are the meta-
attention's projections (the standard ones when shared). The paper builds the meta-attention with
a dense T×T mask (meta & meta & causal) and pays ≈1.11× plain attention. We gather the meta
positions of each sequence into M packed slots, run causal attention among them (O(M²), M ≈ 0.1·T)
and scatter the result back onto the standard output.

Packing: a stable sort puts each sequence's meta positions first, in order; sequences with fewer
than M meta-tokens fill their tail with padding slots. Under the causal rule a real slot only reads
slots before it — all real — so one causal SDPA call over the packed slots needs no padding mask;
padding slots are dropped (multiplied by 0) when scattering. Non-causal meta-attention masks the
padding keys.

`meta_token_attention_reference` writes the definition with dense scores; `meta_token_attention_dense_mask`
is the paper's implementation (two SDPA calls, the second with a T×T mask), kept for the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_qkv
from routeformer.ops._compile_marks import disable_in_graphs
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full.op import full_attention, full_attention_flops, sdpa_allowed
from routeformer.ops.full.reference import allowed_keys, full_attention_reference, masked_attention_reference


@dataclass
class MetaPacking:
    """Where each sequence's meta-tokens are: `index` [B, M] long (sequence positions, meta first in
    order, then filler positions), `valid` [B, M] bool (True on meta slots), `counts` [B]."""

    index: Tensor
    valid: Tensor
    counts: Tensor

    @property
    def width(self) -> int:
        return self.index.shape[1]


@disable_in_graphs  # data-dependent sizes: one graph break here instead of one per host read
def pack_meta_positions(meta: Tensor, mask: Tensor | None = None) -> MetaPacking:
    """Pack the meta positions of bool `meta` [B, T] (padding positions, mask False, never count)."""
    if meta.dtype != torch.bool or meta.dim() != 2:
        raise ValueError(f"meta must be a bool tensor [B, T] (True at meta-tokens); got "
                         f"{meta.dtype} {tuple(meta.shape)}")
    if mask is not None:
        meta = meta & mask
    counts = meta.sum(dim=1)
    width = int(counts.max()) if meta.numel() else 0
    rows, positions = meta.nonzero(as_tuple=True)  # row-major: each row's positions in order
    first_of_row = counts.cumsum(0) - counts
    slots = torch.arange(len(rows), device=meta.device) - first_of_row[rows]
    index = torch.zeros(meta.shape[0], width, dtype=torch.long, device=meta.device)
    index[rows, slots] = positions  # padding slots point at position 0 and are never read back
    valid = torch.arange(width, device=meta.device) < counts[:, None]
    return MetaPacking(index, valid, counts)


def gather_rows(t: Tensor, index: Tensor) -> Tensor:
    """t [B, H, T, d] (or [B, T, D]) at positions index [B, M] -> [B, H, M, d] (or [B, M, D])."""
    axis = t.dim() - 3  # the position axis of one sequence
    # One index_select of whole rows per sequence: about 3x faster on CPU than `gather` with an
    # index expanded over every feature (and the batch of a training run is small).
    if t.shape[0] == 1:
        return t[0].index_select(axis, index[0]).unsqueeze(0)
    return torch.stack([t[b].index_select(axis, index[b]) for b in range(t.shape[0])])


def scatter_add_rows(base: Tensor, rows: Tensor, packing: MetaPacking) -> Tensor:
    """base [B, H, T, d] plus the valid packed `rows` [B, H, M, d] at their positions. In place when
    nothing needs a gradient (inference), else out of place (SDPA's backward reads `base`)."""
    # (Under torch.compile always multiply: reading valid.all() back would break the graph.)
    if torch.compiler.is_compiling() or not bool(packing.valid.all()):
        rows = rows * packing.valid[:, None, :, None].to(rows.dtype)
    batch = base.shape[0]
    if torch.is_grad_enabled() and (base.requires_grad or rows.requires_grad):
        return torch.stack([base[b].index_add(1, packing.index[b], rows[b]) for b in range(batch)])
    for b in range(batch):
        base[b].index_add_(1, packing.index[b], rows[b])
    return base


def attention_among_meta(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, causal: bool) -> Tensor:
    """Attention among packed meta slots [B, H, M, d]; padding slots (valid False) come last."""
    if causal:  # real slots precede padding, so causal order never reads a padding key
        return full_attention(q, k, v, causal=True)
    return full_attention(q, k, v, mask=valid)


def meta_token_attention(
    q: Tensor, k: Tensor, v: Tensor, packing: MetaPacking, *, mask: Tensor | None = None,
    causal: bool = True, meta_qkv: tuple[Tensor, Tensor, Tensor] | None = None,
    meta_gate: Tensor | None = None,
) -> Tensor:
    """Standard attention plus packed meta-attention (module docstring), [B, H, T, d] -> [B, H, T, d].

    `packing` is `pack_meta_positions(meta, mask)`. `meta_qkv`: the meta-attention's own q', k', v'
    at the packed slots [B, H, M, d] (default: the standard q, k, v gathered). `meta_gate`
    [B, H, M, 1] multiplies the meta-attention output (default: 1, the paper's "add").
    """
    check_qkv(q, k, v, mask, causal=causal)
    _check_packing(packing, q)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad and packing.width and mask is None and meta_qkv is None and meta_gate is None:
        return _SharedMetaAttention.apply(q, k, v, packing.index, packing.valid, causal)
    out = full_attention(q, k, v, mask=mask, causal=causal)
    if packing.width == 0:
        return out
    if meta_qkv is None:
        meta_qkv = tuple(gather_rows(t, packing.index) for t in (q, k, v))
    meta_out = attention_among_meta(*meta_qkv, packing.valid, causal)
    if meta_gate is not None:
        meta_out = meta_out * meta_gate
    return scatter_add_rows(out, meta_out, packing)


class _SharedMetaAttention(torch.autograd.Function):
    """The training path of the default layer (shared projections, "add", no padding): the same
    result as composing the ops, with a backward that adds the meta-attention's row gradients
    into the standard attention's dq, dk, dv in place. Composed, autograd would give each gather a
    zero-filled full-size gradient and then add it: three T×d fills and adds that cost more than
    the meta-attention itself at T = 4096."""

    @staticmethod
    def forward(ctx, q, k, v, index, valid, causal):
        with torch.enable_grad():  # two small graphs, differentiated by hand in backward
            leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            standard = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            packed = tuple(gather_rows(t.detach(), index).requires_grad_() for t in (q, k, v))
            among = attention_among_meta(*packed, valid, causal)
        ctx.graphs = (leaves, standard, packed, among)
        ctx.save_for_backward(index, valid)
        # SDPA's backward reads its output: add the meta rows to a copy.
        packing = MetaPacking(index, valid, valid.sum(dim=1))
        return scatter_add_rows(standard.detach().clone(), among.detach(), packing)

    @staticmethod
    def backward(ctx, grad_out):
        index, valid = ctx.saved_tensors
        leaves, standard, packed, among = ctx.graphs
        # retain_graph: the inner graphs live exactly as long as this node (a caller may run the
        # outer backward twice with retain_graph=True).
        grads = torch.autograd.grad(standard, leaves, grad_out, retain_graph=True)
        grad_rows = gather_rows(grad_out, index) * valid[:, None, :, None].to(grad_out.dtype)
        row_grads = torch.autograd.grad(among, packed, grad_rows, retain_graph=True)
        for full, rows in zip(grads, row_grads, strict=True):
            for b in range(full.shape[0]):
                full[b].index_add_(1, index[b], rows[b])
        return (*grads, None, None, None)


def meta_token_attention_flops(q: Tensor, packing: MetaPacking, *, masked: bool, causal: bool) -> int:
    """Executed FLOPs: the standard attention plus attention among the M packed slots."""
    batch, heads, length, dim = q.shape
    width = packing.width
    pairs = width * (width + 1) // 2 if causal else width * width
    return (full_attention_flops(batch, heads, length, length, dim, causal, masked)
            + dense_attention_flops(batch * heads * pairs, dim))


def meta_token_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, meta: Tensor, *, mask: Tensor | None = None, causal: bool = True,
    meta_qkv: tuple[Tensor, Tensor, Tensor] | None = None, meta_gate: Tensor | None = None,
) -> Tensor:
    """The specification, dense: standard attention plus, at meta rows, attention over the meta keys
    the causal rule allows. `meta_qkv` and `meta_gate` ([B, H, T, 1]) are full-length here."""
    standard = full_attention_reference(q, k, v, mask=mask, causal=causal)
    meta = meta if mask is None else meta & mask
    allowed = meta[:, None, :, None] & meta[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones_like(allowed[0, 0]).tril()
    meta_out = masked_attention_reference(*(meta_qkv or (q, k, v)), allowed)  # 0 on non-meta rows
    if meta_gate is not None:
        meta_out = meta_out * meta_gate
    return standard + meta_out


def meta_token_attention_dense_mask(
    q: Tensor, k: Tensor, v: Tensor, meta: Tensor, *, mask: Tensor | None = None, causal: bool = True,
) -> Tensor:
    """The paper's implementation (shared projections, "add"): a second SDPA call over all T
    queries and keys with a dense meta mask. Same result as `meta_token_attention`; kept to
    measure what packing saves."""
    out = full_attention(q, k, v, mask=mask, causal=causal)
    meta = meta if mask is None else meta & mask
    allowed = allowed_keys(q.shape[0], q.shape[2], meta, causal, q.device) & meta[:, None, :, None]
    return out + sdpa_allowed(q, k, v, allowed)


def _check_packing(packing: MetaPacking, q: Tensor) -> None:
    if packing.index.dim() != 2 or packing.index.shape[0] != q.shape[0]:
        raise ValueError(f"packing must come from a meta mask of batch {q.shape[0]}; got index "
                         f"{tuple(packing.index.shape)}")
    if packing.width and int(packing.index.max()) >= q.shape[2]:
        raise ValueError(f"packing indexes positions beyond the sequence length {q.shape[2]}")
