"""Incremental (cached) decoding primitives: attention of t new queries over cached keys.

Axes: B batch, H heads, t new tokens, L cached + new keys, d head dim.

Indices are token counts, not positional encodings: the n-th token of the stream has index n,
whatever position its rotary angle or embedding uses (meta-tokens may zero it). A query of index i
reads the keys of index j <= i (and, with a window w, i - j < w) — the causal rule of the parallel
layers, so decoding token by token gives the parallel forward pass's outputs.

Storage (`append_rows`): cached rows live in preallocated buffers that grow by doubling, and
readers get views of the live rows, so a token costs O(1) amortised copying instead of the
O(L) of concatenating the cache with it (O(T²) per sequence). Every tensor of a state keeps the
batch first and every count is a plain int: beam reordering and batch selection map the tensors
along dim 0 and nothing else.

The reference these are tested against is the parallel layer itself (tests/models/test_cache.py,
tests/models/test_generate_cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def append_rows(cache: dict, rows: dict[str, Tensor], prefix: str = "", *,
                capacity: int | None = None) -> dict[str, Tensor]:
    """Append the t new rows (dim 2) of each tensor of `rows` [B, X, t, ...] to the cache's buffer
    for that name, without copying what is cached: return, and store as `cache[prefix + name]`,
    views of the live rows (old + new) of each buffer.

    A buffer (`cache[prefix + name + "_buffer"]`, [B, X, capacity, ...]) is allocated once with room
    to spare and reused: appending writes the new rows in place; only when they do not fit is a
    buffer twice as long (or as long as needed) allocated and the live rows copied into it, so the
    copies cost O(1) per row amortised (doubling), instead of the O(L) of a concatenation per step
    (O(T²) per sequence). The first allocation takes `capacity` rows (default: `cache["reserve"]`
    for the unprefixed group, the stream length `CausalLM.generate` announces; else just what is
    needed). Rows dropped from the front by `trim_rows` leave room there: when the live rows fill
    at most half the buffer they are moved back to its start (a window's keys: one copy of the
    window every ~capacity/2 steps) instead of growing it.

    Names appended together share one row count (`prefix + "filled"`), buffer offset
    (`prefix + "offset"`) and stream index of the first live row (`prefix + "start"`). Every tensor
    of the state keeps the batch first and every count is a plain int, so beam reordering and batch
    selection (which map each tensor along dim 0) keep working.
    """
    names = list(rows)
    new = rows[names[0]].shape[2]
    offset, filled = cache.get(prefix + "offset", 0), cache.get(prefix + "filled", 0)
    need = filled + new
    buffer = cache.get(prefix + names[0] + "_buffer")
    room = 0 if buffer is None else buffer.shape[2]
    if offset + need > room:
        if buffer is not None and 2 * need <= room:
            # Compact: offset > room - need >= room / 2 >= filled, so source and target do not overlap.
            for name in names:
                held = cache[prefix + name + "_buffer"]
                held[:, :, :filled].copy_(held[:, :, offset:offset + filled])
        else:
            if buffer is None:
                first = capacity if capacity is not None else (cache.get("reserve", 0) if not prefix else 0)
                size = max(need, first)
            else:
                size = max(need, 2 * room)
            for name in names:
                tensor, held = rows[name], cache.get(prefix + name + "_buffer")
                fresh = tensor.new_empty(tensor.shape[0], tensor.shape[1], size, *tensor.shape[3:])
                if held is not None and filled:
                    fresh[:, :, :filled].copy_(held[:, :, offset:offset + filled])
                cache[prefix + name + "_buffer"] = fresh
        offset = 0
    for name in names:
        held = cache[prefix + name + "_buffer"]
        held[:, :, offset + filled:offset + need].copy_(rows[name])
        cache[prefix + name] = held[:, :, offset:offset + need]
    cache[prefix + "offset"], cache[prefix + "filled"] = offset, need
    return {name: cache[prefix + name] for name in names}


def trim_rows(cache: dict, keep: int, names: tuple[str, ...], prefix: str = "") -> None:
    """Drop all but the last `keep` live rows of the group `prefix` (a window never reads further
    back): the views move, nothing is copied; the buffer's front is reused by `append_rows`."""
    filled = cache.get(prefix + "filled", 0)
    drop = max(0, filled - keep)
    if drop:
        offset = cache.get(prefix + "offset", 0) + drop
        for name in names:
            held = cache[prefix + name + "_buffer"]
            cache[prefix + name] = held[:, :, offset:offset + keep]
        cache[prefix + "offset"], cache[prefix + "filled"] = offset, keep
        cache[prefix + "start"] = cache.get(prefix + "start", 0) + drop


def append_keys_values(cache: dict, k: Tensor, v: Tensor, prefix: str = "", *,
                       capacity: int | None = None) -> tuple[Tensor, Tensor, int]:
    """Append the new k, v [B, H, t, d] to the cached keys/values (`append_rows`: in place, amortised
    growth); return every cached key and value (old + new, views `cache[prefix + "k"/"v"]`) and the
    stream index of the first one (`prefix + "start"`, 0 until trimmed)."""
    both = append_rows(cache, {"k": k, "v": v}, prefix, capacity=capacity)
    return both["k"], both["v"], cache.get(prefix + "start", 0)


