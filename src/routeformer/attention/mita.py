"""`mita`: compress-and-route attention (MiTA, Wen et al., arXiv 2602.01219).

Landmark queries (average-pooled queries) probe every key: their top-K keys form E deformable
experts, and their softmax-weighted values form one shared compressed expert. Every query reads
the shared expert and the R experts whose landmarks it matches best (see `routeformer.ops.mita`
for the algorithm, the causal variant and its diagram).

Presets (`preset=`):
- "mita" (default): shared expert + routed experts, as configured;
- "agent": topk = 0, compression only — Agent attention (queries -> landmarks -> keys);
- "route_only": no shared expert, each query reads only its routed experts' keys.
A preset overrides the `topk` / `shared` arguments it sets.

`landmarks`, `topk` and `route` may be changed at inference without retraining (`set_budget`):
the layer has no parameter whose shape depends on them.

Causal builds stream: the sequence is cut into blocks of `block` tokens (default
`ops.mita.DEFAULT_BLOCK` = 64, fixed at construction, whatever the input length); a landmark is the
mean query of a completed block, and `landmarks` caps how many of the most recent completed blocks
a query reads (their landmarks and experts). So `layer(x[:, :t]).out == layer(x).out[:, :t]`, and
generating token by token computes what training computed. Options larger than the input keep
their streaming meaning and are not clamped: `block` > T makes the input one block (exact causal
attention), `landmarks` > completed blocks reads all of them, `topk` > the keys before a block
leaves its expert partly empty. Bidirectional builds have no blocks (a `block` option is accepted,
so one options dict serves both builds, and ignored: `layer.block` is None); there
`topk` > T gives experts that hold every key and `landmarks` > T windows of one token (some
repeated) — both warn once per layer, since the budget then buys nothing.

Padding: padded tokens take no place in the layout (windows and blocks count real tokens only), are
never pooled into a landmark, never routed to and never in the shared expert.

Cached decoding (`CausalLM.generate`, `decode`): causal builds keep every key, the incomplete
block's queries and each completed block's landmark, shared value and expert
(`routeformer.ops.mita.decode`); new tokens get the parallel pass's outputs.

stats: `flops` (executed), `flops_vs_full` (against dense attention over the same N),
`expert_load_max` (the busiest expert's share of routed queries times E: 1 = perfectly balanced).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops.backends import profile_range
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.mita import DEFAULT_BLOCK, DEFAULT_PACK, check_mita_args, mita_attention, mita_decode

PRESETS: dict[str, dict[str, object]] = {
    "mita": {},
    "agent": {"topk": 0, "shared": True},
    "route_only": {"shared": False},
}


@register_attention("mita", grid_aware=True)
class MitaAttention(AttentionLayer):
    """MiTA attention with E `landmarks`, `topk` keys per expert and `route` experts per query.

    Causal: `block` tokens per landmark (default DEFAULT_BLOCK), `landmarks` = how many of the most
    recent completed blocks a query reads. Vision inputs: `grid=(h, w)` pools the landmarks in 2-D
    over the token grid, and `extra_tokens` leading tokens (a CLS token) are left out of the
    pooling. `pack` is the number of queries per packed block of one expert (a speed knob; results
    do not depend on it).

    Args (beyond dim, heads, causal): landmarks, topk, route, shared, preset, grid, extra_tokens,
    pack, block (above and in the module docstring), and the common options of `AttentionLayer`
    (head_dim, bias, rotary, rotary_base, kv_heads). kv_heads < heads: the parameters and the
    decode cache hold kv_heads K/V heads, and every query head's landmarks (its own pooled
    queries) select their experts among the keys of its K/V head, the shared expert reading its
    values. The op (ops/mita, parallel and cached) takes one head count, so each K/V head is
    repeated for its query heads at call time, a copy of K/V per query head.

    Low precision (bf16/fp16 weights, or torch.autocast): routing is computed in fp32 whatever the
    dtype — the q/k projection runs in fp32 (from the stored, possibly rounded, weights; under
    autocast from the fp32 weights), and the op keeps its landmark scores, routing logits and softmax
    in fp32 with autocast switched off inside. A bf16 layer therefore routes as the fp32 layer with
    the same stored weights does; under autocast, as the fp32 model itself does. (A model cast to
    bf16 rounds its weights, which moves routing logits by ~2e-3 relative: a near-tied choice can
    still flip there; tests/attention/test_mita_precision.py measures both.) Cost: the projection in
    fp32, and fp32 keys (values stay in the model's dtype) in the decoding cache.
    """

    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, landmarks: int = 25, topk: int = 25,
        route: int = 1, shared: bool = True, preset: str = "mita",
        grid: tuple[int, int] | list[int] | None = None, extra_tokens: int = 0,
        pack: int = DEFAULT_PACK, block: int | None = None, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}; got {preset!r}")
        settings = {"topk": topk, "shared": shared, **PRESETS[preset]}
        check_positive("pack", pack)
        self.preset, self.pack = preset, pack
        self.grid = None if grid is None else tuple(grid)
        self.extra_tokens = extra_tokens
        if block is not None:
            check_positive("block", block)
        # A bidirectional build has no blocks (it pools `landmarks` windows): it accepts `block` so
        # that one options dict serves causal and bidirectional models, and ignores it (block=None).
        self.block = (DEFAULT_BLOCK if block is None else block) if self.causal else None
        self._warned_oversized = False
        self.shared = bool(settings["shared"])
        self.set_budget(landmarks=landmarks, topk=settings["topk"], route=route)

    @classmethod
    def budget_options(cls, seq_len: int, keys: int) -> dict[str, int]:
        """From T = 8·keys on: blocks and experts of `keys` keys, every completed block's landmark
        (T / keys of them); below, T/8 landmarks of T/8 keys (causal: blocks of T/8)."""
        if seq_len >= 8 * keys:
            return {"landmarks": seq_len // keys, "topk": keys, "block": keys}
        budget = max(1, seq_len // 8)  # causal: blocks of T/8, every completed block's landmark read
        return {"landmarks": budget, "topk": budget, "block": budget}

    def set_budget(self, *, landmarks: int | None = None, topk: int | None = None,
                   route: int | None = None) -> None:
        """Change E, K or R (e.g. at inference; the paper's robustness study). None keeps a value."""
        landmarks = getattr(self, "landmarks", None) if landmarks is None else landmarks
        topk = getattr(self, "topk", None) if topk is None else topk
        route = getattr(self, "route", None) if route is None else route
        # Validated against the smallest input that fits them; each call checks its own length.
        length = self.extra_tokens + (landmarks if self.grid is None else self.grid[0] * self.grid[1])
        check_mita_args(length, landmarks=landmarks, topk=topk, route=route, causal=self.causal,
                        grid=self.grid, extra_tokens=self.extra_tokens, block=self.block)
        if not self.shared and topk == 0:
            raise ValueError("topk=0 without the shared expert leaves a query nothing to read; "
                             "use preset='agent' (shared, topk=0) or topk >= 1")
        self.landmarks, self.topk, self.route = landmarks, topk, route

    def check_packable(self) -> None:
        if self.grid is not None or self.extra_tokens:
            raise ValueError("mita: packed documents need a 1-D build; grid / extra_tokens pool landmarks "
                             "over a fixed image layout, which a document of another length does not have")

    def project_qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, H, T, d]; for bf16/fp16 inputs or under autocast, q and k in fp32 (computed
        in fp32 from the stored weights), so that landmarks, expert keys and routing are decided in
        fp32 (v comes back in x's dtype: it is not part of any decision)."""
        if x.dtype not in (torch.bfloat16, torch.float16) and not torch.is_autocast_enabled(x.device.type):
            return super().project_qkv(x, positions)
        bias = self.qkv_proj.bias
        with torch.autocast(x.device.type, enabled=False):
            qkv = F.linear(x.float(), self.qkv_proj.weight.float(), None if bias is None else bias.float())
            q, k, v = self.split_projection(qkv, positions)
            return q, k, v.to(x.dtype)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        self._warn_if_oversized(x.shape[1])
        q, k, v = self.project_qkv(x, positions)
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)  # the op takes one head count
        # `bench layers --split` reads the range (the op marks its routing inside it).
        with profile_range("attention"):
            result = mita_attention(
                q, k, v.to(q.dtype), landmarks=self.landmarks, topk=self.topk, route=self.route,
                shared=self.shared, causal=self.causal, block=self.block, grid=self.grid,
                extra_tokens=self.extra_tokens, mask=mask, pack=self.pack,
            )
        batch, heads, length, dim = q.shape
        full = batch * heads * dense_attention_flops(length * length, dim)
        load = result.expert_load
        stats = {
            "flops": torch.tensor(float(result.flops)),
            "flops_vs_full": torch.tensor(result.flops / full),
            # The busiest expert's share times E (0 when no expert exists: one causal block).
            "expert_load_max": (load.max() * load.numel()).detach().float() if load.numel()
            else torch.tensor(0.0),
        }
        out = self.out_proj(self.merge_heads(result.out.to(x.dtype), x))
        return AttentionOutput(out=out, aux_loss=x.new_zeros(()), stats=stats)

    @property
    def supports_cache(self) -> bool:
        """Causal builds decode token by token (`ops/mita/decode.py`): the streaming layout fixes a
        block's landmark and expert once the block is complete, so a cache can hold them."""
        return self.causal

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        # q, k may be fp32 where v is bf16/fp16 (project_qkv): the heads come back in v's dtype.
        return mita_decode(q, k, v, start, cache, landmarks=self.landmarks, topk=self.topk,
                           route=self.route, shared=self.shared, block=self.block).to(v.dtype)

    def _warn_if_oversized(self, length: int) -> None:
        """Bidirectional budgets larger than the input are kept (not clamped) but buy nothing: say
        so once per layer. (Causal ones are the streaming definition: early tokens always see
        fewer blocks and keys than the budget.)"""
        if self.causal or self._warned_oversized:
            return
        pooled = length - self.extra_tokens
        if self.topk > length or (self.grid is None and self.landmarks > pooled):
            self._warned_oversized = True
            warnings.warn(
                f"mita: topk={self.topk} / landmarks={self.landmarks} exceed a length-{length} input: "
                "each expert holds every key (topk > T) and landmarks pool one-token windows, some "
                "repeated (landmarks > T); results are exact, the budget buys nothing", stacklevel=3)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", preset={self.preset!r}, landmarks={self.landmarks}, "
                f"topk={self.topk}, route={self.route}, shared={self.shared}, block={self.block}, "
                f"grid={self.grid}, extra_tokens={self.extra_tokens}")
