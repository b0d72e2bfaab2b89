"""The `topk` layer's routing loss: distillation of the main attention into the router, on sampled
query rows, sparse (over each row's routed set R_i) or dense (over every eligible key).

Axes: B batch, H attention heads, G key/value heads, R routing heads (1 shared, G one per K/V
group, or H), T queries, n sampled rows, S keys, K slots, d head dim, r routing dim.

The objective is DeepSeek's sparse attention indexer's (DSA): KL(p_i || softmax(s_i/τ)), p_i the
main attention's distribution q_i·k_j/√d (detached; averaged over the query heads one routing head
serves: all of them when shared, a K/V group's when routed per group), s_i the router's scores. Two supports:
- sparse (the default): j in R_i, the keys the router selected. p_i is then the attention the
  layer actually computed, renormalised over R_i.
- dense (DSA's warm-up): j over every eligible key (j <= i when causal, real keys under a mask),
  so the router learns the whole attention distribution before its selection is trusted.

Rows. The KL is averaged over `rows` sampled query positions (drawn uniformly without replacement
per training call, `sample_rows`), not over all T: the loss is an unbiased estimate of the all-row
mean — at T=512-1024 the all-row loss was ~65 % of a topk layer's training step.

The sparse support's scores. With n sampled rows the n x S score products are small (n = 64 rows of
S = 4096 keys is 256k numbers a head), and two dense matrix products followed by a `gather` of the
K selected columns cost less than gathering K key rows per query (`gathered_dot`: an index_select
forward, an index_add_ backward, ~2 GFLOP/s on a CPU): at T = 1024 (B = 8, K = 64, compare --long's
model) the gathers were ~10 % of topk's training step. So the sparse loss reads its scores from the
dense row products while a row block holds at most `DENSE_ROW_SCORES` scores per head, and gathers
per slot beyond (every row of a long sequence): O(n·S·(r + d)) products or O(n·K·(r + d)) gathers;
`flops` counts the work executed. `routing_loss_reference` is the specification: dense [T, S]
scores, the support as a mask, every row, then the sampled rows' mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.grouped_heads import group_queries, repeat_kv, spread_heads, ungroup_queries
from routeformer.ops.topk import gathered_dot, slot_membership

# Most scores per (batch, head) for which the sparse loss computes its rows' dense products and
# gathers the selected columns instead of gathering keys per slot (see the module docstring): 2^20
# numbers (4 MiB in fp32) a head covers 64 sampled rows up to S = 16384 keys.
DENSE_ROW_SCORES = 1 << 20


def selected_scores(a: Tensor, b: Tensor, index: Tensor) -> tuple[Tensor, int]:
    """(a_t · b_index[t, slot] [..., n, K], the multiply-adds executed): from the dense [n, S]
    products and a gather while n·S <= DENSE_ROW_SCORES, else per-slot gathers (`gathered_dot`).
    a [B, H, n, r], b [B, H, S, r], index [B, H, n, K] (H may be expanded)."""
    count, num_keys = a.shape[2], b.shape[2]
    if count * num_keys <= DENSE_ROW_SCORES:
        dense = a @ b.transpose(-1, -2)
        return dense.gather(-1, index.expand(*dense.shape[:-1], index.shape[-1])), dense.numel() * a.shape[-1]
    return gathered_dot(a, b, index), index.numel() * a.shape[-1]


def sample_rows(length: int, count: int | None, device: torch.device) -> Tensor | None:
    """`count` distinct query rows drawn uniformly (sorted), from the global RNG; None (every row)
    when `count` is None or covers the sequence."""
    if count is None or count >= length:
        return None
    return torch.randperm(length, device=device)[:count].sort().values


def eligible_keys(rows: Tensor, num_keys: int, causal: bool, mask: Tensor | None) -> Tensor:
    """Bool [B or 1, 1, n, S]: the keys query row `rows[i]` may read."""
    keys = torch.arange(num_keys, device=rows.device)
    allowed = torch.ones(1, 1, rows.numel(), num_keys, dtype=torch.bool, device=rows.device)
    if causal:
        allowed = allowed & (keys[None, :] <= rows[:, None])
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    return allowed


def _log_softmax_over(logits: Tensor, support: Tensor) -> Tensor:
    """log_softmax of `logits` over the True entries of `support`; 0 elsewhere and on rows with an
    empty support (never NaN)."""
    has_any = support.any(dim=-1, keepdim=True)
    safe = torch.where(support & has_any, logits, torch.full_like(logits, float("-inf")))
    safe = torch.where(has_any, safe, torch.zeros_like(logits))
    return torch.where(support, safe.log_softmax(dim=-1), torch.zeros_like(logits))


def _kl_and_entropy(
    target: Tensor, router_log_probs: Tensor, support: Tensor, row_weight: Tensor,
    distill_weight: float, entropy_weight: float,
) -> Tensor:
    """distill_weight · mean_rows KL(target || router) − entropy_weight · mean_rows H(router)."""
    denominator = row_weight.sum().clamp_min(1)
    loss = router_log_probs.new_zeros(())
    if distill_weight:
        kl = (target * (torch.log(target.clamp_min(1e-30)) - router_log_probs)).masked_fill(~support, 0.0)
        loss = loss + distill_weight * (kl.sum(-1) * row_weight).sum() / denominator
    if entropy_weight:
        entropy = -(router_log_probs.exp() * router_log_probs).masked_fill(~support, 0.0).sum(-1)
        loss = loss - entropy_weight * (entropy * row_weight).sum() / denominator
    return loss


def _head_target(logits: Tensor, support: Tensor, routing_heads: int) -> Tensor:
    """The main attention's distribution over the support, detached; averaged over the query heads
    a routing head serves (all of them when routing_heads = 1, a K/V group's when one routing head
    serves each group)."""
    target = _log_softmax_over(logits, support).exp().masked_fill(~support, 0.0)
    if routing_heads < target.shape[1]:
        target = target.unflatten(1, (routing_heads, -1)).mean(dim=2)
    return target


def routing_loss(
    q: Tensor, k: Tensor, route_q: Tensor, route_k: Tensor, index: Tensor, valid: Tensor,
    mask: Tensor | None, *, causal: bool, rows: Tensor | None, dense: bool, temperature: float,
    distill_weight: float, entropy_weight: float,
) -> tuple[Tensor, int]:
    """(loss, FLOPs executed): the distillation (and entropy) terms on the sampled `rows` (None:
    every row). q [B, H, T, d], k [B, G, S, d] (G dividing H: query head h reads K/V head
    h // (H / G), without a copy); route_q, route_k [B, R, T|S, r] and index, valid [B, R, T, K] with
    R = 1, G or H."""
    if rows is not None:
        q, route_q, index, valid = (t[:, :, rows] for t in (q, route_q, index, valid))
    batch, heads, count, head_dim = q.shape
    routing_heads, num_keys = route_q.shape[1], k.shape[2]
    picks = torch.arange(count, device=q.device) if rows is None else rows
    real = torch.ones(1, 1, count, dtype=torch.bool, device=q.device) if mask is None \
        else mask[:, None, picks]
    if dense:
        support = eligible_keys(picks, num_keys, causal, mask)  # [B|1, 1, n, S]
        router_logits = (route_q @ route_k.transpose(-1, -2)) / temperature
        flops = 2 * batch * routing_heads * count * num_keys * route_q.shape[-1]
    else:
        support = valid
        router_logits, products = selected_scores(route_q, route_k, index)
        router_logits = router_logits / temperature
        flops = 2 * products
    router_support = support.expand(batch, routing_heads, count, support.shape[-1])
    router_log_probs = _log_softmax_over(router_logits, router_support)
    row_weight = (router_support.any(-1) & real).float()
    target = router_log_probs.new_zeros(())
    if distill_weight:
        with torch.no_grad():
            kv_heads = k.shape[1]
            grouped_q = group_queries(q, kv_heads)  # [B, G, g·n, d]: each group reads its K/V head
            if dense:
                logits = ungroup_queries(grouped_q @ k.transpose(-1, -2), heads) * head_dim ** -0.5
                flops += 2 * batch * heads * count * num_keys * head_dim
            else:
                head_index = group_queries(spread_heads(index, heads), kv_heads)
                logits, products = selected_scores(grouped_q, k, head_index)
                logits = ungroup_queries(logits, heads) * head_dim ** -0.5
                flops += 2 * products
            head_support = spread_heads(support.expand(batch, -1, count, support.shape[-1]), heads)
            target = _head_target(logits.to(torch.promote_types(logits.dtype, torch.float32)), head_support,
                                  routing_heads)
    loss = _kl_and_entropy(target, router_log_probs, router_support, row_weight, distill_weight,
                           entropy_weight)
    return loss, flops


def routing_loss_reference(
    q: Tensor, k: Tensor, route_q: Tensor, route_k: Tensor, index: Tensor, valid: Tensor,
    mask: Tensor | None, *, causal: bool, rows: Tensor | None, dense: bool, temperature: float,
    distill_weight: float, entropy_weight: float,
) -> Tensor:
    """The specification of `routing_loss`: dense [T, S] scores for every row, the support as a
    mask (R_i's membership, or the eligible keys), per-row KL and entropy, then the mean over the
    sampled real rows."""
    length, num_keys = q.shape[2], k.shape[2]
    every = torch.arange(length, device=q.device)
    support = eligible_keys(every, num_keys, causal, mask) if dense \
        else slot_membership(index, valid, num_keys)
    router_scores = (route_q.double() @ route_k.double().transpose(-1, -2)) / temperature
    router_support = support.expand(*router_scores.shape)
    router_log = torch.where(router_support, router_scores, torch.tensor(float("-inf"), dtype=torch.float64))
    router_log = router_log.log_softmax(-1)
    attention = (q.double() @ repeat_kv(k, q.shape[1]).double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    head_support = spread_heads(support, q.shape[1]).expand(*attention.shape)
    target = torch.where(head_support, attention, torch.tensor(float("-inf"), dtype=torch.float64))
    target = target.softmax(-1).nan_to_num(0.0)
    if route_q.shape[1] < q.shape[1]:
        target = target.unflatten(1, (route_q.shape[1], -1)).mean(2)
    safe_log = torch.where(router_support, router_log, torch.zeros_like(router_log))
    kl = torch.where(target > 0, target * (target.clamp_min(1e-300).log() - safe_log),
                     torch.zeros_like(target))
    entropy = -torch.where(router_support, safe_log.exp() * safe_log, torch.zeros_like(safe_log))
    per_row = distill_weight * kl.sum(-1) - entropy_weight * entropy.sum(-1)  # [B, R, T]
    weight = router_support.any(-1).double()
    if mask is not None:
        weight = weight * mask[:, None, :].double()
    if rows is not None:
        per_row, weight = per_row[:, :, rows], weight[:, :, rows]
    return ((per_row * weight).sum() / weight.sum().clamp_min(1)).to(q.dtype)
