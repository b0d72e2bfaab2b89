"""`expanding`: softmax attention under a geometric prior over distance, window inferred per query.

Singh & Buckley, "Attention as Implicit Structural Inference" (NeurIPS 2023), §4. Every head has a
learnable Beta(α, β) hyper-prior on the geometric decay q; each query runs a few mean-field steps
that widen its window while its attention mass sits far back, and reads only the keys within its
final horizon. See `routeformer.ops.expanding` for the algorithm and the gradient rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops._compile_marks import disable_in_graphs
from routeformer.ops.decode import append_keys_values
from routeformer.ops.expanding import (
    DEFAULT_BLOCK,
    check_expanding_options,
    expanding_attention,
    expanding_decode,
    expanding_uses_native,
)
from routeformer.ops.grouped_heads import repeat_kv

_CONCENTRATION_FLOOR = 1e-4  # keeps softplus(raw) + floor a valid Beta concentration in fp32


def _inverse_softplus(value: float) -> float:
    return value + math.log(-math.expm1(-value))


@disable_in_graphs
def _band_path_outside_compiled_graphs(*args, **kwargs):
    """`expanding_attention` on its band path (padded, bidirectional, mean-field, no C compiler),
    run eagerly inside a compiled model: one graph break around it. Its Python loop over inference
    steps stops on data (`bool(going_on.any())`), which dynamo can only trace as a break per step
    and a recompile per step count. The native path needs none of this (see `forward`)."""
    return expanding_attention(*args, **kwargs)


@register_attention("expanding", every_parameter_used=True)
class ExpandingAttention(AttentionLayer):
    """Expanding attention with a learnable per-head Beta(α, β) prior on the geometric decay.

    Options: `prior_alpha`, `prior_beta` (initial concentrations, positive; the starting window is
    ceil(log(tol) / log(1 - α/(α+β))), 44 keys by default); `tol` (prior tail mass left outside the
    window); `max_iters` (inference steps); `block` (query block length of the blockwise kernel: keys
    are scored a block at a time, so up to block - 1 keys past a query's horizon are scored too);
    `update` ("paper", the default: the paper's accumulating update, which is not a mean-field step
    and whose output depends on `max_iters`; "mean_field": the true
    coordinate-ascent step, which converges; see `routeformer.ops.expanding`).
    stats: `window_mean`, `window_max` (final horizons), `iterations_mean`, `iterations_max`,
    `score_pairs` (q·k products computed), `score_ops_vs_full` (score_pairs over those of full
    attention with the same masking rule), `flops` (scores + P·V + inference steps).

    Cached decoding (causal): the cache holds every key and value (a horizon may reach back to the
    first token); a prefill is the parallel op, and each new token runs its own inference over the
    cached keys (`ops.expanding.decode`, the same recurrence for either update), scoring only the
    keys its horizon reaches.

    Common options of `AttentionLayer`: head_dim, bias, rotary, rotary_base, kv_heads. kv_heads <
    heads: the parameters and the decode cache hold kv_heads K/V heads; the kernels (C and band
    path, parallel and cached) take one head count, so each K/V head is repeated for its query
    heads at call time, a copy of K/V per query head (each query head has its own horizon).
    """

    supports_cache = True
    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, prior_alpha: float = 1.0,
        prior_beta: float = 9.0, tol: float = 0.01, max_iters: int = 8, block: int = DEFAULT_BLOCK,
        update: str = "paper", **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        for name, value in (("prior_alpha", prior_alpha), ("prior_beta", prior_beta)):
            if not (isinstance(value, float | int) and value > _CONCENTRATION_FLOOR):
                raise ValueError(f"{name} must be a number > {_CONCENTRATION_FLOOR}; got {value!r}")
        check_expanding_options(tol, max_iters, update)
        check_positive("block", block)
        self.tol, self.max_iters, self.block, self.update = tol, max_iters, block, update
        floor = _CONCENTRATION_FLOOR
        self.alpha_raw = nn.Parameter(torch.full((heads,), _inverse_softplus(prior_alpha - floor)))
        self.beta_raw = nn.Parameter(torch.full((heads,), _inverse_softplus(prior_beta - floor)))

    def prior(self) -> tuple[Tensor, Tensor]:
        """The per-head Beta concentrations (α, β), positive by construction."""
        # In fp32 whatever the model's dtype: the floor (1e-4) and the inference's counts need it.
        return (F.softplus(self.alpha_raw.float()) + _CONCENTRATION_FLOOR,
                F.softplus(self.beta_raw.float()) + _CONCENTRATION_FLOOR)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        q, k, v = self.project_qkv(x, positions)
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)  # the kernels take one head count
        alpha, beta = self.prior()
        options = {"tol": self.tol, "max_iters": self.max_iters, "mask": mask, "causal": self.causal,
                   "block": self.block, "update": self.update}
        if expanding_uses_native(q, k, v, mask=mask, causal=self.causal, update=self.update):
            # C kernels behind custom ops and statistics kept as tensors: torch.compile traces the
            # whole layer as one graph (fullgraph=True works), no host sync, no graph break.
            result = expanding_attention(q, k, v, alpha, beta, sync_stats=False, **options)
        else:
            result = _band_path_outside_compiled_graphs(q, k, v, alpha, beta, **options)
        out = self.out_proj(self.merge_heads(result.out, x))
        batch, heads, length, _ = q.shape
        full_pairs = batch * heads * (length * (length + 1) // 2 if self.causal else length * length)
        window = result.horizon.float()
        iterations = result.iterations.float()
        scored_pairs = torch.as_tensor(result.scored_pairs, dtype=torch.float64)
        stats = {
            "flops": torch.as_tensor(result.flops, dtype=torch.float64).float(),
            "window_mean": window.mean(),
            "window_max": window.max(),
            "iterations_mean": iterations.mean(),
            "iterations_max": iterations.max(),
            "score_pairs": scored_pairs.float(),
            "score_ops_vs_full": (scored_pairs / full_pairs).float(),
        }
        return AttentionOutput(out=out, aux_loss=x.new_zeros(()), stats=stats)

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        k_all, v_all, _ = append_keys_values(cache, k, v)  # kv_heads heads cached
        k_all, v_all = repeat_kv(k_all, self.heads), repeat_kv(v_all, self.heads)
        alpha, beta = self.prior()
        if start == 0:  # a prefill: the parallel op (the C kernels when they serve it)
            k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
            return expanding_attention(q, k, v, alpha, beta, tol=self.tol, max_iters=self.max_iters,
                                       causal=True, block=self.block, update=self.update).out
        # "scored_keys" (a plain int in the state): the keys this step read, for the decode benchmark.
        return expanding_decode(q, k_all, v_all, start, alpha, beta, tol=self.tol, max_iters=self.max_iters,
                                update=self.update, stats=cache)

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        """The keys and values of the window the step scored (`scored_keys`; all after a prefill)."""
        keys = cache.get("scored_keys", cache["k"].shape[2])
        per_key = (cache["k"].shape[-1] + cache["v"].shape[-1]) * cache["k"].element_size()
        # every query head scores its own window of its K/V head
        return cache["k"].shape[0] * self.heads * keys * per_key, True

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", tol={self.tol}, max_iters={self.max_iters}, "
                f"block={self.block}, update={self.update!r}")
