"""`meta`: Meta-Attention — Bayesian per-token routing among full, linear and local attention
(Ferrari, "Meta-Attention: Bayesian Per-Token Routing for Efficient Transformer Inference").

Three experts, each with its own Q/K/V and output projections (`share_qkv=True` shares Q/K/V):
E1 full softmax (cost c₁ = 1.0), E2 linear attention with elu + 1 features (c₂ = 0.15), E3 sliding
window of `window` tokens (c₃ = 0.30). A `BayesianRouter` gives each token a Dirichlet posterior
Dir(β̂_t) over the experts (see meta_router.py).

Soft routing (Eq. 7): out_t = Σ_i α_t,i E_i(x)_t, with α_t ~ Dir(β̂_t) (reparameterised,
`Dirichlet.rsample`) in training and the posterior mean ᾱ_t at evaluation. Every expert runs on
every token.

Loss: aux_loss = elbo_weight · mean_t KL[Dir(β̂_t) ‖ Dir(β)] (Eq. 9, over real tokens), added to the
task loss. The preprint's Eq. 2/8 *subtract* it; that sign rewards moving away from the prior, so
this is the ELBO penalty (+), as the ELBO itself prescribes.

The two ablations are separate switches, so each changes one thing:
- KL-free: `elbo_weight=0` — the posterior keeps the prior as its offset (β̂ = β + δ), no KL term.
- prior-free: `prior="none"` — the posterior loses the offset (β̂ = ε + δ); the KL term to the cost
  prior Dir(β) stays, weighted by `elbo_weight` (default 1).
- both (`prior="none", elbo_weight=0`): the preprint's "non-Bayesian / prior-free" model.

Hard routing (the preprint's Phase 3, made real): a token whose normalised certainty is ≥ η runs
only its argmax expert argmax_i ᾱ_t,i; the others stay soft. Each expert computes only the query
rows routed to it (ops/routed_rows.py) while reading keys/values — and, for linear attention, the
running state — from every position the causal rule allows. A hard token's weight is
1 + α_i − stop_gradient(α_i) on the selected expert (value 1, gradient into the controller).
Certainty, `gate`:
- "mean_entropy" (default): 1 − H(ᾱ_t) / ln K, the normalised entropy of the routing weights. It
  is 0 for uniform weights and 1 for a one-hot choice, and asks exactly "which expert?".
- "dirichlet_entropy": 1 − exp(U_t − U_max), U_t the Dirichlet's differential entropy (Eq. 6) and
  U_max = −ln Γ(K) its maximum (the uniform Dirichlet). U_t is unbounded below; this maps it to
  [0, 1). Concentrations below 1 lower U_t even for a uniform mean: this gate can be confident
  about *sparsity*, not about the choice.
η: `eval_eta` at evaluation; in training, linear from `train_eta_start` to `train_eta` over
`eta_anneal_steps` training calls (counted by the `routing_step` buffer, which is checkpointed).
None disables hard routing.

"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.local import LocalAttention
from routeformer.attention.meta_router import DEFAULT_POSITION_SCALE, PRIOR_KINDS, BayesianRouter
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops.decode import (
    advance_linear_state,
    append_keys_values,
    cached_softmax_attention,
    linear_attention_step,
    start_linear_state,
    trim_keys_values,
)
from routeformer.ops.dirichlet import (
    categorical_entropy,
    dirichlet_entropy,
    dirichlet_kl,
    normalised_certainty,
)
from routeformer.ops.full import full_attention, full_attention_flops
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.linear import DEFAULT_EPS, feature_map, linear_attention, linear_attention_flops
from routeformer.ops.local import local_attention, local_attention_flops
from routeformer.ops.rotary import apply_rotary, rotary_angles
from routeformer.ops.routed_rows import (
    full_attention_rows,
    linear_attention_rows,
    local_attention_rows,
    select_rows,
)

EXPERTS = ("full", "linear", "local")
GATES = ("mean_entropy", "dirichlet_entropy")


def _masked_mean(values: Tensor, real: Tensor | None) -> Tensor:
    """Mean over real tokens (`real` float [B, T], None = every token)."""
    return values.mean() if real is None else (values * real).sum() / real.sum().clamp_min(1.0)


def _at_least_fp32(t: Tensor) -> Tensor:
    """t in fp32, or kept in fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_eta(name: str, value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (a certainty threshold) or None; got {value!r}")


@register_attention("meta")
class MetaAttention(AttentionLayer):
    """Bayesian routing among full / linear / local experts; see the module docstring and below.

    Args (beyond dim, heads, causal): the options of the module docstring, and the common options
    of `AttentionLayer` (head_dim, bias, rotary, rotary_base, kv_heads). kv_heads < heads: every
    expert's (or the shared) Q/K/V projection has kv_heads K/V heads, and so do the experts'
    decode caches (the linear expert's state included). The full expert reads the K/V heads in
    place (SDPA's `enable_gqa`), as do the cached steps of all three experts; the linear and local
    experts' parallel kernels and the routed-rows kernels take one head count and get each K/V
    head repeated for its query heads at call time (a copy of K/V per query head).

    Training schedule (deviations from the paper, off by default; every counter is `routing_step`, the
    checkpointed count of training calls):
    - `warmup_steps` (default 0): for the first N training calls every token mixes the experts with
      fixed uniform weights 1/K (no Dirichlet sample, no hard routing, no KL term), so that each expert
      learns its task before the controller can starve it. `warmup_mixture` (default None = uniform)
      sets other fixed weights, one per expert (non-negative, summing to 1), e.g. (1, 0, 0).
    - `kl_anneal_steps` (default 0): after the warm-up the KL weight rises linearly from 0 to
      `elbo_weight` over M training calls (call s after warm-up uses elbo_weight · min(1, s / M)).
    - the η anneal (`eta_anneal_steps`) starts after the warm-up: training call s after warm-up uses
      train_eta_start + (train_eta − train_eta_start) · min(1, s / eta_anneal_steps).

    stats: weight_{full,linear,local} (mean ᾱ), routing_entropy_pct (mean H(ᾱ_t)/ln K, %),
    mean_weight_entropy (H of the average ᾱ, nats — the paper's Table 2 quantity), uncertainty (mean
    U_t), kl (mean KL), projected_cost (mean Σ ᾱ_i c_i), hard_fraction, rows_{expert} (share of tokens
    each expert computed), flops (attention FLOPs executed) and flops_vs_full (that over the full
    expert alone on every token), eta, kl_weight (the KL weight in force).
    """

    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, window: int = 64,
        costs: Sequence[float] = (1.0, 0.15, 0.30), beta0: float = 1.0, prior_eps: float = 0.01,
        prior: str = "dirichlet", elbo_weight: float = 1.0, controller_hidden: int = 64,
        share_qkv: bool = False, sample_routing: bool = True, gate: str = "mean_entropy",
        eval_eta: float | None = None, train_eta: float | None = None, train_eta_start: float = 1.0,
        eta_anneal_steps: int = 1000, position_scale: float | None = DEFAULT_POSITION_SCALE,
        linear_chunk: int = 64, full_chunk: int = 256, warmup_steps: int = 0,
        kl_anneal_steps: int = 0, warmup_mixture: Sequence[float] | None = None, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        costs = tuple(float(c) for c in costs)
        if len(costs) != len(EXPERTS):
            raise ValueError(f"costs needs one value per expert {EXPERTS}; got {costs}")
        if prior not in PRIOR_KINDS:
            raise ValueError(f"prior must be one of {PRIOR_KINDS}; got {prior!r}")
        if not elbo_weight >= 0:
            raise ValueError(f"elbo_weight must be >= 0; got {elbo_weight!r}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}; got {gate!r}")
        for name, value in (("eval_eta", eval_eta), ("train_eta", train_eta),
                            ("train_eta_start", train_eta_start)):
            _check_eta(name, value)
        for name, value in (("window", window), ("controller_hidden", controller_hidden),
                            ("linear_chunk", linear_chunk), ("full_chunk", full_chunk)):
            check_positive(name, value)
        for name, value in (("eta_anneal_steps", eta_anneal_steps), ("warmup_steps", warmup_steps),
                            ("kl_anneal_steps", kl_anneal_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        self.warmup_steps, self.kl_anneal_steps = warmup_steps, kl_anneal_steps
        if warmup_mixture is None:
            warmup_mixture = (1.0 / len(EXPERTS),) * len(EXPERTS)
        warmup_mixture = tuple(float(w) for w in warmup_mixture)
        if (len(warmup_mixture) != len(EXPERTS) or min(warmup_mixture) < 0
                or abs(sum(warmup_mixture) - 1.0) > 1e-6):
            raise ValueError(f"warmup_mixture needs one non-negative weight per expert {EXPERTS}, "
                             f"summing to 1; got {warmup_mixture}")
        self.warmup_mixture = warmup_mixture
        self.window, self.costs, self.elbo_weight, self.gate = window, costs, float(elbo_weight), gate
        self.sample_routing, self.share_qkv = sample_routing, share_qkv
        self.eval_eta, self.train_eta, self.train_eta_start = eval_eta, train_eta, train_eta_start
        self.eta_anneal_steps, self.linear_chunk, self.full_chunk = eta_anneal_steps, linear_chunk, full_chunk
        self.router = BayesianRouter(dim, costs, beta0=beta0, eps=prior_eps, hidden=controller_hidden,
                                     prior=prior, position_scale=position_scale)
        inner, bias = self.heads * self.head_dim, self.qkv_proj.bias is not None
        qkv_width = self.qkv_proj.out_features  # q's heads, then kv_heads for k and for v
        del self.qkv_proj, self.out_proj  # replaced by one set per expert
        self.expert_qkv = nn.ModuleList(
            nn.Linear(dim, qkv_width, bias=bias) for _ in range(1 if share_qkv else len(EXPERTS)))
        self.expert_out = nn.ModuleList(nn.Linear(inner, dim, bias=bias) for _ in EXPERTS)
        self.register_buffer("routing_step", torch.zeros((), dtype=torch.long))
        self.forced_shares: tuple[float, ...] | None = None

    @classmethod
    def budget_options(cls, seq_len: int, keys: int) -> dict[str, int]:
        """The window of the local expert, as local's: T/4 keys, up to `keys`."""
        return LocalAttention.budget_options(seq_len, keys)

    # -- routing ---------------------------------------------------------------------------
    def force_routing(self, shares: tuple[float, ...] | None) -> None:
        """Hard-route a fixed share of the tokens to each expert (full, linear, local), whatever the
        router says (it still runs, and its KL still counts): for timing the layer at the shares a
        trained router chose (`routeformer bench steps`); None gives the routing back to the router.
        Which tokens go where is a fixed low-discrepancy function of the position."""
        if shares is not None:
            shares = tuple(float(share) for share in shares)
            if len(shares) != len(EXPERTS) or min(shares) < 0 or abs(sum(shares) - 1.0) > 1e-6:
                raise ValueError(f"shares: one non-negative share per expert {EXPERTS}, summing to 1; "
                                 f"got {shares}")
        self.forced_shares = shares

    def _forced_choice(self, positions: Tensor, like: Tensor) -> Tensor:
        """Expert index per token for `force_routing`: the position's golden-ratio fraction
        against the cumulative shares."""
        fraction = torch.remainder(positions.to(torch.float64) * 0.6180339887498949, 1.0)
        edges = torch.tensor(self.forced_shares, dtype=torch.float64, device=positions.device).cumsum(0)[:-1]
        return torch.bucketize(fraction, edges, right=True).expand(like.shape)

    def in_warmup(self) -> bool:
        """True during the first `warmup_steps` training calls (uniform fixed mixture)."""
        return self.training and int(self.routing_step) < self.warmup_steps

    def _after_warmup(self) -> int:
        return max(0, int(self.routing_step) - self.warmup_steps)

    def current_eta(self) -> float | None:
        """The certainty threshold in force: eval_eta, or the annealed training threshold (None
        during the warm-up)."""
        if not self.training:
            return self.eval_eta
        if self.train_eta is None or self.in_warmup():
            return None
        steps = self.eta_anneal_steps
        progress = 1.0 if steps == 0 else min(1.0, self._after_warmup() / steps)
        return self.train_eta_start + (self.train_eta - self.train_eta_start) * progress

    def current_kl_weight(self) -> float:
        """The KL weight in force: elbo_weight at evaluation; in training 0 during the warm-up,
        then annealed linearly to elbo_weight over `kl_anneal_steps` calls."""
        if not self.training:
            return self.elbo_weight
        if self.in_warmup():
            return 0.0
        steps = self.kl_anneal_steps
        return self.elbo_weight * (1.0 if steps == 0 else min(1.0, self._after_warmup() / steps))

    def certainty(self, concentration: Tensor) -> Tensor:
        """Normalised certainty in [0, 1] per token (see `gate` in the module docstring)."""
        if self.gate == "dirichlet_entropy":
            return normalised_certainty(concentration)
        mean = concentration / concentration.sum(-1, keepdim=True)
        return 1.0 - categorical_entropy(mean) / math.log(len(EXPERTS))

    # -- experts ---------------------------------------------------------------------------
    def _split_heads(self, y: Tensor) -> Tensor:  # [B, L, H·d] -> [B, H, L, d] (H: q's or K/V's heads)
        heads = y.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        # Under torch.compile (AOT autograd) the linear expert's backward hands this view a gradient
        # whose strides differ from the traced ones and the backward view fails; a contiguous copy
        # avoids it. Eager mode keeps the free view.
        return heads.contiguous() if torch.compiler.is_compiling() else heads

    def _projection(self, index: int, part: slice) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) rows `part` of expert `index`'s Q/K/V projection (the shared one if any)."""
        projection = self.expert_qkv[0 if self.share_qkv else index]
        return projection.weight[part], None if projection.bias is None else projection.bias[part]

    def _rotate(self, t: Tensor, positions: Tensor, cache: dict, rows: Tensor | None = None) -> Tensor:
        """`rotate` with the angles of `positions` computed once per forward (three experts' keys
        and queries share them); `rows` [B, M] picks the angles of selected rows."""
        if not self.rotary:
            return t
        if "angles" not in cache:
            cache["angles"] = rotary_angles(positions, self.head_dim, self.rotary_base)
        return apply_rotary(t, *cache["angles"], rows)

    def _project_keys_values(self, experts: list[int], x: Tensor, positions: Tensor, cache: dict) -> None:
        """Fill `cache` with the keys/values of several experts from one product: the experts'
        K/V weight rows concatenated, so x is read once and BLAS runs one [T, D] x [D, 2·n·H·d]
        product instead of n narrower ones (measured ~25% faster for three experts at T=4096,
        D=256). Same values as `_keys_values` per expert (each output column is the same dot
        product); gradients reach each expert's weights through the concatenation."""
        part = slice(self.heads * self.head_dim, None)
        weights, biases = zip(*(self._projection(index, part) for index in experts), strict=True)
        bias = None if biases[0] is None else torch.cat(biases)
        keys_values = F.linear(x, torch.cat(weights), bias).chunk(len(experts), -1)
        for index, projected in zip(experts, keys_values, strict=True):
            k, v = projected.chunk(2, -1)
            cache[index] = (self._rotate(self._split_heads(k), positions, cache), self._split_heads(v))

    def _keys_values(self, index: int, x: Tensor, positions: Tensor, cache: dict) -> tuple[Tensor, Tensor]:
        key = 0 if self.share_qkv else index  # shared projections: one K/V for every expert
        if key not in cache:
            k, v = F.linear(x, *self._projection(index, slice(self.heads * self.head_dim, None))).chunk(2, -1)
            cache[key] = (self._rotate(self._split_heads(k), positions, cache), self._split_heads(v))
        return cache[key]

    def _queries(self, index: int, x_rows: Tensor, positions: Tensor, cache: dict | None = None,
                 rows: Tensor | None = None) -> Tensor:
        """Expert `index`'s rotated queries of x_rows: every position of `positions` [B, T], or
        with `rows` [B, M] the selected ones (x_rows then holds those rows)."""
        q = F.linear(x_rows, *self._projection(index, slice(0, self.heads * self.head_dim)))
        return self._rotate(self._split_heads(q), positions, {} if cache is None else cache, rows)

    def _dense(self, index: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        batch, heads, length, dim = q.shape
        if EXPERTS[index] == "full":
            out = full_attention(q, k, v, mask=mask, causal=self.causal)
            return out, full_attention_flops(batch, heads, length, length, dim, self.causal, mask is not None)
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)  # the linear and local kernels: one head count
        if EXPERTS[index] == "linear":
            out = linear_attention(q, k, v, mask=mask, causal=self.causal, chunk=self.linear_chunk)
            return out, linear_attention_flops(batch, heads, length, dim, dim, self.causal, self.linear_chunk)
        out = local_attention(q, k, v, window=self.window, mask=mask, causal=self.causal)
        return out, local_attention_flops(batch, heads, length, dim, self.window, self.causal)

    def _rows(self, index: int, q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor,
              mask: Tensor | None) -> tuple[Tensor, int]:
        name = EXPERTS[index]
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)  # the rows kernels: one head count
        if name == "full":
            return full_attention_rows(q_rows, k, v, rows, valid, mask=mask, causal=self.causal,
                                       chunk=self.full_chunk)
        if name == "linear":
            return linear_attention_rows(q_rows, k, v, rows, valid, mask=mask, causal=self.causal,
                                         chunk=self.linear_chunk)
        return local_attention_rows(q_rows, k, v, rows, valid, window=self.window, mask=mask,
                                    causal=self.causal)

    def _expert(self, index: int, x: Tensor, positions: Tensor, mask: Tensor | None, route: Tensor | None,
                weight: Tensor, cache: dict, out: Tensor) -> tuple[Tensor, int, int]:
        """out + weight_i · E_i(x) on the expert's rows, executed FLOPs, rows computed."""
        if route is not None and not bool(route.any()):  # no token chose this expert: skip its K/V too
            return out, 0, 0
        k, v = self._keys_values(index, x, positions, cache)
        if route is None or bool(route.all()):
            q = self._queries(index, x, positions, cache)
            heads_out, flops = self._dense(index, q, k, v, mask)
            y = self.expert_out[index](self.merge_heads(heads_out, x))
            return out + weight[..., None] * y, flops, x.shape[0] * x.shape[1]
        rows, valid = select_rows(route)
        # Whole rows of the flattened [B·T, D] tensors: index_select / index_add copy rows, where
        # gather / scatter_add with an expanded index work element by element (3-5x slower here).
        batch, length, width = x.shape
        flat_rows = (rows + length * torch.arange(batch, device=x.device)[:, None]).flatten()
        x_rows = x.reshape(batch * length, width).index_select(0, flat_rows).view(batch, -1, width)
        q_rows = self._queries(index, x_rows, positions, cache, rows)
        heads_out, flops = self._rows(index, q_rows, k, v, rows, valid, mask)
        y = self.expert_out[index](self.merge_heads(heads_out, x))
        # Padding slots point at position 0 with weight 0: they add nothing.
        row_weight = (weight.gather(1, rows) * valid.to(weight.dtype))[..., None]
        # In place: the out-of-place index_add would copy the whole [B·T, D] sum per expert first.
        out.view(batch * length, width).index_add_(0, flat_rows, (row_weight * y).flatten(0, 1))
        return out, flops, int(valid.sum())

    # -- the contract ----------------------------------------------------------------------
    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        # Routing runs in fp32 whatever the model's dtype: the Dirichlet sampler has no bf16/fp16
        # kernel, and the KL's lgamma/digamma differences lose most of their digits in 8-11 bits.
        concentration = _at_least_fp32(self.router(x, positions))  # [B, T, K]
        mean = concentration / concentration.sum(-1, keepdim=True)
        warmup = self.in_warmup()
        if warmup:
            weights = torch.tensor(self.warmup_mixture, dtype=mean.dtype, device=mean.device).expand_as(mean)
        elif self.training and self.sample_routing:
            weights = torch.distributions.Dirichlet(concentration).rsample()
        else:
            weights = mean
        eta, kl_weight = self.current_eta(), self.current_kl_weight()
        if self.training:
            self.routing_step += 1
        routes: list[Tensor | None] = [None] * len(EXPERTS)
        hard = None
        if self.forced_shares is not None:
            eta, hard = 0.0, torch.ones_like(mean[..., 0], dtype=torch.bool)
            choice = self._forced_choice(positions, mean[..., 0])
            one_hot = F.one_hot(choice, len(EXPERTS)).to(weights.dtype)
            weights = one_hot * (1.0 + weights - weights.detach())
            routes = [choice == i for i in range(len(EXPERTS))]
        elif eta is not None:
            hard = self.certainty(concentration) >= eta
            choice = mean.argmax(-1)
            one_hot = F.one_hot(choice, len(EXPERTS)).to(weights.dtype)
            straight_through = one_hot * (1.0 + weights - weights.detach())
            weights = torch.where(hard[..., None], straight_through, weights)
            routes = [~hard | (choice == i) for i in range(len(EXPERTS))]
        weights = weights.to(x.dtype)  # the experts' outputs are mixed in the model's dtype

        out, flops, cache, rows_computed = x.new_zeros(x.shape), 0, {}, []
        if not self.share_qkv:  # the K/V of every expert some token uses, in one product
            used = [index for index, route in enumerate(routes) if route is None or bool(route.any())]
            if len(used) > 1:
                self._project_keys_values(used, x, positions, cache)
        for index in range(len(EXPERTS)):
            out, expert_flops, computed = self._expert(
                index, x, positions, mask, routes[index], weights[..., index], cache, out)
            flops += expert_flops
            rows_computed.append(computed)

        kl = dirichlet_kl(concentration, self.router.prior.to(concentration.dtype))
        real = None if mask is None else mask.to(concentration.dtype)
        aux_loss = kl_weight * _masked_mean(kl, real) if kl_weight else kl.new_zeros(())
        stats = self._stats(concentration, mean, kl, hard, real, flops, rows_computed, eta, kl_weight, x)
        return AttentionOutput(out=out, aux_loss=aux_loss, stats=stats)

    # -- cached decoding ---------------------------------------------------------------------
    @property
    def supports_cache(self) -> bool:
        # The paper's position feature pos / (T - 1) (position_scale=None) changes every token's
        # routing as T grows, so only a fixed `position_scale` (the default) can be decoded.
        return self.router.position_scale is not None

    def decode(self, x: Tensor, *, positions: Tensor, cache: dict, meta_mask: Tensor | None = None) -> Tensor:
        """Cached decoding (see AttentionLayer.decode), always as at evaluation: posterior-mean
        weights, hard routing by `eval_eta`. Every expert advances its cache on every token (later
        tokens may route to it) — keys/values for full, the window's last keys for local, the
        running state for linear; an expert that no new token is routed to computes nothing else
        (no queries, no attention, no output projection), so a hard-routed token runs only its
        expert.
        Needs a fixed `position_scale` (the default): the paper's pos / (T - 1) feature
        (position_scale=None) depends on the final length."""
        if not self.supports_cache:
            raise ValueError("meta: cached decoding needs a fixed position_scale (the default); with "
                             "position_scale=None the feature pos / (T - 1) changes with every new token")
        self.check_decode(x, positions)
        start = cache.get("length", 0)
        concentration = _at_least_fp32(self.router(x, positions))  # as in forward
        weights = concentration / concentration.sum(-1, keepdim=True)
        if self.eval_eta is not None:
            hard = self.certainty(concentration) >= self.eval_eta
            one_hot = F.one_hot(weights.argmax(-1), len(EXPERTS)).to(weights.dtype)
            weights = torch.where(hard[..., None], one_hot, weights)
        weights = weights.to(x.dtype)
        out, keys_values = x.new_zeros(x.shape), {}
        for index, name in enumerate(EXPERTS):
            k, v = self._keys_values(index, x, positions, keys_values)
            expert_cache = cache.setdefault(name, {})
            window = self.window if name == "local" else None
            if not bool((weights[..., index] != 0).any()):
                # Every new token is hard-routed elsewhere: this expert only takes their keys and
                # values (later tokens may route to it) — no queries, attention or output projection.
                if name == "linear":
                    advance_linear_state(feature_map(k), v, expert_cache)
                else:
                    append_keys_values(expert_cache, k, v)
                    if window is not None:
                        trim_keys_values(expert_cache, window - 1)
                continue
            q = self._queries(index, x, positions, keys_values)
            if not expert_cache:  # a prefill: the expert's parallel kernel, then its cache
                heads_out = self._dense(index, q, k, v, None)[0]
                if name == "linear":
                    start_linear_state(feature_map(k), v, expert_cache)
                else:
                    append_keys_values(expert_cache, k, v)
            elif name == "linear":
                phi_q, phi_k = feature_map(q), feature_map(k)
                heads_out = linear_attention_step(phi_q, phi_k, v, expert_cache, DEFAULT_EPS)
            else:
                k_all, v_all, key_start = append_keys_values(expert_cache, k, v)
                heads_out = cached_softmax_attention(q, k_all, v_all, start, key_start, window=window)
            if window is not None:
                trim_keys_values(expert_cache, window - 1)
            out = out + weights[..., index, None] * self.expert_out[index](self.merge_heads(heads_out, x))
        cache["length"] = start + x.shape[1]
        return out

    @torch.no_grad()
    def _stats(self, concentration, mean, kl, hard, real, flops, rows_computed, eta, kl_weight,
               x) -> dict[str, Tensor]:
        def average(values: Tensor) -> Tensor:
            return _masked_mean(values, real)

        batch, length, _ = x.shape
        mean_weights = torch.stack([average(mean[..., i]) for i in range(len(EXPERTS))])
        costs = torch.tensor(self.costs, dtype=mean.dtype, device=mean.device)
        full_flops = full_attention_flops(batch, self.heads, length, length, self.head_dim, self.causal,
                                          real is not None)
        stats = {f"weight_{name}": mean_weights[i] for i, name in enumerate(EXPERTS)}
        stats.update({
            "routing_entropy_pct": 100.0 * average(categorical_entropy(mean)) / math.log(len(EXPERTS)),
            "mean_weight_entropy": categorical_entropy(mean_weights),
            "uncertainty": average(dirichlet_entropy(concentration)),
            "kl": average(kl),
            "projected_cost": average((mean * costs).sum(-1)),
            "hard_fraction": average(hard.to(mean.dtype)) if hard is not None else mean.new_zeros(()),
            "flops": torch.tensor(float(flops)),
            "flops_vs_full": torch.tensor(flops / full_flops),
            "eta": torch.tensor(float("nan") if eta is None else eta),
            "kl_weight": torch.tensor(float(kl_weight)),
        })
        for name, computed in zip(EXPERTS, rows_computed, strict=True):
            stats[f"rows_{name}"] = torch.tensor(computed / (batch * length))
        return {key: value.detach() for key, value in stats.items()}

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", window={self.window}, costs={self.costs}, gate={self.gate}, "
                f"eval_eta={self.eval_eta}, train_eta={self.train_eta}")
