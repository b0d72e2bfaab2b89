"""Top-k routing when the routing keys repeat (axes as in routing.py; U distinct keys, N = B·R).

A position-blind router's first layer reads only the token, so its S routing keys take at most
vocabulary-many distinct values (15 on compare --long's T = 4096 recall). Equal keys score equally
for every query and tie to the lower index, so a query's routed set is whole groups of equal keys
in descending score, and the lowest-index members of the group (or tie class of groups) it stops
in. Here the groups are found (a sort of S fingerprints a row, checked exactly, after a cheap
refusal where the row's first few hundred keys already hold too many distinct ones); the C kernel
(ops/native/topk_groups_kernels.c) scores the U group vectors per query and walks down them:
O(T·U·r + T·K) instead of O(T·S·r), with route_topk_f32's scores and tie rule bit for bit.
Causal only; eager only (the group count is read on the host); CPU with the native library.

`route_repeated_keys` returns None — the caller routes as usual — when the keys do not repeat
enough (more than S / REPEATED_KEYS_SHARE or REPEATED_KEYS_GROUPS distinct), the sequence is
shorter than REPEATED_KEYS_MIN, a value is not finite, or no native library is built. Measured
on that recall model's first layer, one thread: scripts/blind_router_costs.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.native import native_kernels
from routeformer.ops.native.topk import route_topk_groups
from routeformer.ops.topk.slots import routing_slots

REPEATED_KEYS_MIN = 1024  # shorter sequences route fast enough as they are
REPEATED_KEYS_SHARE = 16  # at most S / 16 distinct keys ...
REPEATED_KEYS_GROUPS = 256  # ... and at most 256 (a byte vocabulary)


def route_repeated_keys(
    route_q: Tensor, route_k: Tensor, topk: int, key_mask: Tensor | None, local_window: int,
    global_tokens: int,
) -> tuple[Tensor, Tensor, int] | None:
    """`route_topk` (causal) by groups of equal routing keys, or None where that does not apply.
    Returns (index [B, R, T, K], valid, routing scores computed) as route_topk does."""
    batch, heads, length, dim = route_q.shape
    num_keys = route_k.shape[2]
    slots = routing_slots(topk, local_window, global_tokens, num_keys)
    if (torch.compiler.is_compiling() or num_keys < REPEATED_KEYS_MIN or length != num_keys
            or slots != topk + local_window + global_tokens or native_kernels(route_q, route_k) is None):
        return None
    rows = batch * heads
    keys = route_k.reshape(rows, num_keys, dim)
    if _prefix_has_too_many_groups(keys):  # most routing: settled on a few hundred keys a row
        return None
    if not bool(torch.isfinite(keys).all()) or not bool(torch.isfinite(route_q).all()):
        return None
    grouping = _groups(keys)
    if grouping is None:
        return None
    group, first, count = grouping
    representatives = keys.gather(1, first.clamp_max(num_keys - 1)[..., None].expand(-1, -1, dim))
    if not torch.equal(keys, representatives.gather(1, group[..., None].expand(-1, -1, dim))):
        return None  # two distinct vectors share a fingerprint: route as usual
    members, starts, key_group = _members(group, count, key_mask, heads, global_tokens)
    index, valid = route_topk_groups(route_q.reshape(rows, length, dim).float(), representatives.float(),
                                     members, starts, key_group, key_mask, heads, slots, local_window,
                                     global_tokens)
    shape = (batch, heads, length, slots)
    return index.view(shape), valid.view(shape), rows * length * count


def _most_groups(num_keys: int) -> int:
    """The most distinct keys a row may have for routing by groups."""
    return min(REPEATED_KEYS_GROUPS, num_keys // REPEATED_KEYS_SHARE)


def _fingerprint(keys: Tensor) -> Tensor:
    """[N, S, r] -> [N, S] float64: a fixed projection (equal vectors project equally)."""
    weights = torch.randn(keys.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (keys.double() * weights.to(keys.device)).sum(-1)


def _prefix_has_too_many_groups(keys: Tensor) -> bool:
    """Whether the first 4 x (limit + 1) keys of some row already hold more distinct fingerprints
    than a row may have (a row has at least as many as any part of it, so `_groups` would refuse
    too). Why: fingerprinting and sorting all S keys cost ~20 ms a call at T = 16384, 4 rows (2
    threads, AMD EPYC), 5 % of that routing call, spent on rows that never repeat; this costs a
    fraction of a millisecond. NaN fingerprints count as distinct, as in `_groups`."""
    limit = _most_groups(keys.shape[1])
    ordered = _fingerprint(keys[:, : 4 * (limit + 1)]).sort(dim=-1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(-1)
    return bool((distinct > limit).any())


def _groups(keys: Tensor) -> tuple[Tensor, Tensor, int] | None:
    """(group id of each key [N, S], each group's lowest key index [N, U] (S for padding groups),
    U) by an exact fingerprint (`_fingerprint`; the caller checks that members equal their group's
    first key), or None with too many groups."""
    rows, num_keys, dim = keys.shape
    ordered, order = torch.sort(_fingerprint(keys), dim=-1, stable=True)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    count = int(new.sum(-1).max())
    if count > _most_groups(num_keys):
        return None
    group = torch.empty_like(order).scatter_(-1, order, new.long().cumsum(-1) - 1)
    positions = torch.arange(num_keys, device=keys.device).expand(rows, num_keys)
    first = torch.full((rows, count), num_keys, dtype=torch.long, device=keys.device)
    first.scatter_reduce_(-1, group, positions, "amin")
    return group, first, count


def _members(group: Tensor, count: int, key_mask: Tensor | None, heads: int,
             global_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The keys that can be routed (real, not global) sorted by (group, key) [N, S] (the others
    last), each group's first position there [N, U + 1], each key's group where routable, else U."""
    rows, num_keys = group.shape
    positions = torch.arange(num_keys, device=group.device)
    routable = (positions >= global_tokens).expand(rows, num_keys)
    if key_mask is not None:
        routable = routable & key_mask.repeat_interleave(heads, dim=0)
    key_group = torch.where(routable, group, count)
    codes = (key_group * (num_keys + 1) + positions).sort(dim=-1).values
    bounds = torch.arange(count + 1, device=group.device) * (num_keys + 1)
    starts = torch.searchsorted(codes, bounds.expand(rows, -1).contiguous())
    return codes % (num_keys + 1), starts, key_group
