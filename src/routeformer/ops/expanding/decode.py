"""Cached decoding of causal expanding attention: the new queries' inference over the cached keys.

Axes: B batch, H heads, t new queries (stream indices start ..), L cached keys (0 .. L-1, the new
tokens' included), W keys scored so far (the most recent ones), d head dim.

In the causal, unpadded case a query's computation reads only its own q and the keys j <= i within
its horizon (at most its context i + 1, which a new token's index fixes): nothing a later token
changes. So a step is the same per-query recurrence as the parallel op (ops/expanding/op.py, written
as `expanding_attention_reference` writes it: the paper's update or the mean-field one, the same
stopping rule and horizons), run for the new queries only. Keys are scored lazily: only the most
recent ones a horizon has reached (the scored width at least doubles when a horizon outgrows it),
so a step reads O(horizon·d) keys and values, not the whole cache.

It is the parallel pass's function computed in another order (fp32 arithmetic on the same inputs);
a horizon is an integer ceil(log(tol) / log(1 - q_t)), so a q_t within rounding of a boundary could
put one key in or out where the C kernels decided otherwise. Tests compare the rows with the
parallel layer (tests/models/test_cache.py, tests/models/test_generate_cache.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.expanding.prior import check_expanding_options, masked_logits, softmax_rows
from routeformer.ops.expanding.reference import WindowInference


@torch.no_grad()
def expanding_decode(
    q: Tensor, k: Tensor, v: Tensor, start: int, alpha: Tensor, beta: Tensor, *, tol: float = 0.01,
    max_iters: int = 8, update: str = "paper", scale: float | None = None, stats: dict | None = None,
) -> Tensor:
    """Outputs [B, H, t, e] of the queries q [B, H, t, d] of stream indices start .. start + t - 1,
    over every key and value of the stream so far, k [B, H, L, d], v [B, H, L, e] (L = start + t),
    under the Beta(α, β) [H] prior: the rows of `expanding_attention(causal=True)` for them.
    `stats`, when given, receives "scored_keys": how many of the most recent keys were read."""
    check_expanding_options(tol, max_iters, update)
    batch, heads, length, dim = q.shape
    num_keys = k.shape[2]
    if num_keys != start + length:
        raise ValueError(f"expanding_decode: k must hold the {start + length} keys 0 .. "
                         f"{start + length - 1}; got {num_keys}")
    scale = dim ** -0.5 if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    queries = q.to(work)
    query_index = torch.arange(start, start + length, device=q.device)
    context = (query_index + 1).expand(batch, heads, length)
    scored_from = num_keys  # keys scored_from .. L - 1 are scored
    scores = queries.new_empty(batch, heads, length, 0)
    distance = query_index.new_empty(length, 0)

    def cover(first: int) -> None:
        nonlocal scored_from, scores, distance
        if first >= scored_from:
            return
        first = max(0, min(first, num_keys - 2 * (num_keys - scored_from)))  # at least double
        more = queries @ k[:, :, first:scored_from].to(work).transpose(-1, -2)
        scores = torch.cat([more, scores], dim=-1)
        scored_from = first
        distance = query_index[:, None] - torch.arange(first, num_keys, device=q.device)[None, :]

    key_valid = torch.ones((), dtype=torch.bool, device=q.device)
    alpha_start = alpha.detach().to(work).view(1, heads, 1).expand(batch, heads, length)
    beta_start = beta.detach().to(work).view(1, heads, 1).expand(batch, heads, length)
    inference = WindowInference(alpha_start, beta_start, work, mean_field=update == "mean_field", tol=tol,
                                context=context, max_iters=max_iters)
    horizon = torch.ones_like(inference.steps)
    active = torch.ones_like(inference.converged)
    for step in range(max_iters):
        new_horizon, stop, step_decay = inference.propose(step)
        horizon = torch.where(active | (step == 0), new_horizon, horizon)
        cover(int((query_index - horizon + 1).min()))
        probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, step_decay, scale, True))
        going_on = active & ~stop
        inference.advance(new_horizon, going_on, (probs * distance.to(probs.dtype)).sum(-1))
        active = going_on
        if not bool(active.any()):  # nothing changes in the remaining steps
            break
    log_decay = inference.final_log_decay(alpha_start, beta_start)
    probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, log_decay, scale, True))
    if stats is not None:
        stats["scored_keys"] = num_keys - scored_from
    return (probs @ v[:, :, scored_from:].to(work)).to(q.dtype)
