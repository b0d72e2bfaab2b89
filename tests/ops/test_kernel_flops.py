"""The C kernels' FLOP counts (ops/native/kernel_flops.py) against a loop-by-loop replay of
band_kernels.c and linear_rows_kernels.c (the constants are the kernels' #defines)."""

import pytest
import torch

from routeformer.ops.native.kernel_flops import (
    BAND_KEY_TILE,
    BAND_QUERY_BLOCK,
    GROUP,
    LINEAR_CHUNK,
    band_attend_flops,
    linear_rows_flops,
)


def replay_band(horizon, positions, dim, value_dim):
    flops = 0
    for bh in range(horizon.shape[0]):
        for m0 in range(0, horizon.shape[1], BAND_QUERY_BLOCK):
            block = range(m0, min(m0 + BAND_QUERY_BLOCK, horizon.shape[1]))
            live = [(int(positions[bh, m]), int(horizon[bh, m])) for m in block]
            bands = [(p - h + 1, p) if h > 0 else None for p, h in live]
            real = [b for b in bands if b]
            if not real:
                continue
            lo, hi = min(b[0] for b in real), max(b[1] for b in real)
            tiles = hi // BAND_KEY_TILE - lo // BAND_KEY_TILE + 1
            flops += 2 * dim * BAND_QUERY_BLOCK * BAND_KEY_TILE * tiles
            for g in range(0, BAND_QUERY_BLOCK, GROUP):
                group = [b for b in bands[g:g + GROUP] if b]
                if group:
                    span = max(b[1] for b in group) - min(b[0] for b in group) + 1
                    flops += 2 * value_dim * GROUP * span
    return flops


def replay_linear(rows, valid, heads, dim, value_dim, length):
    flops = 0
    for b in range(rows.shape[0]):
        slots = [int(r) for r, ok in zip(rows[b], valid[b], strict=True) if ok]
        m = 0
        for j0 in range(0, length, LINEAR_CHUNK):
            if m == len(slots):
                break
            in_chunk = []
            while m < len(slots) and slots[m] < j0 + LINEAR_CHUNK:
                in_chunk.append(slots[m])
                m += 1
            for at in range(0, len(in_chunk), GROUP):
                group = in_chunk[at:at + GROUP]
                flops += GROUP * 2 * (dim * value_dim + dim * LINEAR_CHUNK + dim)
                flops += 2 * GROUP * (group[-1] - j0 + 1) * value_dim
            if m == len(slots):
                break
            keys = min(LINEAR_CHUNK, length - j0)
            flops += keys * (2 * (-(-dim // GROUP) * GROUP) * value_dim + dim)
    return heads * flops


@pytest.mark.parametrize("seed", range(4))
def test_band_count_replays_the_kernel(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, queries = 3, 29
    positions = torch.sort(torch.randint(0, 200, (rows, queries), generator=gen), dim=1).values
    horizon = torch.minimum(torch.randint(0, 70, (rows, queries), generator=gen), positions + 1)
    horizon[0, 5:11] = 0  # a whole block of empty slots
    assert band_attend_flops(horizon, positions, 16, 8) == replay_band(horizon, positions, 16, 8)


@pytest.mark.parametrize("seed", range(4))
def test_linear_rows_count_replays_the_kernel(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, slots, length = 3, 40, 300
    rows = torch.zeros(batch, slots, dtype=torch.long)
    valid = torch.zeros(batch, slots, dtype=torch.bool)
    for b, count in enumerate((40, 17, 0)):
        chosen = torch.sort(torch.randperm(length, generator=gen)[:count]).values
        rows[b, :count], valid[b, :count] = chosen, True
    expected = replay_linear(rows, valid, 2, 10, 7, length)
    assert linear_rows_flops(rows, valid, 2, 10, 7) == expected > 0
