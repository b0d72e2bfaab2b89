"""Expanding attention's band path (the algorithm: ops/expanding/op.py's module docstring): the
block-row layout with its cache of ring scores (`BandRings`), the prior added in place
(`add_prior`), and the final pass as one autograd function (`BandAttention`) whose backward
rebuilds the probabilities from the cache ring by ring."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from routeformer.ops.expanding.prior import EXCLUDED, softmax_rows

# Band entries per row group (~4 MB in fp32).
GROUP_ELEMENTS = 1 << 20
# An inference step gathers the going-on queries once fewer than this fraction of all go on.
GATHER_BELOW = 0.5


def add_prior(logits: Tensor, prior: Tensor, reach: Tensor, horizon: Tensor, log_decay: Tensor,
               key_penalty: Tensor | None) -> Tensor:
    """In place: logits + δ·log(1 - q), keys beyond the horizon (or invalid) pushed to
    <= -EXCLUDED / 2. `prior`, `reach` broadcast to `logits` [..., W]; `horizon`, `log_decay`
    are per query ([...])."""
    logits.addcmul_(prior, log_decay[..., None].to(logits.dtype))
    # min(0, H - 1/2 - reach): 0 inside the horizon, <= -1/2 outside.
    beyond = (horizon[..., None].to(logits.dtype) - 0.5 - reach).clamp_(max=0.0)
    logits.add_(beyond, alpha=EXCLUDED)
    if key_penalty is not None:
        logits.add_(key_penalty)
    return logits


class BandRings:
    """Block-row layout, the cache of computed ring scores, and the band they form.

    Row groups: every pass over the band runs over contiguous groups of block rows whose band
    holds about `GROUP_ELEMENTS` entries, so elementwise temporaries stay small and are reused
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
            self.key_penalty.masked_fill_(~key_valid, -EXCLUDED)

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
        group = max(1, GROUP_ELEMENTS // (self.block * self.width))
        return [slice(start, min(start + group, self.rows)) for start in range(0, self.rows, group)]

    def logits(self, rows: slice, horizon: Tensor, log_decay: Tensor) -> Tensor:
        """[g, b, W] scores·scale + δ·log(1 - q) for block rows `rows`; keys outside the
        horizon (or invalid) get a penalty <= -EXCLUDED / 2. `horizon`, `log_decay`: [g, b]."""
        parts = [self.scores[offset][rows] for offset in self.offsets]
        logits = torch.cat(parts, dim=2)  # a fresh tensor: the terms below are added in place
        penalty = None if self.key_penalty is None else self.key_penalty[rows, None, :]
        return add_prior(logits, self.prior_distance, self.reach_float, horizon, log_decay, penalty)

    def mean_distance(self, going_on: Tensor, horizon: Tensor, log_decay: Tensor) -> tuple[Tensor, int]:
        """E_p[δ] of every query that goes on ([R, b], zeros elsewhere), and the (query, key) entries
        touched. While most queries go on, whole block rows are processed; once fewer than
        `GATHER_BELOW` of them do, only the going-on queries are (gathered), so a few stragglers
        do not keep their whole block row working through the last steps."""
        mean = torch.zeros(horizon.shape, dtype=log_decay.dtype, device=horizon.device)
        entries = 0
        if int(going_on.sum()) >= GATHER_BELOW * going_on.numel():
            for rows in self.row_groups():
                if not bool(going_on[rows].any()):
                    continue
                probs = self.logits(rows, horizon[rows], log_decay[rows]).softmax(-1)
                # Rows of padded queries may be meaningless here; they never go on.
                mean[rows] = (probs * self.prior_distance).sum(dim=-1)
                entries += probs.numel()
            return mean, entries
        queries = going_on.flatten().nonzero().squeeze(1)
        chunk = max(1, GROUP_ELEMENTS // self.width)
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
        add_prior(logits, prior, self.reach_float.index_select(0, slots), horizon, log_decay, penalty)
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


class BandAttention(torch.autograd.Function):
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
