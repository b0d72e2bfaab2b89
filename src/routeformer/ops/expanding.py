"""Expanding attention: a geometric prior over edge distance whose window is inferred per query.

Axes: B batch, H heads, T length, d head dim; N query blocks of b tokens, R = B·H·N block rows,
W = key slots of a block row's band (rings · b).

Singh & Buckley ("Attention as Implicit Structural Inference", NeurIPS 2023, §4) replace the
uniform prior over which key a query connects to by a geometric prior over the distance δ = i - j,
p(δ | q) = q (1 - q)^δ, with a conjugate Beta(α, β) hyper-prior on q. Truncated mean-field
inference, per query:
    1. q_t = α_t / (α_t + β_t)
    2. p_t = softmax over the keys within the horizon H_t = ceil(log(tol) / log(1 - q_t)) of
             q·k·scale + log p(δ | q_t)          (the tail beyond H_t holds at most `tol` prior mass)
    3. α_{t+1} = α_t + 1,  β_{t+1} = β_t + Σ_δ δ p_t(δ)
until the horizon stops growing, reaches the context, or `max_iters` steps were taken; the output
is p_t V of the last step. Content far back (large expected δ) lowers q and widens the window.

Non-causal (our extension): δ = |i - j| and the horizon is two-sided.

This update (`update="paper"`, the default; every experiment uses it except the mean-field rows
of structural-recency) is **not a
mean-field step** and does not converge to a mean-field fixed point: it adds one pseudo-observation
of the same edge per iteration (α_t = α + t, β_t = β + Σ_s E_s[δ]), so after t steps the posterior
counts the single edge t times, and it plugs in log(1 - E[q]) instead of E[log(1 - q)]. Where it
stops is set by a heuristic (the horizon stopped growing) and by `max_iters`, and its output
depends on the cap: `routeformer reproduce structural-update` measured 7.8 % of queries stopped by
the default cap of 8 and outputs moved by up to 0.26 against an uncapped run (random inputs).

`update="mean_field"` is coordinate-ascent mean-field inference for one query's latent edge δ and
decay q under q(δ) q(q):
    q-step: q(q) = Beta(α + 1, β + E_t[δ])        (the prior plus the one edge, not accumulated)
    δ-step: p_{t+1}(δ) ∝ exp(q·k·scale + δ E[log(1 - q)]),  E[log(1 - q)] = ψ(β_t) - ψ(α_t + β_t)
with the horizon ceil(log(tol) / E[log(1 - q)]). E_{t+1}[δ] is an increasing function of E_t[δ]
(a larger mean distance lowers the decay, which moves mass further back), so the sequence E_t[δ]
is monotone and bounded by the context: it converges. A query stops once
|E_t[δ] - E_{t-1}[δ]| <= 1e-3 · max(1, E_{t-1}[δ]) (`MEAN_FIELD_RTOL`), or at `max_iters`.
It runs on the band path (not the C kernels).

Band path. The sequence is cut into blocks of b queries; a block's keys are organised in rings:
ring o holds the key block o blocks back (o < 0: ahead). The q·k products of ring o are computed
for a block row only once some query of the block needs them (its horizon reaches that ring) and
are kept for every later iteration (one [R, b, b] tensor per ring), so keys beyond the block's
largest horizon are never scored. Each iteration runs a masked softmax over the block rows with a
query still iterating or, once fewer than half the queries iterate, over those queries alone
(gathered). The final pass, one autograd function, applies the last softmax to the values ring by
ring; its backward rebuilds the probabilities from the cache and adds the key and value gradients
in place, ring by ring.

C kernels (ops/native; causal, unpadded, CPU, when a compiler exists; custom ops, so also under
torch.compile; bf16/fp16 computed in fp32), which the op prefers: the inference steps run per
query over exactly its horizon (expanding_kernels.c, vectorised in fp32), the final pass is
query-blocked (band_kernels.c) and its backward runs per query. The band path above serves padded
and bidirectional inputs and GPU.

Gradients: to q, k, v through the final softmax, and to α, β through the prior of the final step,
with α_T = α + (steps taken) and β_T = β + Σ_t E_t[δ]; the E_t[δ] of the mean-field iterations are
treated as constants (no backpropagation through the inference loop), and the integer horizon has
no gradient.

Reference: dense T×T scores, the same iterations with an explicit horizon mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.backends import NATIVE, TRITON, expanding_backend, expanding_final_pass_backend
from routeformer.ops.native import native_kernels
from routeformer.ops.native.band import NativeBandAttention, expanding_infer_op
from routeformer.ops.native.kernel_flops import band_attend_flops_tensor

DEFAULT_BLOCK = 64
# Band entries per row group (~4 MB in fp32).
_GROUP_ELEMENTS = 1 << 20
# Keys outside a horizon get a penalty of at least _EXCLUDED / 2: exp() of it is exactly 0, as
# with -inf. Float arithmetic builds it ~5x faster than a bool mask with masked_fill on CPU.
_EXCLUDED = 1e30
# An inference step gathers the going-on queries once fewer than this fraction of all go on.
_GATHER_BELOW = 0.5
# Elementwise work per (query, key) entry of one inference step: prior, mask, exp, sum, δ·p.
_STEP_FLOPS_PER_ENTRY = 5
UPDATES = ("paper", "mean_field")
# Mean-field convergence: relative change of E[δ] between two steps (see the module docstring).
MEAN_FIELD_RTOL = 1e-3


@dataclass
class ExpandingOutput:
    out: Tensor  # [B, H, T, d]
    horizon: Tensor  # long [B, H, T]: final window (keys at distance < horizon are read)
    iterations: Tensor  # long [B, H, T]: inference steps taken
    # The counts are ints, or 0-d long tensors where `expanding_attention(..., sync_stats=False)`
    # took the native path (read them without a host sync, e.g. inside a compiled graph).
    scored_pairs: int | Tensor  # q·k products computed (at block granularity), counted once each
    value_pairs: int | Tensor  # (query, key) pairs of the final P·V products (the whole band)
    step_entries: int | Tensor  # (query, key) entries the inference steps and the final softmax touched
    flops: int | Tensor  # executed FLOPs: scores + P·V + elementwise inference work


def check_expanding_options(tol: float, max_iters: int, update: str = "paper") -> None:
    if not (isinstance(tol, float | int) and 0.0 < tol < 1.0):
        raise ValueError(f"tol must be a number in (0, 1); got {tol!r}")
    check_positive("max_iters", max_iters)
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}; got {update!r}")


def _mean_field_log_decay(alpha: Tensor, beta: Tensor) -> Tensor:
    """E[log(1 - q)] under Beta(α, β): ψ(β) - ψ(α + β) (the mean-field δ-step's per-unit prior)."""
    return torch.digamma(beta) - torch.digamma(alpha + beta)


def _mean_field_horizon(log_decay: Tensor, tol: float, context: Tensor) -> Tensor:
    """ceil(log(tol) / E[log(1 - q)]) clamped to [1, context] (long)."""
    horizon = torch.ceil(math.log(tol) / log_decay.clamp(max=-1e-7))
    return torch.minimum(horizon.clamp(min=1), context.to(horizon.dtype)).long()


def _mean_field_converged(mean: Tensor, previous_mean: Tensor) -> Tensor:
    return (mean - previous_mean).abs() <= MEAN_FIELD_RTOL * previous_mean.clamp(min=1.0)


def geometric_horizon(alpha: Tensor, beta: Tensor, tol: float, context: Tensor) -> Tensor:
    """ceil(log(tol) / log(1 - q)) with q = α / (α + β), clamped to [1, context] (long).

    The geometric tail beyond the horizon, P(δ >= H) = (1 - q)^H, is at most `tol`.
    """
    q = alpha / (alpha + beta)
    horizon = torch.ceil(math.log(tol) / torch.log1p(-q.clamp(max=1 - 1e-7)))
    horizon = torch.minimum(horizon.clamp(min=1), context.to(horizon.dtype))
    return horizon.long()


def _log_decay(alpha: Tensor, beta: Tensor) -> Tensor:
    """log(1 - q) = log(β / (α + β)): the per-unit-distance log prior (log q cancels in softmax)."""
    return torch.log(beta) - torch.log(alpha + beta)


def _context(valid: Tensor, causal: bool) -> Tensor:
    """Largest useful horizon per query, long [B, T]: every real key it may read lies at distance
    < context. Measured from the sequence's first real token (causal) and to its last one
    (non-causal), so padding on either side changes no real query's horizon nor its stopping
    rule: a padded sequence runs as it would alone. At least 1 (padded queries included)."""
    length = valid.shape[1]
    positions = torch.arange(length, device=valid.device)
    first = valid.long().argmax(dim=1, keepdim=True)  # 0 for a sequence with no real token
    last = length - 1 - valid.flip(1).long().argmax(dim=1, keepdim=True)
    context = positions - first + 1 if causal else torch.maximum(positions - first, last - positions) + 1
    return context.clamp(min=1)


def _stop_now(step: int, max_iters: int, horizon: Tensor, previous: Tensor, context: Tensor) -> Tensor:
    """The stopping rule, shared by the fast path and the reference."""
    not_growing = horizon <= previous if step > 0 else torch.zeros_like(horizon, dtype=torch.bool)
    return not_growing | (horizon >= context) | (step == max_iters - 1)


def _check_prior(alpha: Tensor, beta: Tensor, heads: int) -> None:
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value.shape != (heads,):
            raise ValueError(f"{name} must have shape [H] = ({heads},); got {tuple(value.shape)}")
        # The value check reads the tensor (a host sync, a graph break under torch.compile): a
        # graph being traced skips it (the layer's prior is positive by construction).
        if not torch.compiler.is_compiling() and not bool((value > 0).all()):
            raise ValueError(f"{name} must be positive (a Beta concentration); got {value.tolist()}")


def _add_prior(logits: Tensor, prior: Tensor, reach: Tensor, horizon: Tensor, log_decay: Tensor,
               key_penalty: Tensor | None) -> Tensor:
    """In place: logits + δ·log(1 - q), keys beyond the horizon (or invalid) pushed to
    <= -_EXCLUDED / 2. `prior`, `reach` broadcast to `logits` [..., W]; `horizon`, `log_decay`
    are per query ([...])."""
    logits.addcmul_(prior, log_decay[..., None].to(logits.dtype))
    # min(0, H - 1/2 - reach): 0 inside the horizon, <= -1/2 outside.
    beyond = (horizon[..., None].to(logits.dtype) - 0.5 - reach).clamp_(max=0.0)
    logits.add_(beyond, alpha=_EXCLUDED)
    if key_penalty is not None:
        logits.add_(key_penalty)
    return logits


class _Rings:
    """Block-row layout, the cache of computed ring scores, and the band they form.

    Row groups: every pass over the band runs over contiguous groups of block rows whose band
    holds about `_GROUP_ELEMENTS` entries, so elementwise temporaries stay small and are reused
    by the allocator instead of being faulted in fresh (see docs/design.md on fresh allocations).
    """

    def __init__(self, q: Tensor, k: Tensor, valid: Tensor, block: int, causal: bool,
                 check_keys: bool, scale: float) -> None:
        batch, heads, length, dim = q.shape
        self.block, self.causal, self.check_keys = block, causal, check_keys
        self.blocks = length // block
        self.rows = batch * heads * self.blocks
        self.q = (q * scale).reshape(self.rows, block, dim)  # the cache holds scaled products
        self.k = k.reshape(self.rows, block, dim)
        # Padded by `blocks` block rows on both sides: ring o's keys for all rows are one slice.
        self.k_padded = F.pad(self.k, (0, 0, 0, 0, self.blocks, self.blocks))
        self.key_valid = valid[:, None, :].expand(batch, heads, length).reshape(self.rows, block)
        self.block_of_row = torch.arange(self.rows, device=q.device) % self.blocks
        slot = torch.arange(block, device=q.device)
        self.slot_offset = slot[:, None] - slot[None, :]  # query slot a - key slot c
        self.offsets: list[int] = []  # ring order of the band
        self.scores: dict[int, Tensor] = {}  # ring -> [R, b, b] q·k·scale products
        self.computed: dict[int, Tensor] = {}  # ring -> bool [R]
        self.scored_pairs = 0

    def needed_rings(self, horizon: Tensor) -> tuple[Tensor, Tensor]:
        """Per block row, the farthest ring back (and ahead) that a query's horizon reaches."""
        slot = torch.arange(self.block, device=horizon.device)
        back = (horizon - 2 - slot + self.block).div(self.block, rounding_mode="floor")
        back = torch.minimum(back.amax(dim=1), self.block_of_row)
        if self.causal:
            return back, torch.zeros_like(back)
        ahead = (horizon - 1 + slot).div(self.block, rounding_mode="floor").amax(dim=1)
        return back, torch.minimum(ahead, self.blocks - 1 - self.block_of_row)

    def compute(self, horizon: Tensor) -> None:
        """Score every ring a query's horizon reaches and that is not computed yet."""
        back, ahead = self.needed_rings(horizon)
        farthest = max(int(back.max()), int(ahead.max()))
        layout_changed = False
        for distance in range(farthest + 1):
            for offset in ((distance,) if distance == 0 or self.causal else (distance, -distance)):
                need = (back >= offset) if offset >= 0 else (ahead >= -offset)
                if offset not in self.scores:
                    self.offsets.append(offset)
                    self.scores[offset] = self.q.new_zeros(self.rows, self.block, self.block)
                    self.computed[offset] = torch.zeros_like(need)
                    layout_changed = True
                new = need & ~self.computed[offset]
                count = int(new.sum())
                if count == 0:
                    continue
                if 2 * count >= self.rows and not bool(self.computed[offset].any()):
                    # Most rows need this ring and none has it: one product over all rows, from a
                    # slice of the keys instead of a gathered copy. Rows with no key block there
                    # score another sequence's keys, which their horizon (<= context) or the key
                    # mask excludes.
                    first = self.blocks - offset
                    torch.bmm(self.q, self.k_padded[first:first + self.rows].transpose(1, 2),
                              out=self.scores[offset])
                    self.computed[offset].fill_(True)
                    self.scored_pairs += self.rows * self.block * self.block
                    continue
                new_rows = new.nonzero().squeeze(1)
                products = torch.bmm(self.q[new_rows], self.k[new_rows - offset].transpose(1, 2))
                self.scores[offset].index_copy_(0, new_rows, products)
                self.computed[offset][new_rows] = True
                self.scored_pairs += new_rows.numel() * self.block * self.block
        if layout_changed:
            self._build_band()

    def _build_band(self) -> None:
        """Per band slot: the distance the horizon is compared with, the δ of the prior, and
        (when keys can be invalid) which block rows may read it."""
        distance = torch.cat([offset * self.block + self.slot_offset for offset in self.offsets], dim=1)
        if self.causal:  # keys ahead can never be inside a horizon
            reach = distance.masked_fill(distance < 0, 1 << 30)
            self.prior_distance = distance.clamp(min=0).to(self.q.dtype)
        else:
            reach = distance.abs()
            self.prior_distance = reach.to(self.q.dtype)
        self.width = distance.shape[1]
        # Compared with each query's horizon in `logits`; 2^30 exceeds every horizon.
        self.reach_float = reach.clamp(max=1 << 30).to(self.q.dtype)
        self.key_penalty = None
        if self.check_keys:
            parts = []
            for offset in self.offsets:
                key_block = self.block_of_row - offset
                exists = (key_block >= 0) & (key_block < self.blocks)
                key_rows = (torch.arange(self.rows, device=exists.device) - offset).clamp(0, self.rows - 1)
                parts.append(self.key_valid[key_rows] & exists[:, None])
            key_valid = torch.cat(parts, dim=1)  # [R, W]
            self.key_penalty = torch.zeros(key_valid.shape, dtype=self.q.dtype, device=key_valid.device)
            self.key_penalty.masked_fill_(~key_valid, -_EXCLUDED)

    def probabilities(self, rows: slice, horizon: Tensor, log_decay: Tensor) -> Tensor:
        """[g, b, W] softmax of `logits`; with invalid keys a (padded) query may see none, and its
        row is zeros, not NaN."""
        logits = self.logits(rows, horizon, log_decay)
        return softmax_rows(logits) if self.check_keys else logits.softmax(dim=-1)

    def ring_keys(self, rows: slice, slot: int) -> slice:
        """The key block rows of ring `slot` for block rows `rows`, in a tensor padded by
        `len(offsets)` block rows on both sides (so every ring's keys are one contiguous slice)."""
        pad = len(self.offsets)
        offset = self.offsets[slot]
        return slice(rows.start + pad - offset, rows.stop + pad - offset)

    def pad_rows(self, rows_tensor: Tensor) -> Tensor:
        """[R, b, e] -> [R + 2·len(offsets), b, e], zeros on both sides (see `ring_keys`)."""
        pad = len(self.offsets)
        return F.pad(rows_tensor, (0, 0, 0, 0, pad, pad))

    def row_groups(self) -> list[slice]:
        group = max(1, _GROUP_ELEMENTS // (self.block * self.width))
        return [slice(start, min(start + group, self.rows)) for start in range(0, self.rows, group)]

    def logits(self, rows: slice, horizon: Tensor, log_decay: Tensor) -> Tensor:
        """[g, b, W] scores·scale + δ·log(1 - q) for block rows `rows`; keys outside the
        horizon (or invalid) get a penalty <= -_EXCLUDED / 2. `horizon`, `log_decay`: [g, b]."""
        parts = [self.scores[offset][rows] for offset in self.offsets]
        logits = torch.cat(parts, dim=2)  # a fresh tensor: the terms below are added in place
        penalty = None if self.key_penalty is None else self.key_penalty[rows, None, :]
        return _add_prior(logits, self.prior_distance, self.reach_float, horizon, log_decay, penalty)

    def mean_distance(self, going_on: Tensor, horizon: Tensor, log_decay: Tensor) -> tuple[Tensor, int]:
        """E_p[δ] of every query that goes on ([R, b], zeros elsewhere), and the (query, key) entries
        touched. While most queries go on, whole block rows are processed; once fewer than
        `_GATHER_BELOW` of them do, only the going-on queries are (gathered), so a few stragglers
        do not keep their whole block row working through the last steps."""
        mean = torch.zeros(horizon.shape, dtype=log_decay.dtype, device=horizon.device)
        entries = 0
        if int(going_on.sum()) >= _GATHER_BELOW * going_on.numel():
            for rows in self.row_groups():
                if not bool(going_on[rows].any()):
                    continue
                probs = self.logits(rows, horizon[rows], log_decay[rows]).softmax(-1)
                # Rows of padded queries may be meaningless here; they never go on.
                mean[rows] = (probs * self.prior_distance).sum(dim=-1)
                entries += probs.numel()
            return mean, entries
        queries = going_on.flatten().nonzero().squeeze(1)
        chunk = max(1, _GROUP_ELEMENTS // self.width)
        flat_mean, flat_horizon, flat_decay = mean.view(-1), horizon.view(-1), log_decay.view(-1)
        for start in range(0, queries.numel(), chunk):
            some = queries[start:start + chunk]
            logits, prior = self._query_logits(some, flat_horizon[some], flat_decay[some])
            flat_mean[some] = (logits.softmax(-1).mul_(prior)).sum(dim=-1)
            entries += logits.numel()
        return mean, entries

    def _query_logits(self, queries: Tensor, horizon: Tensor, log_decay: Tensor) -> tuple[Tensor, Tensor]:
        """`logits` for single queries (flat indices into [R·b]): [n, W], and their prior δ [n, W]."""
        slots = queries % self.block
        parts = [self.scores[offset].view(-1, self.block).index_select(0, queries) for offset in self.offsets]
        logits = torch.cat(parts, dim=1)
        prior = self.prior_distance.index_select(0, slots)
        penalty = self.key_penalty
        if penalty is not None:
            penalty = penalty.index_select(0, queries // self.block)
        _add_prior(logits, prior, self.reach_float.index_select(0, slots), horizon, log_decay, penalty)
        return logits, prior

    def ring(self, band: Tensor, slot: int) -> Tensor:
        """The [g, b, b] columns of ring `slot` in a [g, b, W] band tensor."""
        return band[:, :, slot * self.block:(slot + 1) * self.block]

    def apply(self, probs: Tensor, values: Tensor, rows: slice) -> Tensor:
        """[g, b, W] probabilities @ the band's values -> [g, b, e]; `values` from `pad_rows`."""
        out = None
        for slot in range(len(self.offsets)):
            part = torch.bmm(self.ring(probs, slot), values[self.ring_keys(rows, slot)])
            out = part if out is None else out.add_(part)
        return out


class _BandAttention(torch.autograd.Function):
    """The final pass: softmax(band logits) @ band values, per row group, from the rings' cached
    q·k products; differentiable in q, k, v and log(1 - q).

    The backward rebuilds each group's probabilities from the cache and adds the key and value
    gradients ring by ring into one padded buffer, in place. Plain autograd over the per-group and
    per-ring slices allocated a zero tensor the size of the whole cache (or of v) for every slice's
    gradient, which was ~60% of the forward+backward time.
    """

    @staticmethod
    def forward(ctx, q, k, v, log_decay, rings, horizon, scale):  # q, k [R, b, d], v [R, b, e]
        values = rings.pad_rows(v)  # a Function's forward runs without autograd: no detach needed
        out = torch.cat([rings.apply(rings.probabilities(rows, horizon[rows], log_decay[rows]),
                                     values, rows) for rows in rings.row_groups()], dim=0)
        ctx.save_for_backward(q, k, values, log_decay, horizon, out)
        ctx.rings, ctx.scale = rings, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, values, log_decay, horizon, out = ctx.saved_tensors
        rings, scale = ctx.rings, ctx.scale
        keys = rings.pad_rows(k)
        grad_q = torch.empty_like(q)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        grad_decay = torch.empty_like(log_decay)
        for rows in rings.row_groups():
            probs = rings.probabilities(rows, horizon[rows], log_decay[rows])
            grad_rows = grad_out[rows]
            # Softmax backward: d logits = p (dp - Σ p dp), and Σ_j p_j dp_j = dout · out.
            row_dot = (grad_rows * out[rows]).sum(dim=-1, keepdim=True)
            grad_q_rows, grad_decay_rows = None, None
            for slot in range(len(rings.offsets)):
                ring_probs, ring_rows = rings.ring(probs, slot), rings.ring_keys(rows, slot)
                grad_values[ring_rows].baddbmm_(ring_probs.transpose(1, 2), grad_rows)
                grad_logits = torch.bmm(grad_rows, values[ring_rows].transpose(1, 2))
                grad_logits.sub_(row_dot).mul_(ring_probs)
                part = (grad_logits * rings.ring(rings.prior_distance[None], slot)).sum(dim=-1)
                grad_decay_rows = part if grad_decay_rows is None else grad_decay_rows.add_(part)
                grad_logits.mul_(scale)
                grad_keys[ring_rows].baddbmm_(grad_logits.transpose(1, 2), q[rows])
                part = torch.bmm(grad_logits, keys[ring_rows])
                grad_q_rows = part if grad_q_rows is None else grad_q_rows.add_(part)
            grad_q[rows], grad_decay[rows] = grad_q_rows, grad_decay_rows
        pad = len(rings.offsets)
        unpad = slice(pad, pad + q.shape[0])
        return grad_q, grad_keys[unpad], grad_values[unpad], grad_decay, None, None, None


def _expanding_native(
    native, q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, tol: float, max_iters: int,
    scale: float, sync_stats: bool,
) -> ExpandingOutput:
    """Causal, unpadded expanding attention by the C kernels: the inference steps per query (no
    gradient), then the final pass with log(1 - q) from the learnable α, β plus the counts.
    sync_stats=False leaves the counts as 0-d long tensors (no host sync: under torch.compile the
    whole path is one graph, custom ops included)."""
    batch, heads, length, dim = q.shape
    rows = batch * heads
    q_rows, k_rows, v_rows = (t.reshape(rows, length, -1) for t in (q, k, v))
    # Custom ops (ops/native/band.py): compile-safe; bf16/fp16 computed in fp32, and the prior's
    # statistics kept in fp32 (the δ·log(1 - q) prior needs the digits).
    horizon, steps, distance_sum, counts = expanding_infer_op(
        q_rows.detach(), k_rows.detach(), alpha.detach(), beta.detach(), heads, float(tol), max_iters, scale)
    stats_dtype = distance_sum.dtype
    per_query = (lambda per_head: per_head.to(stats_dtype).view(1, heads, 1).expand(batch, heads, length)
                 .reshape(rows, length))
    log_decay = _log_decay(per_query(alpha) + steps, per_query(beta) + distance_sum).contiguous()
    out = NativeBandAttention.apply(q_rows, k_rows, v_rows, log_decay, horizon, scale, native)
    # The final pass as the query-blocked kernel executes it (whole key tiles, three-query groups).
    final_pass = band_attend_flops_tensor(horizon, torch.arange(length).expand(rows, length), dim,
                                          v.shape[-1])
    value_pairs, step_scored, step_entries = horizon.sum(), counts[0], counts[1]
    scored_pairs = step_scored + value_pairs  # the final pass scores its keys again
    step_entries = step_entries + value_pairs
    flops = 2 * dim * step_scored + final_pass + _STEP_FLOPS_PER_ENTRY * step_entries
    totals = (scored_pairs, value_pairs, step_entries, flops)
    if sync_stats:  # one host sync for every statistic
        totals = torch.stack(totals).tolist()
    return ExpandingOutput(
        out=out.view(batch, heads, length, -1), horizon=horizon.view(batch, heads, length),
        iterations=(steps + 1).view(batch, heads, length), scored_pairs=totals[0],
        value_pairs=totals[1], step_entries=totals[2], flops=totals[3],
    )


def masked_logits(
    scores: Tensor, distance: Tensor, key_valid: Tensor, horizon: Tensor, log_decay: Tensor,
    scale: float, causal: bool,
) -> Tensor:
    """The reference's logits: scores·scale + δ·log(1 - q), keys outside [0, horizon) or padded
    set to -inf. Shapes: scores [.., Lq, Lk], distance broadcastable, horizon/log_decay [.., Lq]."""
    if not causal:
        distance = distance.abs()
    inside = (distance >= 0) & (distance < horizon[..., None]) & key_valid
    logits = scores * scale + distance.to(scores.dtype) * log_decay[..., None]
    return logits.masked_fill(~inside, float("-inf"))


def softmax_rows(logits: Tensor) -> Tensor:
    """Softmax whose all-excluded rows (padded queries) give zeros instead of NaN or uniform.
    Excluded keys are -inf (reference) or <= -_EXCLUDED / 2 (fast path)."""
    has_key = logits.amax(dim=-1, keepdim=True) > -_EXCLUDED / 4
    return torch.where(has_key, logits, torch.zeros_like(logits)).softmax(dim=-1) * has_key


def _final_pass_triton(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor, scale: float,
                       block: int) -> Tensor:
    """The final pass of the causal, unpadded band path on the Triton banded pass, in its layout:
    q, k, v [B, H, P, d|e] padded to whole blocks, log_decay and horizon [B·H·P / b, b] -> out
    [B·H·P / b, b, e]. Each query reads the `horizon` keys ending at itself under the δ·log_decay
    prior, with the gradient to log_decay (the learnable α, β)."""
    from routeformer.ops.triton.band import triton_band_attention  # triton is optional

    batch, heads, padded, dim = q.shape
    rows = batch * heads
    out = triton_band_attention(q.reshape(rows, padded, dim), k, v, log_decay.reshape(rows, padded),
                                horizon.reshape(rows, padded), scale=scale)
    return out.view(-1, block, v.shape[-1])


def expanding_uses_native(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
                          update: str) -> bool:
    """Whether `expanding_attention` runs these inputs on the C kernels: causal, unpadded, the
    paper's update (the only one the kernels implement), tensors the kernels take."""
    return expanding_backend(q, k, v, mask=mask, causal=causal, update=update)[0] == NATIVE


def expanding_attention(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, *, tol: float = 0.01,
    max_iters: int = 8, mask: Tensor | None = None, causal: bool = True, scale: float | None = None,
    block: int = DEFAULT_BLOCK, update: str = "paper", sync_stats: bool = True,
) -> ExpandingOutput:
    """Expanding attention over [B, H, T, d] tensors; `alpha`, `beta` [H] are the Beta prior's
    positive concentrations (the starting point of every query's inference). `update`: "paper"
    (the paper's accumulating update, which does not converge) or "mean_field" (a true
    coordinate-ascent step, which does). See the module docstring.

    sync_stats=False: on the native path (`expanding_uses_native`) the counts of the result stay
    0-d long tensors, so torch.compile traces the whole op as one graph (its kernels are custom
    ops). The band path reads data-dependent sizes and always returns ints."""
    check_qkv(q, k, v, mask, causal=True)
    check_expanding_options(tol, max_iters, update)
    check_positive("block", block)
    batch, heads, length, dim = q.shape
    _check_prior(alpha, beta, heads)
    scale = dim ** -0.5 if scale is None else scale
    # The C kernels (ops/native) for causal, unpadded inputs: faster than the band path below at
    # every prior measured, from 47-key windows to the whole context (T = 1024-16384;
    # docs/results/structural.md).
    if expanding_uses_native(q, k, v, mask=mask, causal=causal, update=update):
        return _expanding_native(native_kernels(q, k, v), q, k, v, alpha, beta, tol, max_iters, scale,
                                 sync_stats)
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    if q.dtype != compute_dtype:
        # bf16/fp16 run in fp32 (autograd casts the gradients back): the band's distances and
        # horizons are not exact in bf16 beyond 256, the δ·log(1 - q) prior loses the scores'
        # digits, and the exclusion penalty overflows fp16. Memory: fp32 copies of q, k, v, O(T·d).
        result = expanding_attention(
            q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), alpha, beta, tol=tol,
            max_iters=max_iters, mask=mask, causal=causal, scale=scale, block=block, update=update)
        return replace(result, out=result.out.to(q.dtype))
    block = min(block, length)  # a block longer than the sequence would only score padding
    blocks = -(-length // block)
    pad = blocks * block - length
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        valid = F.pad(valid, (0, pad), value=False)
    masked = mask is not None
    rings = _Rings(q.detach(), k.detach(), valid, block, causal, check_keys=masked or not causal, scale=scale)
    shape = (rings.rows, block)
    positions = torch.arange(blocks * block, device=q.device)
    context = _context(valid, causal)[:, None, :].expand(batch, heads, -1).reshape(shape)
    is_query = (positions < length).view(1, 1, -1).expand(batch, heads, -1).reshape(shape)
    stats_dtype = torch.promote_types(q.dtype, torch.float32)

    def per_query(per_head: Tensor) -> Tensor:  # [H] -> [R, b]
        per_head = per_head.to(stats_dtype).view(1, heads, 1, 1)
        return per_head.expand(batch, heads, blocks, block).reshape(shape)

    alpha_start, beta_start = per_query(alpha.detach()), per_query(beta.detach())
    steps = torch.zeros(shape, dtype=torch.long, device=q.device)
    expected_distance_sum = torch.zeros(shape, dtype=stats_dtype, device=q.device)
    horizon = torch.ones(shape, dtype=torch.long, device=q.device)
    previous = torch.zeros_like(horizon)
    # Padded queries take no inference step: their window stays the prior's.
    active = is_query & rings.key_valid
    step_entries = 0
    mean_field = update == "mean_field"
    # mean_field: E[δ] of the last step, and the queries whose E[δ] has converged (they take one
    # more step to set their horizon from it, then stop).
    last_mean = torch.zeros(shape, dtype=stats_dtype, device=q.device)
    converged = torch.zeros_like(is_query)
    for step in range(max_iters):
        if mean_field:
            step_decay = _mean_field_log_decay(alpha_start + (steps > 0).to(stats_dtype),
                                               beta_start + last_mean)
            new_horizon = _mean_field_horizon(step_decay, tol, context)
            stop = converged | (step == max_iters - 1)
        else:
            alpha_t, beta_t = alpha_start + steps, beta_start + expected_distance_sum
            new_horizon = geometric_horizon(alpha_t, beta_t, tol, context)
            stop = _stop_now(step, max_iters, new_horizon, previous, context)
            step_decay = _log_decay(alpha_t, beta_t)
        horizon = torch.where(is_query & (active | (step == 0)), new_horizon, horizon)
        rings.compute(horizon)  # the final pass reuses these products
        going_on = active & ~stop
        if bool(going_on.any()):
            with torch.no_grad():  # the inference steps pass no gradient (module docstring)
                mean_distance, entries = rings.mean_distance(going_on, horizon, step_decay)
            step_entries += entries
            if mean_field:
                converged = going_on & (steps > 0) & _mean_field_converged(mean_distance, last_mean)
                last_mean = torch.where(going_on, mean_distance, last_mean)
            else:
                expected_distance_sum += torch.where(going_on, mean_distance, 0.0)
            steps += going_on.long()
        previous = new_horizon
        active = going_on
        if not bool(active.any()):
            break
    # Final step with gradients: the prior's q from the learnable α, β plus the inferred counts.
    if mean_field:
        log_decay = _mean_field_log_decay(per_query(alpha) + (steps > 0).to(stats_dtype),
                                          per_query(beta) + last_mean)
    else:
        log_decay = _log_decay(per_query(alpha) + steps, per_query(beta) + expected_distance_sum)
    if expanding_final_pass_backend(q, causal, masked)[0] == TRITON:
        out = _final_pass_triton(q, k, v, log_decay, horizon, scale, block)
    else:
        out = _BandAttention.apply(q.reshape(rings.rows, block, dim), k.reshape(rings.rows, block, dim),
                                   v.reshape(rings.rows, block, -1), log_decay, rings, horizon, scale)
    step_entries += rings.rows * block * rings.width
    unpadded = (slice(None), slice(None), slice(0, length))
    final_steps = steps + is_query.long()  # the final step counts as one
    band_pairs = rings.rows * block * rings.width
    flops = (2 * dim * rings.scored_pairs + 2 * v.shape[-1] * band_pairs
             + _STEP_FLOPS_PER_ENTRY * step_entries)
    return ExpandingOutput(
        out=out.view(batch, heads, blocks * block, -1)[unpadded],
        horizon=horizon.view(batch, heads, -1)[unpadded],
        iterations=final_steps.view(batch, heads, -1)[unpadded],
        scored_pairs=rings.scored_pairs,
        value_pairs=band_pairs,
        step_entries=step_entries,
        flops=flops,
    )


class WindowInference:
    """The per-query state of the window inference that the reference and cached decoding
    (ops/expanding_decode.py) both run: steps taken, Σ E[δ] (geometric update) or the last E[δ]
    (mean field), convergence and the last horizon. `alpha_start`, `beta_start` [B, H, T] are the
    prior's parameters (detached: no gradient flows through the inference steps)."""

    def __init__(self, alpha_start: Tensor, beta_start: Tensor, dtype: torch.dtype, *, mean_field: bool,
                 tol: float, context: Tensor, max_iters: int) -> None:
        self.alpha_start, self.beta_start, self.dtype = alpha_start, beta_start, dtype
        self.mean_field, self.tol, self.context, self.max_iters = mean_field, tol, context, max_iters
        shape, device = alpha_start.shape, alpha_start.device
        self.steps = torch.zeros(shape, dtype=torch.long, device=device)
        self.distance_sum = torch.zeros(shape, dtype=dtype, device=device)
        self.last_mean = torch.zeros_like(self.distance_sum)  # mean field: E[δ] of the last step
        self.previous = torch.zeros_like(self.steps)
        self.converged = torch.zeros(shape, dtype=torch.bool, device=device)

    def propose(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """(horizon, stop, log decay) of inference step `step` from the state so far."""
        if self.mean_field:
            decay = _mean_field_log_decay(self.alpha_start + (self.steps > 0).to(self.dtype),
                                          self.beta_start + self.last_mean)
            return (_mean_field_horizon(decay, self.tol, self.context),
                    self.converged | (step == self.max_iters - 1), decay)
        alpha_t, beta_t = self.alpha_start + self.steps, self.beta_start + self.distance_sum
        horizon = geometric_horizon(alpha_t, beta_t, self.tol, self.context)
        return horizon, _stop_now(step, self.max_iters, horizon, self.previous, self.context), \
            _log_decay(alpha_t, beta_t)

    def advance(self, new_horizon: Tensor, going_on: Tensor, mean: Tensor) -> None:
        """Take the step for the queries `going_on`, whose window gave E[δ] = `mean`."""
        if self.mean_field:
            self.converged = going_on & (self.steps > 0) & _mean_field_converged(mean, self.last_mean)
            self.last_mean = torch.where(going_on, mean, self.last_mean)
        else:
            self.distance_sum += torch.where(going_on, mean, 0.0)
        self.steps += going_on.long()
        self.previous = new_horizon

    def final_log_decay(self, alpha_start: Tensor, beta_start: Tensor) -> Tensor:
        """The posterior's log decay after the steps taken, from `alpha_start`, `beta_start` (the
        reference passes them undetached: the final pass is where α, β learn)."""
        if self.mean_field:
            return _mean_field_log_decay(alpha_start + (self.steps > 0).to(self.dtype),
                                         beta_start + self.last_mean)
        return _log_decay(alpha_start + self.steps, beta_start + self.distance_sum)


def expanding_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, *, tol: float = 0.01,
    max_iters: int = 8, mask: Tensor | None = None, causal: bool = True, scale: float | None = None,
    update: str = "paper",
) -> tuple[Tensor, Tensor, Tensor]:
    """The specification: every q·k product, the iterations with an explicit horizon mask.

    Returns (out [B, H, T, d], horizon [B, H, T], iterations [B, H, T])."""
    check_qkv(q, k, v, mask, causal=True)
    check_expanding_options(tol, max_iters, update)
    batch, heads, length, dim = q.shape
    _check_prior(alpha, beta, heads)
    scale = dim ** -0.5 if scale is None else scale
    positions = torch.arange(length, device=q.device)
    distance = positions[:, None] - positions[None, :]  # δ = i - j
    key_valid = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=q.device)
    if mask is not None:
        key_valid = mask[:, None, None, :]
    context = _context(key_valid[:, 0, 0, :].expand(batch, length), causal)[:, None, :].expand(
        batch, heads, length)
    scores = q @ k.transpose(-1, -2)
    alpha_start = alpha.view(1, heads, 1).expand(batch, heads, length)
    beta_start = beta.view(1, heads, 1).expand(batch, heads, length)
    inference = WindowInference(alpha_start.detach(), beta_start.detach(), scores.dtype,
                                mean_field=update == "mean_field", tol=tol, context=context,
                                max_iters=max_iters)
    horizon = torch.ones_like(inference.steps)
    # Padded queries take no inference step: their window stays the prior's.
    active = key_valid[:, :, 0, :].expand(batch, heads, length).clone()
    with torch.no_grad():
        for step in range(max_iters):
            new_horizon, stop, step_decay = inference.propose(step)
            horizon = torch.where(active | (step == 0), new_horizon, horizon)
            probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, step_decay, scale,
                                                 causal))
            lengths = distance if causal else distance.abs()
            going_on = active & ~stop
            inference.advance(new_horizon, going_on, (probs * lengths.to(probs.dtype)).sum(-1))
            active = going_on
    log_decay = inference.final_log_decay(alpha_start, beta_start)
    probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, log_decay, scale, causal))
    return probs @ v, horizon, inference.steps + 1