def trim_keys_values(cache: dict, keep: int, prefix: str = "") -> None:
    """Drop all but the last `keep` cached keys/values (a window never reads further back)."""
    trim_rows(cache, keep, ("k", "v"), prefix)


def state_bytes(state) -> int:
    """Bytes held by the tensors of a decode state (dicts and lists of them, nested), each storage
    counted once: a view and its buffer are one allocation."""
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(state)
    return sum(seen.values())


def allowed_cached(query_index: Tensor, key_index: Tensor, window: int | None = None) -> Tensor:
    """bool [t, L]: key j may be read by query i (j <= i, and i - j < window if a window is set)."""
    distance = query_index[:, None] - key_index[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
    """SDPA for cache reads. On CUDA the cuDNN backend is left out: it builds a graph for every new
    key length, and a decoding step's key length grows by one each step (measured on an H100, bf16,
    one layer at 4k keys: ~42 ms of host time per step in `_cudnn_attention_forward` for 15 µs of
    GPU work); flash / memory-efficient attention have no such per-shape cost. k, v with fewer heads
    than q (grouped-query attention) go through SDPA's `enable_gqa`."""
    options["enable_gqa"] = q.shape[1] != k.shape[1]
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **options)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, **options)


def cached_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, query_start: int, key_start: int, window: int | None = None,
) -> Tensor:
    """softmax(q kᵀ / sqrt(d)) v for q [B, H, t, d] of indices query_start.. over k, v [B, G, L, d]
    of indices key_start.., under the causal (and window) rule; G dividing H (grouped-query
    attention: query head h reads K/V head h // (H / G)). k, v may be views of a longer buffer
    (strided heads): SDPA reads them in place."""
    if window is None and query_start == key_start and q.shape[2] == k.shape[2]:
        # A prefill (the queries are all the keys): SDPA's causal kernel, no T×T mask built.
        return _sdpa(q, k, v, is_causal=q.shape[2] > 1)
    last_query, first_key, last_key = query_start + q.shape[2] - 1, key_start, key_start + k.shape[2] - 1
    if last_key <= query_start and (window is None or last_query - first_key < window):
        # Every query reads every key (a one-token step): no mask to build.
        return _sdpa(q, k, v)
    device = q.device
    query_index = torch.arange(query_start, query_start + q.shape[2], device=device)
    key_index = torch.arange(key_start, key_start + k.shape[2], device=device)
    allowed = allowed_cached(query_index, key_index, window)
    if bool(allowed.all()):
        return _sdpa(q, k, v)
    return _sdpa(q, k, v, attn_mask=allowed)


def start_linear_state(phi_k: Tensor, v: Tensor, cache: dict) -> None:
    """The running state after a prefill computed by the chunked parallel op."""
    cache["state"] = phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = phi_k.sum(dim=2)


def advance_linear_state(phi_k: Tensor, v: Tensor, cache: dict) -> None:
    """Add t new tokens to the running state (started at zero) without reading it: for a step
    whose tokens do not query this attention (meta's hard routing elsewhere) but whose keys later
    tokens will read."""
    if "state" not in cache:
        start_linear_state(phi_k, v, cache)
        return
    cache["state"] = cache["state"] + phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = cache["normaliser"] + phi_k.sum(dim=2)


def linear_attention_step(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, cache: dict, eps: float,
) -> Tensor:
    """Causal linear attention of t new tokens given the running state in `cache` (S = Σ φ(k) vᵀ
    [B, G, d, e] and z = Σ φ(k) [B, G, d] over earlier tokens), which it then advances:

        out_i = φ(q_i)·(S + Σ_{j<=i new} φ(k_j) v_jᵀ) / (φ(q_i)·(z + Σ_{j<=i new} φ(k_j)) + eps).

    phi_q [B, H, t, d]; phi_k [B, G, t, d] and v [B, G, t, e] with G dividing H (grouped-query
    attention: query head h reads state h // (H / G), shared by its group without a copy).
    """
    batch, heads, length, dim = phi_q.shape
    kv_heads = phi_k.shape[1]
    state = cache.get("state", phi_q.new_zeros(batch, kv_heads, dim, v.shape[-1]))
    normaliser = cache.get("normaliser", phi_q.new_zeros(batch, kv_heads, dim))
    # Queries as [B, G, g, t, d]; each group's K/V and state broadcast over its g query heads.
    grouped_q = phi_q.reshape(batch, kv_heads, heads // kv_heads, length, dim)
    scores = (grouped_q @ phi_k[:, :, None].transpose(-1, -2)).tril()  # [B, G, g, t, t]: new tokens
    numerator = grouped_q @ state[:, :, None] + scores @ v[:, :, None]
    denominator = ((grouped_q * normaliser[:, :, None, None]).sum(-1, keepdim=True)
                   + scores.sum(-1, keepdim=True))
    cache["state"] = state + phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = normaliser + phi_k.sum(dim=2)
    return (numerator / (denominator + eps)).reshape(batch, heads, length, v.shape[-1])
