"""`topk`: Attention as Dynamic Sparse Routing (ADSR) — route in a cheap space, attend exactly.

Per head, routing projections W_r^q, W_r^k map x to r-dim vectors (r = `routing_dim` << d; §4.1
projects q and k, here they read x, which q and k are linear in); the score s_ij = r_q(i)·r_k(j)
(§4.2, no softmax) picks R_i = TopK_j(s_ij) (§4.3) among eligible keys (j <= i when causal); the
output is exact softmax attention of q_i over k_j, v_j, j in R_i (§5). Selection is blockwise with
a running top-K (`ops.topk.routing`), attention gathers keys per block of queries
(`ops.topk.gathered`): memory O(T·K + block·S·r/d), never T x T. Ties select the lower key index.
Keys read per query: K routed + `local_window` + `global_tokens` forced ones (§9.2), at most the
eligible keys; K + w + g ≥ T makes the layer full attention, with a `UserWarning` once per layer.

Options (defaults in brackets; the measurements behind them: docs/results/topk.md):
- `routing_positions` ["recency"]: how position enters s_ij. "recency": − β·(i − j), one learned
  slope β = softplus(a) > 0 per routing head (starts at `recency_init` [None: softplus(-3) ≈ 0.05],
  one extra routing dim); "rotary":
  RoPE in the routing space (base `rotary_base`; needs an even `routing_dim`); "rotary+recency";
  "none": a position-blind router (the recall recipe at T = 4096, docs/results/claims.md).
- `routing_learning` ["distill"]: the signal a hard top-k needs. "distill": aux loss
  `distill_weight`·KL(p || softmax(s/τ)) over R_i, p the detached attention distribution; the
  router reads x detached (`detach_router_input` [True]), the KL averages over `distill_queries`
  [64; None = every row] sampled rows, after `distill_dense_steps` [0] dense warm-up calls.
  "score_bias": logits q·k/√d + λ·s_ij/τ (λ = `score_bias_scale`), straight-through.
  "none": fixed random projections (an LSH-style baseline).
- `temperature` τ: divides s where it enters a softmax or a logit; never changes the selection.
- `entropy_weight` (aux −w·H(softmax(s/τ)) over R_i), `exploration` (round(exploration·K) of the
  K slots random in training, at most K − 1; §9.1), `global_tokens`, `local_window`,
  `shared_routing` (one routing space for all heads), `router_hidden` (a GELU MLP router).
- `dense_below` [None = `ops.backends.TOPK_DENSE_BELOW`, the measured crossover printed by
  `routeformer doctor`]: with at most this many keys the routed set masks one SDPA call (same
  function; `flops` counts the T x S work done); 0 always gathers.

Grouped-query attention (`kv_heads` < heads): parameters and decode cache hold kv_heads K/V heads
and the routed op reads a group's K/V head for all its query heads (no copy). `route_per` ["head"]:
"head" routes per query head; "group" routes once per K/V group (one key set for the group's query
heads, scores summed over them, as NSA; the distillation target is the group's mean attention).
`shared_routing` overrides both; "score_bias" with kv_heads < heads needs "group" or shared_routing.

"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.attention.base import AttentionLayer, AttentionOutput, live_bytes
from routeformer.attention.registry import register_attention
from routeformer.attention.topk_distill import routing_loss, sample_rows
from routeformer.attention.topk_router import Router
from routeformer.ops._checks import check_positive
from routeformer.ops.backends import NATIVE, TOPK_DENSE_BELOW, TORCH, chosen, topk_dense_below
from routeformer.ops.decode import append_keys_values
from routeformer.ops.grouped_heads import group_queries, spread_heads, ungroup_queries
from routeformer.ops.topk import (
    DEFAULT_ROUTING_BLOCK,
    add_random_slots,
    append_routing_keys,
    route_cached,
    route_topk,
    routed_attention,
    slot_membership,
)

ROUTING_LEARNING = ("score_bias", "distill", "none")
ROUTING_POSITIONS = ("rotary", "recency", "rotary+recency", "none")
ROUTE_PER = ("head", "group")
# Longest key count for which the dense masked path beats gathering (layer fwd+bwd, B=4, D=128,
# 2 cores): the native kernels gather faster from 512 keys (420 vs 490 ms), the PyTorch ops from
# ~1024. The values live with the dispatch (ops/backends.py: TOPK_DENSE_BELOW, which
# `routeformer doctor` prints); named here too for the layer's readers.
DENSE_BELOW_NATIVE, DENSE_BELOW_TORCH = TOPK_DENSE_BELOW[NATIVE], TOPK_DENSE_BELOW[TORCH]


@register_attention("topk")
class TopKAttention(AttentionLayer):
    """Top-k routed attention (ADSR); see the module docstring for every option.

    Args (beyond dim, heads, causal): the options of the module docstring (topk, routing_dim,
    routing_learning, ..., route_per = "head" | "group", default "head") and the common options of
    `AttentionLayer` (head_dim, bias, rotary, rotary_base, kv_heads).

    Cached decoding (`decode`, `CausalLM.generate`): routing keys are cached beside K and V; a new token
    routes over them with the parallel pass's kernel and tie rule (`ops.topk.decode.route_cached`) and
    reads O(L·r) routing numbers plus O((K + w + g)·d) keys/values per head. Exploration has no cached
    form (refused in training mode). Invalid options raise ValueError naming the option.

    stats: `selected_keys`, `routing_flops`, `flops` (routing + attention + routing loss, executed);
    at evaluation only, `routing_recall` (dense attention mass inside R_i on `recall_queries` queries)
    and `head_overlap` (mean Jaccard overlap of R_i between heads); the probe is not in `flops`.
    """

    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, topk: int = 64, routing_dim: int = 16,
        routing_learning: str = "distill", score_bias_scale: float = 1.0, distill_weight: float = 1.0,
        temperature: float = 1.0, entropy_weight: float = 0.0, exploration: float = 0.0,
        global_tokens: int = 0, local_window: int = 0, shared_routing: bool = False,
        router_hidden: int = 0, recall_queries: int = 16, block: int = DEFAULT_ROUTING_BLOCK,
        dense_below: int | None = None, routing_positions: str = "recency",
        detach_router_input: bool = True, distill_queries: int | None = 64, distill_dense_steps: int = 0,
        route_per: str = "head", recency_init: float | None = None, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        if route_per not in ROUTE_PER:
            raise ValueError(f"route_per must be one of {ROUTE_PER}; got {route_per!r}")
        check_positive("topk", topk)
        check_positive("routing_dim", routing_dim)
        check_positive("block", block)
        if routing_learning not in ROUTING_LEARNING:
            raise ValueError(f"routing_learning must be one of {ROUTING_LEARNING}; got {routing_learning!r}")
        if routing_positions not in ROUTING_POSITIONS:
            raise ValueError(f"routing_positions must be one of {ROUTING_POSITIONS}; "
                             f"got {routing_positions!r}")
        if "rotary" in routing_positions and routing_dim % 2:
            raise ValueError(f"routing_positions='rotary' needs an even routing_dim; got {routing_dim}")
        numeric = isinstance(recency_init, (int, float)) and not isinstance(recency_init, bool)
        if recency_init is not None and not (numeric and 0 < recency_init < 50):
            raise ValueError(f"recency_init must be a slope in (0, 50) or None (softplus(-3) ≈ 0.05); "
                             f"got {recency_init!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0; got {temperature}")
        if not 0.0 <= exploration < 1.0:
            raise ValueError(f"exploration must be a fraction in [0, 1); got {exploration}")
        for name, value in (("global_tokens", global_tokens), ("local_window", local_window),
                            ("router_hidden", router_hidden), ("recall_queries", recall_queries),
                            ("dense_below", 0 if dense_below is None else dense_below)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        if distill_weight < 0:
            raise ValueError(f"distill_weight must be >= 0; got {distill_weight}")
        if distill_queries is not None and (not isinstance(distill_queries, int) or distill_queries < 1):
            raise ValueError("distill_queries must be an integer >= 1 or None (every query); "
                             f"got {distill_queries!r}")
        if not isinstance(distill_dense_steps, int) or distill_dense_steps < 0:
            raise ValueError(f"distill_dense_steps must be an integer >= 0; got {distill_dense_steps!r}")
        if distill_dense_steps and routing_learning != "distill":
            raise ValueError("distill_dense_steps needs routing_learning='distill'; "
                             f"got routing_learning={routing_learning!r}")
        if entropy_weight and routing_learning == "none":
            raise ValueError("entropy_weight needs a learnable router; routing_learning='none' is frozen")
        self.topk, self.routing_dim, self.routing_learning = topk, routing_dim, routing_learning
        self.score_bias_scale, self.distill_weight = float(score_bias_scale), float(distill_weight)
        self.temperature, self.entropy_weight = float(temperature), float(entropy_weight)
        self.exploration, self.global_tokens, self.local_window = exploration, global_tokens, local_window
        self.shared_routing, self.recall_queries, self.block = shared_routing, recall_queries, block
        self.dense_below = dense_below
        self.detach_router_input, self.distill_queries = bool(detach_router_input), distill_queries
        self.distill_dense_steps = distill_dense_steps
        if distill_dense_steps:
            # training calls so far (checkpointed): the dense warm-up covers the first ones
            self.register_buffer("distill_step", torch.zeros((), dtype=torch.long))
        self._warned_capped = False
        self.route_per = route_per
        routing_heads = self.router_heads()
        if routing_learning == "score_bias" and routing_heads not in (1, self.kv_heads):
            raise ValueError("routing_learning='score_bias' appends each routing head's key vector to its "
                             f"keys, so with kv_heads ({self.kv_heads}) < heads ({heads}) it needs "
                             "route_per='group' or shared_routing=True; got route_per='head'")
        self.routing_positions = routing_positions
        self.router = Router(dim, routing_heads, routing_dim, router_hidden,
                             frozen=routing_learning == "none", positions=routing_positions,
                             rotary_base=self.rotary_base, recency_init=recency_init)

    def dense_limit(self, q: Tensor, k: Tensor, v: Tensor) -> int:
        """`dense_below`, or when it is None the measured crossover for these tensors: 256 keys
        when the native kernels serve them, 1024 for the PyTorch ops (docs/results/topk.md)."""
        if self.dense_below is not None:
            return self.dense_below
        return topk_dense_below(q, k, v)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        return self._routed_forward(x, mask, positions)[0]

    def _routed_forward(
        self, x: Tensor, mask: Tensor | None, positions: Tensor
    ) -> tuple[AttentionOutput, Tensor, Tensor, Tensor]:
        """The parallel pass: (output, the keys attention scored k_att [B, H, T, d(+r)], v, route_k)."""
        q, k, v = self.project_qkv(x, positions)
        batch, heads, length, head_dim = q.shape
        route_q, route_k = self.router(self.router_input(x), positions)
        # Exploration replaces routed slots by random ones (§9.1), but never all of them: with
        # K = 1 and exploration 0.6 the one slot stays routed (round() alone would leave none).
        explore = min(round(self.exploration * self.topk), self.topk - 1) if self.training else 0
        self.warn_if_capped(k.shape[2])
        index, valid, scored = route_topk(
            route_q.detach(), route_k.detach(), self.topk - explore, causal=self.causal, key_mask=mask,
            local_window=self.local_window, global_tokens=self.global_tokens, block=self.block,
            position_dim="recency" in self.router.positions,
        )
        index, valid = add_random_slots(index, valid, explore, causal=self.causal, key_mask=mask)
        # Routing heads R are 1 (shared), G (per K/V group) or H; attention needs one index per head.
        head_index, head_valid = spread_heads(index, heads), spread_heads(valid, heads)
        slots = index.shape[-1]
        q_att, k_att, scale = self._attention_inputs(q, k, route_q, route_k)
        num_keys = k.shape[2]
        if num_keys <= self.dense_limit(q_att, k_att, v):
            # Short sequences: one masked SDPA over the routed-set mask beats per-query gathers
            # (gathers run at ~1-2 GFLOP/s on CPU). Same function, executed cost T x S.
            allowed = slot_membership(head_index, head_valid, num_keys)
            chosen("routed_attention", TORCH, "dense masked SDPA below dense_below keys")
            heads_out = F.scaled_dot_product_attention(q_att, k_att, v, attn_mask=allowed, scale=scale,
                                                       enable_gqa=heads != k_att.shape[1])
            heads_out = heads_out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
            attention_flops = 2 * batch * heads * length * num_keys * (q_att.shape[-1] + head_dim)
        else:
            heads_out, _ = routed_attention(q_att, k_att, v, head_index, head_valid, scale=scale)
            attention_flops = 2 * batch * heads * length * slots * (q_att.shape[-1] + head_dim)
        routing_flops = 2 * scored * route_q.shape[-1]
        aux_loss, aux_flops = self.routing_aux_loss(q, k, route_q, route_k, index, valid, mask)
        out = self.out_proj(self.merge_heads(heads_out, x))
        stats = {
            "flops": torch.tensor(float(routing_flops + attention_flops + aux_flops)),
            "routing_flops": torch.tensor(float(routing_flops)),
            # valid slots per row: a count, not a float copy of valid (2 ms a layer at T=4096)
            "selected_keys": torch.count_nonzero(valid).float() / max(1, valid[..., 0].numel()),
        }
        if not self.training:  # a diagnostic: the probe costs O(n·T·d) a call, so evaluation only
            stats.update(self.routing_diagnostics(q, k, index, valid, mask))
        return AttentionOutput(out=out, aux_loss=aux_loss, stats=stats), k_att, v, route_k

    # -- cached decoding -------------------------------------------------------------------
    supports_cache = True

    def decode(self, x: Tensor, *, positions: Tensor, cache: dict, meta_mask: Tensor | None = None) -> Tensor:
        """Cached decoding (see AttentionLayer.decode): the rows of the parallel pass, as at
        evaluation. The cache holds the keys attention scores (with `score_bias`, k with the routing
        keys appended, as the parallel pass builds them), the values, and the routing keys
        (ops/topk_decode: the routing kernel's own tiled layout on CPU). A prefill (empty cache) is
        the parallel pass; each later token routes over the cached routing keys with the same
        kernel and tie rule (`route_cached`: the forced window and global keys plus the K best
        others among keys <= its index) and attends exactly to those slots, reading O(L·r) routing
        numbers and O((K + w + g)·d) keys and values per head, not the O(L·d) of full attention.
        Exploration (random slots in training) has no cached form: refused in training mode."""
        self.check_decode(x, positions)
        if self.training and self.exploration:
            raise ValueError("topk: cached decoding draws no exploration slots; call model.eval() "
                             f"(exploration={self.exploration} applies in training mode only)")
        start = cache.get("length", 0)
        if start == 0:
            result, k_att, v, route_k = self._routed_forward(x, None, positions)
        else:
            q, k, v = self.project_qkv(x, positions)
            route_q, route_k = self.router(self.router_input(x), positions)
            q_att, k_att, scale = self._attention_inputs(q, k, route_q, route_k)
        append_keys_values(cache, k_att, v)
        append_routing_keys(cache, route_k.detach())
        cache["length"] = start + x.shape[1]
        if start == 0:
            return result.out
        index, valid = route_cached(route_q.detach(), cache, start, self.topk, local_window=self.local_window,
                                    global_tokens=self.global_tokens,
                                    position_dim="recency" in self.router.positions)
        heads = q.shape[1]
        head_index, head_valid = spread_heads(index, heads), spread_heads(valid, heads)
        # The whole buffers (topk never trims: row j is key j); the slots only point at filled rows.
        heads_out, _ = routed_attention(q_att, cache["k_buffer"], cache["v_buffer"], head_index, head_valid,
                                        scale=scale)
        return self.out_proj(self.merge_heads(heads_out, x))

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        """The routing keys a step scans (the filled tiles of the tiled layout) and the keys and
        values of its K + local_window + global_tokens slots."""
        length = cache["length"]
        if cache["routing_tiled"]:
            tiles = cache["routing_tiles"]
            tile = tiles.shape[-1]
            routing = tiles[:, :, :-(-length // tile)].numel() * tiles.element_size()
        else:
            routing = live_bytes(cache["routing_keys"])
        slots = min(length, self.topk + self.local_window + self.global_tokens)
        k, v = cache["k"], cache["v"]
        per_key = (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size())
        # Routed per query head, each query head reads its own slots of its K/V head; routed per
        # group (or shared), a K/V head's slots are the same for every query head that reads it.
        readers = self.heads if self.router_heads() == self.heads else k.shape[1]
        return routing + k.shape[0] * readers * slots * per_key, True

    def router_heads(self) -> int:
        """Routing heads R: 1 (shared_routing), kv_heads (route_per='group') or heads."""
        return 1 if self.shared_routing else (self.kv_heads if self.route_per == "group" else self.heads)

    @classmethod
    def budget_options(cls, seq_len: int, keys: int) -> dict[str, int]:
        """A budget in keys: T/8, up to `keys` (fixed from T = 8·keys on)."""
        return {"topk": max(1, min(keys, seq_len // 8))}

    def _attention_inputs(self, q: Tensor, k: Tensor, route_q: Tensor, route_k: Tensor
                          ) -> tuple[Tensor, Tensor, float]:
        """(q_att, k_att, scale): with `score_bias` the routing vectors appended to q (times λ/τ,
        q pre-scaled) and k, else q, k and 1/√d."""
        scale = q.shape[-1] ** -0.5
        if self.routing_learning != "score_bias":
            return q, k, scale
        bias = self.score_bias_scale / self.temperature
        batch, heads, length = q.shape[:3]
        routing = route_q.shape[-1]
        q_att = torch.cat([q * scale, spread_heads((bias * route_q).to(q.dtype), heads)], dim=-1)
        # R = 1 or G here (the constructor refuses per-head routing keys over fewer K/V heads).
        key_routing = route_k.to(k.dtype).expand(batch, k.shape[1], k.shape[2], routing)
        k_att = torch.cat([k, key_routing], dim=-1)
        return q_att, k_att, 1.0

    def warn_if_capped(self, num_keys: int) -> None:
        """Warn once per layer when K + local_window + global_tokens exceeds the keys of an input:
        each query then reads all its eligible keys (see the module docstring)."""
        wanted = self.topk + self.local_window + self.global_tokens
        if wanted > num_keys and not self._warned_capped:
            self._warned_capped = True
            warnings.warn(
                f"topk attention: topk + local_window + global_tokens = {wanted} exceeds the {num_keys} "
                "keys of this input; every query reads all its eligible keys (full attention). "
                "Warned once per layer.", UserWarning, stacklevel=2)

    def router_input(self, x: Tensor) -> Tensor:
        """What the router reads: x detached by default (`detach_router_input`), so the routing
        loss trains the router alone and the backbone learns only from the task loss (DSA's rule);
        x itself (the coupled ablation) lets the routing loss move the residual stream too."""
        return x.detach() if self.detach_router_input else x

    def distilling_densely(self) -> bool:
        """True during the dense warm-up: the first `distill_dense_steps` training calls."""
        return bool(self.distill_dense_steps) and int(self.distill_step) < self.distill_dense_steps

    def routing_aux_loss(
        self, q: Tensor, k: Tensor, route_q: Tensor, route_k: Tensor, index: Tensor, valid: Tensor,
        mask: Tensor | None,
    ) -> tuple[Tensor, int]:
        """Distillation and entropy terms (attention/topk_distill.py), in training only, on
        `distill_queries` sampled query rows; over every eligible key during the dense warm-up,
        else over each row's routed set R_i."""
        distill = self.routing_learning == "distill" and self.distill_weight > 0 and self.training
        entropy = self.entropy_weight != 0 and self.training
        if not (distill or entropy):
            return q.new_zeros(()), 0
        dense = self.distilling_densely()
        if self.distill_dense_steps:
            self.distill_step += 1
        rows = sample_rows(q.shape[2], self.distill_queries, q.device)
        return routing_loss(
            q, k, route_q, route_k, index, valid, mask, causal=self.causal, rows=rows, dense=dense,
            temperature=self.temperature, distill_weight=self.distill_weight if distill else 0.0,
            entropy_weight=self.entropy_weight)

    @torch.no_grad()
    def routing_diagnostics(
        self, q: Tensor, k: Tensor, index: Tensor, valid: Tensor, mask: Tensor | None
    ) -> dict[str, Tensor]:
        """Routing recall and head overlap on `recall_queries` evenly spaced queries."""
        batch, heads, length, head_dim = q.shape
        if self.recall_queries == 0:
            return {}
        count = min(self.recall_queries, length)
        picks = torch.linspace(0, length - 1, count, device=q.device).round().long()
        grouped = group_queries(q[:, :, picks], k.shape[1])  # each K/V head's query heads' rows
        scores = ungroup_queries(grouped @ k.transpose(-1, -2), heads) * head_dim ** -0.5  # [B, H, n, S]
        keys = torch.arange(k.shape[2], device=q.device)
        eligible = torch.ones_like(scores, dtype=torch.bool)
        if self.causal:
            eligible = eligible & (keys[None, :] <= picks[:, None])
        if mask is not None:
            eligible = eligible & mask[:, None, None, :]
        probs = scores.masked_fill(~eligible, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        member = slot_membership(index[:, :, picks], valid[:, :, picks], k.shape[2])
        recall = (probs * spread_heads(member, heads)).sum(-1)  # [B, H, n]
        real = torch.ones(batch, count, dtype=torch.bool, device=q.device) if mask is None else mask[:, picks]
        weight = real[:, None, :].expand_as(recall).float()
        stats = {"routing_recall": (recall * weight).sum() / weight.sum().clamp_min(1)}
        if member.shape[1] > 1:
            member = member.float()
            inter = torch.einsum("bhns,bgns->bnhg", member, member)
            sizes = member.sum(-1).transpose(1, 2)  # [B, n, H]
            union = sizes[..., :, None] + sizes[..., None, :] - inter
            jaccard = inter / union.clamp_min(1)  # [B, n, H, H]
            # the off-diagonal pairs: all minus the diagonal (a boolean index would be a nonzero,
            # a data-dependent shape that breaks torch.compile's graph)
            pairs = member.shape[1] * (member.shape[1] - 1)
            off_diagonal = jaccard.sum((-2, -1)) - jaccard.diagonal(dim1=-2, dim2=-1).sum(-1)  # [B, n]
            real_rows = real.float()
            stats["head_overlap"] = (off_diagonal * real_rows).sum() / (real_rows.sum() * pairs).clamp_min(1)
        else:
            stats["head_overlap"] = torch.tensor(1.0)
        return stats

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", topk={self.topk}, routing_dim={self.routing_dim}, "
                f"routing_learning={self.routing_learning!r}, routing_positions={self.routing_positions!r}")

