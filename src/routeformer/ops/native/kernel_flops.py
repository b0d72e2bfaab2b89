"""FLOPs the C kernels execute (forward), counted from their loop structure, not from the pairs a
row needs: `stats["flops"]` is a measurement of executed work (ops/flops.py).

Axes: R rows of (batch, head), M query slots. Multiply-adds count 2; the softmax's exp and the
normalisations are not counted (as everywhere in routeformer's counts).

- `band_attend_flops` (band_kernels.c): a block of BQ = 6 queries scores all BQ query slots (empty
  ones too) against every 16-key tile of the union of its queries' bands, then sums values per
  group of three queries (a missing third repeats the first) over the group's common key range.
- `linear_rows_flops` (linear_rows_kernels.c): one sweep per row in 32-key chunks; the valid
  slots of a chunk go in groups of three (padded likewise), each reading the d×e state, scoring
  all 32 keys of the chunk and summing the values up to the group's last position; every chunk
  before the last valid slot's joins the state, ⌈d/3⌉·3 state rows per key.
These constants mirror the C `#define`s; tests/ops/test_kernel_flops.py checks the counts against
a loop-by-loop replay of the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BAND_QUERY_BLOCK = 6  # BQ in band_kernels.c
BAND_KEY_TILE = 16  # BV
LINEAR_CHUNK = 32  # LINEAR_CHUNK in linear_rows_kernels.c
GROUP = 3  # both kernels process three rows per pass (weighted_rows3)
_FAR = 1 << 62


def band_attend_flops(horizon: Tensor, positions: Tensor, dim: int, value_dim: int) -> int:
    """Executed FLOPs of `band_attend` with `horizon` [R, M] (0 = an empty slot) and key `positions`
    [R, M] (expand a [B, M] tensor over the heads first)."""
    return int(band_attend_flops_tensor(horizon, positions, dim, value_dim))


def band_attend_flops_tensor(horizon: Tensor, positions: Tensor, dim: int, value_dim: int) -> Tensor:
    """`band_attend_flops` as a 0-d long tensor, so a caller reads it with its other statistics in
    one host sync (each int() is a graph break under torch.compile)."""
    rows, queries = horizon.shape
    if rows * queries == 0:
        return torch.zeros((), dtype=torch.long, device=horizon.device)
    blocks = -(-queries // BAND_QUERY_BLOCK)
    pad = blocks * BAND_QUERY_BLOCK - queries
    horizon = F.pad(horizon, (0, pad)).view(rows, blocks, BAND_QUERY_BLOCK)
    last = F.pad(positions, (0, pad)).view(rows, blocks, BAND_QUERY_BLOCK)
    live = horizon > 0
    first = torch.where(live, last - horizon + 1, _FAR)
    last = torch.where(live, last, -1)
    lo, hi = first.amin(-1), last.amax(-1)
    tiles = torch.where(hi >= 0, hi.div(BAND_KEY_TILE, rounding_mode="floor")
                        - lo.div(BAND_KEY_TILE, rounding_mode="floor") + 1, 0)  # no live slot: none
    scores = 2 * dim * BAND_QUERY_BLOCK * BAND_KEY_TILE * tiles.sum()
    groups = BAND_QUERY_BLOCK // GROUP
    group_from = first.view(rows, blocks, groups, GROUP).amin(-1)
    group_to = last.view(rows, blocks, groups, GROUP).amax(-1)
    spans = (group_to - group_from + 1).clamp(min=0)
    return scores + 2 * value_dim * GROUP * spans.sum()


def linear_rows_flops(rows: Tensor, valid: Tensor, heads: int, dim: int, value_dim: int) -> int:
    """Executed FLOPs of the linear-rows forward sweep for selected `rows` [B, M] (ascending over
    the valid slots, which come first) repeated over `heads`."""
    if rows.numel() == 0:
        return 0
    slots = rows.shape[1]
    chunk = torch.where(valid, rows.div(LINEAR_CHUNK, rounding_mode="floor"), -1)
    index = torch.arange(slots, device=rows.device).expand_as(rows)
    starts = torch.ones_like(valid)
    starts[:, 1:] = chunk[:, 1:] != chunk[:, :-1]
    first_of_chunk = torch.where(starts, index, 0).cummax(dim=1).values
    rank = index - first_of_chunk  # place of the slot among its chunk's valid slots
    next_chunk = torch.cat([chunk[:, 1:], chunk.new_full((chunk.shape[0], 1), -1)], dim=1)
    closes_group = valid & ((rank % GROUP == GROUP - 1) | (next_chunk != chunk))
    groups = int(closes_group.sum())
    reach = int(torch.where(closes_group, rows - chunk * LINEAR_CHUNK + 1, 0).sum())
    per_group = GROUP * (dim * value_dim + dim * LINEAR_CHUNK + dim) * 2
    group_flops = groups * per_group + 2 * GROUP * value_dim * reach
    # Chunks before the last valid slot's join the state: ⌈d/3⌉·3 state rows of e, plus z.
    last_chunk = chunk.amax(dim=1).clamp(min=0)
    swept = int(last_chunk.sum()) * LINEAR_CHUNK
    state_rows = -(-dim // GROUP) * GROUP
    sweep_flops = swept * (2 * state_rows * value_dim + dim)
    return heads * (group_flops + sweep_flops)
